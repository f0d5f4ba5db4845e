"""mirrorsd.exporters: draft model -> ONNX / Core ML for NPUs (issue 3; not built yet)."""
