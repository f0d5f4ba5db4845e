"""Writing ONNX files: the graph beside its weights, as every export and transform here saves them."""

from __future__ import annotations

import os
from pathlib import Path


def save_external(model_proto, path: Path) -> None:
    """Save an ONNX model with its weights in `<name>.data` beside it (always: > 2 GB models need it)."""
    import onnx

    path.parent.mkdir(parents=True, exist_ok=True)
    data = path.name + ".data"
    if (path.parent / data).exists():
        os.remove(path.parent / data)
    onnx.save_model(model_proto, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=data, size_threshold=1024)
