#!/usr/bin/env bash
# Create .venv and install mirrorsd into it (editable), with the test extras.
# torch is pinned to 2.13.0 here only because that CPU wheel ships on this project's machines;
# a bare `torch` requirement would download a multi-GB CUDA build. Elsewhere any torch >= 2.5 works.
# The test extras include the llama.cpp backend: llama-cpp-python is published as source, so the first
# install compiles llama.cpp, patched (several minutes; the built wheel is cached for later installs, see below).
# We skip its multimodal library (unused) and build on every core. For a GPU build set CMAKE_ARGS, e.g.
# CMAKE_ARGS="-DGGML_CUDA=on" (or -DGGML_METAL=on, -DGGML_VULKAN=on); new flags mean a new build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
export CMAKE_ARGS="${CMAKE_ARGS:--DLLAVA_BUILD=OFF}"
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc 2>/dev/null || echo 2)}"
if [ "$(uname -s)-$(uname -m)" = Linux-x86_64 ]; then
    # llama.cpp builds for this CPU (-march=native); without AMX: on a Xeon that reports AMX, ggml's AMX
    # matmul died with SIGILL (tilezero) here even with the kernel's AMX permission granted.
    NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    export CFLAGS="${CFLAGS-$NO_AMX}" CXXFLAGS="${CXXFLAGS-$NO_AMX}"
fi
# llama.cpp is built from llama-cpp-python's source with one patch to ggml's CPU backend
# (scripts/patches/ggml-cpu-batch-invariant.patch): a batch-invariant mode, so a verify pass gives each
# position exactly the logits of one-token decoding (docs/exactness.md). The wheel is cached per CPU,
# build flags and patch (pip's own cache is keyed by the source alone, and would reuse a build from
# another CPU or without the patch), and reinstalled when they change.
TORCH="torch==2.13.0"
LLAMA=$(grep -o 'llama-cpp-python==[0-9.]*' pyproject.toml | head -n 1)
PATCH=$PWD/scripts/patches/ggml-cpu-batch-invariant.patch
KEY=$(printf '%s|' "$LLAMA" "$CMAKE_ARGS" "${CFLAGS-}" "${CXXFLAGS-}" "$(uname -sm)" "$(cksum < "$PATCH")" \
    "$(grep -m 1 -E '^(flags|Features)' /proc/cpuinfo 2>/dev/null || sysctl -n machdep.cpu.brand_string 2>/dev/null)" \
    | cksum | cut -d ' ' -f 1)
if [ "$(cat .venv/.llama-cpp-build 2>/dev/null)" != "$KEY" ]; then
    WHEELS="${XDG_CACHE_HOME:-$HOME/.cache}/mirrorsd/llama-cpp-wheels/$KEY"
    if ! ls "$WHEELS"/llama_cpp_python-*.whl >/dev/null 2>&1; then
        # torch, the largest download, installs while llama.cpp compiles (a failure shows again below)
        .venv/bin/python -m pip install -q "$TORCH" > /dev/null 2>&1 &
        TORCH_PID=$!
        SRC=$(mktemp -d)
        .venv/bin/python -m pip download -q --no-deps --no-binary :all: "$LLAMA" -d "$SRC"
        tar xzf "$SRC"/llama_cpp_python-*.tar.gz -C "$SRC"
        # llama-cpp-python also builds llama.cpp's `common` library (for its tools; neither its bindings nor mirrorsd
        # load it): switched off, it was about a third of the compile
        sed -i 's/set(LLAMA_BUILD_COMMON ON /set(LLAMA_BUILD_COMMON OFF /' "$SRC"/llama_cpp_python-*/CMakeLists.txt
        (cd "$SRC"/llama_cpp_python-*/ && git apply -p1 --directory=vendor/llama.cpp "$PATCH")
        .venv/bin/python -m pip wheel -q --no-deps -w "$WHEELS" "$SRC"/llama_cpp_python-*/
        rm -rf "$SRC"
        wait "$TORCH_PID" || true
    fi
    .venv/bin/python -m pip install -q --force-reinstall --no-deps "$WHEELS"/llama_cpp_python-*.whl
    echo "$KEY" > .venv/.llama-cpp-build
fi
.venv/bin/python -m pip install -q "$TORCH" -e ".[test]"
