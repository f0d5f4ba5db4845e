"""The one loader of exports (`mirrorsd export` folders): the export as a CausalLM on a backend."""

from __future__ import annotations

from pathlib import Path

from mirrorsd.contracts import CausalLM
from mirrorsd.export_format import read_manifest


def load_export_lm(path: str | Path, manifest: dict | None = None, backend: str = "cpu",
                   threads: int | None = None) -> CausalLM:
    """The export in `path` on `backend`: "coreml" for a Core ML export, else an ONNX Runtime provider
    (a full name such as "QNNExecutionProvider" or a short one: cpu, qnn, openvino, dml, cuda, ...).
    threads: intra-op threads of ONNX Runtime sessions (None: ONNX Runtime's default)."""
    manifest = manifest or read_manifest(path)
    if manifest["format"] == "coreml":
        from mirrorsd.runtime.backends.coreml_lm import CoreMLCausalLM

        return CoreMLCausalLM(path, manifest)
    from mirrorsd.devices.providers import provider_name
    from mirrorsd.runtime.backends.onnx_lm import OnnxCausalLM

    return OnnxCausalLM(path, manifest, provider_name(backend), threads=threads)
