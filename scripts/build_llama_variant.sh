#!/usr/bin/env bash
# Build llama.cpp's libraries (libllama, libggml*) from the source llama-cpp-python vendors, with the batch-invariant
# patch, for another x86 feature level than this machine's own, so the patch's kernels for that level are built and
# tested even where the CPU has more: `avx2` is AVX2 + FMA + F16C without AVX-512 (most x86 laptops).
#   bash scripts/build_llama_variant.sh avx2   # prints the folder holding libllama.so (built once, then cached)
# llama-cpp-python loads it instead of its own with LLAMA_CPP_LIB_PATH=FOLDER (tests/runtime/backends/
# test_invariance_variants.py runs the invariance tests that way). About two minutes on two cores.
set -euo pipefail
cd "$(dirname "$0")/.."
VARIANT=${1:-avx2}
case "$VARIANT" in
    avx2) FLAGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=OFF" ;;
    *) echo "unknown variant $VARIANT (known: avx2)" >&2; exit 2 ;;
esac
[ "$(uname -m)" = x86_64 ] || { echo "the $VARIANT variant is an x86-64 build; this machine is $(uname -m)" >&2; exit 3; }
PY=.venv/bin/python
[ -x "$PY" ] || PY=python3
LLAMA=$(grep -o 'llama-cpp-python==[0-9.]*' pyproject.toml | head -n 1)
PATCH=$PWD/scripts/patches/ggml-cpu-batch-invariant.patch
KEY=$(printf '%s|' "$LLAMA" "$VARIANT" "$FLAGS" "$(cksum < "$PATCH")" "$(uname -sm)" | cksum | cut -d ' ' -f 1)
OUT="${XDG_CACHE_HOME:-$HOME/.cache}/mirrorsd/llama-variants/$VARIANT-$KEY"
if [ ! -f "$OUT/lib/libllama.so" ]; then
    SRC=$(mktemp -d)
    trap 'rm -rf "$SRC"' EXIT
    "$PY" -m pip download -q --no-deps --no-binary :all: "$LLAMA" -d "$SRC" >&2
    tar xzf "$SRC"/llama_cpp_python-*.tar.gz -C "$SRC"
    VENDOR=$(echo "$SRC"/llama_cpp_python-*/vendor/llama.cpp)
    (cd "$SRC"/llama_cpp_python-*/ && git apply -p1 --directory=vendor/llama.cpp "$PATCH")  # as scripts/setup.sh
    # the libraries find each other beside themselves ($ORIGIN), wherever they are copied
    cmake -S "$VENDOR" -B "$SRC/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON $FLAGS \
        -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
        -DLLAMA_BUILD_TOOLS=OFF -DCMAKE_BUILD_WITH_INSTALL_RPATH=ON '-DCMAKE_INSTALL_RPATH=$ORIGIN' >&2
    cmake --build "$SRC/build" --target llama -j "$(nproc 2>/dev/null || echo 2)" >&2
    mkdir -p "$OUT.tmp/lib"
    cp -P "$SRC"/build/bin/lib*.so* "$OUT.tmp/lib/"
    rm -rf "$OUT" && mv "$OUT.tmp" "$OUT"
fi
echo "$OUT/lib"
