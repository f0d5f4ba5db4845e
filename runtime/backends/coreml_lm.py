"""An exported Core ML draft (mirrorsd.exporters.coreml_export) on macOS, KV cache as Core ML state.

Core ML predicts only on macOS; elsewhere loading raises ProviderError. The state (key/value cache
of max_context slots) lives inside Core ML; the host keeps the pointer: each token is written at
`position`, the mask hides every slot past it, so rolling back rejected draft tokens is moving the
pointer (PrefixCachedLM), exactly as with the ONNX drafter.
"""

from __future__ import annotations

import platform
from pathlib import Path

import numpy as np
import torch

from mirrorsd.errors import ExportError, ProviderError
from mirrorsd.export_format import MASK_MIN
from mirrorsd.runtime.backends.base import PrefixCachedLM


class CoreMLCausalLM(PrefixCachedLM):
    """CausalLM over a stateful Core ML package (compute units CPU_AND_NE by default: the Neural Engine)."""

    backend = "coreml"
    computes_on = "npu"
    context_hint = "re-export with a larger --max-context"
    early_exit = None
    threads = None

    def __init__(self, folder: str | Path, manifest: dict, compute_units: str | None = None) -> None:
        super().__init__()
        if platform.system() != "Darwin":
            raise ProviderError("Core ML drafts run only on macOS (Core ML cannot predict on "
                                f"{platform.system()})", "on this machine export with --format onnx and draft "
                                "on ONNX Runtime")
        try:
            import coremltools as ct
        except ImportError as exc:
            raise ProviderError("coremltools is not installed", "pip install coremltools") from exc
        path = Path(folder) / manifest["graphs"]["decode"]["file"]
        units = getattr(ct.ComputeUnit, compute_units or manifest.get("compute_units", "CPU_AND_NE"))
        try:
            self.model = ct.models.MLModel(str(path), compute_units=units)
        except Exception as exc:
            raise ExportError(f"Core ML could not load {path}: {exc}", "re-run `mirrorsd export --format coreml`") \
                from exc
        self.max_context = int(manifest["max_context"])
        self.vocab_size = int(manifest["dims"]["vocab"])
        self._state = self.model.make_state()

    def _drop(self, length: int) -> None:
        if length == 0:  # otherwise the pointer (len(_cached)) moves: later slots are masked
            self._state = self.model.make_state()

    def _feed(self, new: list[int], rows: int) -> torch.Tensor:
        logits = []
        for token in new:
            p = len(self._cached)
            mask = np.full((1, 1, 1, self.max_context), MASK_MIN, dtype=np.float16)
            mask[..., : p + 1] = 0.0
            out = self.model.predict({"input_ids": np.array([[token]], dtype=np.int32),
                                      "position": np.array([p], dtype=np.int32), "attention_mask": mask},
                                     state=self._state)
            logits.append(np.asarray(out["logits"], dtype=np.float32).reshape(-1))
            self._cached.append(token)
        return torch.from_numpy(np.stack(logits[-rows:]))
