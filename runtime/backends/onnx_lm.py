"""An exported draft (mirrorsd.exporters) on ONNX Runtime, with the KV cache held on the host.

The graphs take the cache in and give back only the new tokens' keys/values (see
mirrorsd.exporters.decoder). This class keeps the cache in numpy arrays and writes each block's new
keys/values at the write pointer; reconciling with the token history and rollback by pointer are
PrefixCachedLM's (rollback is moving the write pointer: slots past it are masked out and overwritten
by the next tokens written there).

NPU profile: every call uses a fixed shape (cache of max_context slots; a block of 1 token, or a
padded prefill chunk when several tokens are missing), as QNN / OpenVINO NPU require.
Dynamic profile: the cache up to the pointer and the missing tokens are passed as they are.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from mirrorsd.errors import ExportError, ProviderError
from mirrorsd.export_format import block_mask, io_names
from mirrorsd.runtime.backends.base import PrefixCachedLM

SHORT = {"CPUExecutionProvider": "CPU", "CoreMLExecutionProvider": "CoreML", "QNNExecutionProvider": "QNN",
         "OpenVINOExecutionProvider": "OpenVINO", "DmlExecutionProvider": "DML", "VitisAIExecutionProvider": "VitisAI",
         "CUDAExecutionProvider": "CUDA"}
GPU_PROVIDERS = frozenset({"CUDAExecutionProvider", "DmlExecutionProvider"})
PREFILL_MIN = 4  # missing tokens from which a padded prefill chunk beats that many decode steps


class OnnxCausalLM(PrefixCachedLM):
    """CausalLM over one or two ONNX Runtime sessions of an export; logits come back on the host."""

    context_hint = "re-export with a larger --max-context"
    early_exit = None
    threads = None  # intra-op threads are fixed when the session is made

    def __init__(self, folder: str | Path, manifest: dict, provider: str = "CPUExecutionProvider",
                 provider_options: dict | None = None, threads: int | None = None,
                 record: Callable[[str, dict], None] | None = None) -> None:
        from mirrorsd.devices.providers import make_sessions, provider_name

        super().__init__()
        self.folder = Path(folder)
        self.manifest = manifest
        self.profile = manifest["profile"]
        self.max_context = int(manifest["max_context"])
        dims = manifest["dims"]
        self.vocab_size = int(dims["vocab"])
        self.layers = int(dims["layers"])
        self.input_names, self.output_names = io_names(self.layers)
        self.blocks = {name: g["block"] for name, g in manifest["graphs"].items()}
        self.sessions = make_sessions(self.folder, manifest, provider, provider_options, threads)
        self.provider = provider_name(provider)
        self.backend = f"onnx:{SHORT.get(self.provider, self.provider)}"
        self.computes_on = compute_kind(self.provider)
        self._record = record
        shape = (self.layers * 2, 1, int(dims["kv_heads"]), self.max_context, int(dims["head_dim"]))
        self._kv = np.zeros(shape, dtype=np.float32)  # [2 * layers, 1, n_kv, slots, d]; k0, v0, k1, ...

    def _drop(self, length: int) -> None:
        pass  # the pointer is len(_cached): slots past it are masked and overwritten

    def _feed(self, new: list[int], rows: int) -> torch.Tensor:
        """Run the missing tokens through the graphs; logits [rows, V] of the last rows."""
        out: list[np.ndarray] = []
        while new:
            if self.profile == "npu":
                chunk = self.blocks["prefill"]
                name = "prefill" if len(new) >= PREFILL_MIN else "decode"
                block = chunk if name == "prefill" else 1
            else:
                name, block = "model", len(new)
            n = min(block, len(new))
            out.append(self._run_block(name, new[:n], block)[:n])
            new = new[n:]
        return torch.from_numpy(np.ascontiguousarray(np.concatenate(out)[-rows:], dtype=np.float32))

    def _run_block(self, name: str, block_tokens: list[int], block: int) -> np.ndarray:
        p, n = len(self._cached), len(block_tokens)
        static = self.profile == "npu"
        ids = np.zeros((1, block), dtype=np.int64)
        ids[0, :n] = block_tokens
        positions = np.minimum(np.arange(p, p + block, dtype=np.int64), self.max_context - 1)[None]
        past_len = self.max_context if static else p
        feeds = {"input_ids": ids, "position_ids": positions,
                 "attention_mask": block_mask(p, past_len, block, n)}
        for j in range(2 * self.layers):
            feeds[self.input_names[3 + j]] = self._kv[j, :, :, :past_len] if static else \
                np.ascontiguousarray(self._kv[j, :, :, :p])
        if self._record is not None:
            self._record(name, feeds)
        try:
            result = self.sessions[name].run(None, feeds)
        except Exception as exc:  # onnxruntime raises its own exception types
            raise ProviderError(f"{self.provider} failed to run the exported draft's {name} graph: "
                                f"{str(exc).splitlines()[0]}",
                                "run `mirrorsd export --validate DIR`, or pick another provider "
                                "(--draft-device cpu)") from exc
        for j in range(2 * self.layers):
            self._kv[j, :, :, p:p + n] = result[1 + j][:, :, :n]
        self._cached.extend(block_tokens)
        return result[0][0]  # [block, V]


def compute_kind(provider: str) -> str:
    """Whose compute an ONNX Runtime provider uses: the CPU's, a GPU's, or (every other one) an NPU's."""
    return "cpu" if provider == "CPUExecutionProvider" else "gpu" if provider in GPU_PROVIDERS else "npu"


def calibration_feeds(folder: Path, blocks: dict[str, int | None], max_context: int, dims: dict,
                      prompts: list[list[int]], per_graph: int = 24) -> dict[str, list[dict]]:
    """Real inputs for static int8 calibration: each prompt prefilled, then greedily continued on
    the fp32 graphs, recording what each graph was fed."""
    manifest = {"profile": "npu", "max_context": max_context, "dims": dims,
                "graphs": {name: {"file": f"{name}.onnx", "block": b} for name, b in blocks.items()}}
    seen: dict[str, list[dict]] = {name: [] for name in blocks}

    def record(name: str, feeds: dict) -> None:
        if len(seen[name]) < per_graph:
            seen[name].append({k: np.array(v) for k, v in feeds.items()})

    lm = OnnxCausalLM(folder, manifest, record=record)
    for prompt in prompts:
        context = list(prompt)[: max_context - 16]
        lm.reset()
        for _ in range(min(12, max_context - len(context))):
            context.append(int(lm.score(context)[-1].argmax()))
    for name, feeds in seen.items():
        if not feeds:
            raise ExportError(f"no calibration inputs reached the {name} graph",
                              "give calibration prompts of at least a few tokens")
    return seen
