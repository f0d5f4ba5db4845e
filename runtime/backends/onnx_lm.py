"""An exported draft (mirrorsd.exporters) on ONNX Runtime, with the KV cache held on the host.

The graphs take the cache in and give back only the new tokens' keys/values (see
mirrorsd.exporters.decoder). This class keeps the cache in numpy arrays and writes each block's new
keys/values at the write pointer; reconciling with the token history and rollback by pointer are
PrefixCachedLM's (rollback is moving the write pointer: slots past it are masked out and overwritten
by the next tokens written there).

NPU profile: every call uses a fixed shape (cache of max_context slots; a block of 1 token, or a
padded prefill chunk when several tokens are missing), as QNN / OpenVINO NPU require.
Dynamic profile: the cache up to the pointer and the missing tokens are passed as they are. With IO
binding (the default on CUDA) the cache is a torch tensor on the provider's device, inputs and outputs
are bound to device memory, and only the logits come back to the host.
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


EXACT_QUANTS = ("none", "int4", "gguf")
"""Weights whose target graph (one with a spare row: exporters/decoder.py) is batch-invariant on the CPU
provider in float32, as checked by the tests. int8's activations are quantized with one scale per tensor, so
a row's bits depend on the rows beside it; fp16 runs other kernels."""


class OnnxCausalLM(PrefixCachedLM):
    """CausalLM over one or two ONNX Runtime sessions of an export; logits come back on the host."""

    context_hint = "re-export with a larger --max-context"
    early_exit = None
    threads = None  # intra-op threads are fixed when the session is made

    def __init__(self, folder: str | Path, manifest: dict, provider: str = "CPUExecutionProvider",
                 provider_options: dict | None = None, threads: int | None = None,
                 record: Callable[[str, dict], None] | None = None, io_binding: bool | None = None) -> None:
        """io_binding: keep the cache on the provider's device (dynamic profile; None: on CUDA, where torch
        can hold the device memory). DirectML and the NPU providers use the host cache."""
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
        self.exact_batches = (bool(manifest.get("spare_row")) and self.provider == "CPUExecutionProvider"
                              and manifest.get("precision") == "fp32" and manifest.get("quant") in EXACT_QUANTS)
        self._record = record
        shape = (self.layers * 2, 1, int(dims["kv_heads"]), self.max_context, int(dims["head_dim"]))
        if io_binding is None:
            io_binding = self.provider in BINDABLE and self.provider != "CPUExecutionProvider"
        if io_binding and (self.profile != "dynamic" or self.provider not in BINDABLE):
            raise ProviderError(f"IO binding needs the dynamic profile on {' or '.join(BINDABLE)}",
                                "leave io_binding unset")
        self._bound = _DeviceCache(shape, BINDABLE[self.provider]) if io_binding else None
        if not io_binding:
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
            run = self._run_bound if self._bound is not None else self._run_block
            out.append(run(name, new[:n], block)[:n])
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


    def _run_bound(self, name: str, block_tokens: list[int], block: int) -> np.ndarray:
        """The dynamic graph with inputs and outputs bound to device memory (the cache never leaves it)."""
        p, n, cache = len(self._cached), len(block_tokens), self._bound
        session = self.sessions[name]
        binding = session.io_binding()
        feeds = {"input_ids": torch.tensor([block_tokens]), "position_ids": torch.arange(p, p + n)[None],
                 "attention_mask": torch.from_numpy(block_mask(p, p, n))}
        keep: list[torch.Tensor] = []
        for key, value in feeds.items():
            cache.bind(binding.bind_input, key, value.to(cache.device), keep)
        for j in range(2 * self.layers):
            cache.bind(binding.bind_input, self.input_names[3 + j], cache.kv[j, :, :, :p], keep)
        logits = torch.empty((1, n, self.vocab_size), device=cache.device)
        new = torch.empty((2 * self.layers, *cache.kv.shape[1:3], n, cache.kv.shape[4]), device=cache.device)
        cache.bind(binding.bind_output, "logits", logits, keep)
        for j in range(2 * self.layers):
            cache.bind(binding.bind_output, self.output_names[1 + j], new[j], keep)
        try:
            session.run_with_iobinding(binding)
        except Exception as exc:  # onnxruntime raises its own exception types
            raise ProviderError(f"{self.provider} failed to run the export's {name} graph: "
                                f"{str(exc).splitlines()[0]}", "run `mirrorsd export --validate DIR`") from exc
        cache.kv[:, :, :, p:p + n] = new
        self._cached.extend(block_tokens)
        return logits[0].cpu().numpy()  # [n, V]


# Providers whose device memory torch can hold, so IO binding can keep the cache there.
BINDABLE = {"CPUExecutionProvider": "cpu", "CUDAExecutionProvider": "cuda"}


class _DeviceCache:
    """The KV cache as one torch tensor on the provider's device, and binding of tensors to IO names."""

    def __init__(self, shape: tuple[int, ...], device: str) -> None:
        self.device = torch.device(device)
        self.kv = torch.zeros(shape, device=self.device)  # [2 * layers, 1, n_kv, slots, d]

    def bind(self, bind, name: str, tensor: torch.Tensor, keep: list) -> None:
        """Bind `tensor` (kept alive in `keep` until the run is over: the binding holds only its pointer)."""
        tensor = tensor.contiguous()
        keep.append(tensor)
        bind(name, self.device.type, self.device.index or 0, _NUMPY[tensor.dtype], list(tensor.shape),
             tensor.data_ptr())


_NUMPY = {torch.float32: np.float32, torch.int64: np.int64}


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
