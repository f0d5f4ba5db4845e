#!/usr/bin/env bash
# Create .venv and install mirrorsd into it (editable), with the test extras.
# torch is pinned to 2.13.0 here only because that CPU wheel ships on this project's machines;
# a bare `torch` requirement would download a multi-GB CUDA build. Elsewhere any torch >= 2.5 works.
# The test extras include the llama.cpp backend: llama-cpp-python is published as source, so the first
# install compiles llama.cpp (several minutes; pip keeps the built wheel in its cache for later installs).
# We skip its multimodal library (unused) and build on every core. For a GPU build set CMAKE_ARGS, e.g.
# CMAKE_ARGS="-DGGML_CUDA=on" (or -DGGML_METAL=on, -DGGML_VULKAN=on), with pip's --no-cache-dir.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
export CMAKE_ARGS="${CMAKE_ARGS:--DLLAVA_BUILD=OFF}"
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc 2>/dev/null || echo 2)}"
.venv/bin/python -m pip install -q "torch==2.13.0" -e ".[test]"
