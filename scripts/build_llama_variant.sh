#!/usr/bin/env bash
# Build llama.cpp from the source llama-cpp-python vendors, with the batch-invariant patch (inert unless switched
# on), as a variant the wheel is not:
#   avx2    ggml's libraries for AVX2 + FMA + F16C without AVX-512 (most x86 laptops), beside a copy of .venv's
#           libllama (scripts/setup.sh first), so the patch's kernels for that level are built and tested even where
#           the CPU has more; llama-cpp-python loads them instead of its own with LLAMA_CPP_LIB_PATH=FOLDER
#           (tests/runtime/backends/test_invariance_variants.py); beside them, scripts/kernel_invariance.cpp linked
#           against them (tests/runtime/backends/test_invariance_variants.py runs it), and scripts/kernel_bound.cpp,
#           what a row costs the AVX2 multi-row kernels against the core's multiplier (docs/exactness.md). About a
#           minute and a half.
#   server  llama-server for this CPU, stock: llama.cpp as vendored, without the patch (which also changes one-row
#           kernels on AVX2), the peer `mirrorsd bench --peers llama-server` measures beside ours
#           (apps/bench/llama_server.py). About five minutes.
#   arm64   ggml cross-compiled for ARM64 (NEON with dotprod, as Apple M1; and with i8mm, as Apple M2+ and Snapdragon
#           X) and linked into scripts/kernel_invariance.cpp, the kernel-level invariance check, one static binary
#           per CPU level, run under qemu-user by tests/runtime/backends/test_kernel_invariance.py. Needs Debian's
#           gcc-aarch64-linux-gnu, g++-aarch64-linux-gnu (and qemu-user to run). About a minute.
#   cuda    llama.cpp's libraries with the CUDA backend, for one GPU architecture (CUDA_ARCH, default 90-real: H100
#           and H200), so a build fits a GPU machine that has no compiler: copy the folder there and point
#           LLAMA_CPP_LIB_PATH at it, with the CUDA 13 runtime and cuBLAS on LD_LIBRARY_PATH (a torch cu130 install
#           has both, in site-packages/nvidia/cu13/lib). Needs nvcc (CUDACXX, else PATH, else /usr/local/cuda*);
#           cuBLAS's headers come from the nvidia-cublas wheel where the toolkit lacks them. The CPU side is the
#           AVX2 build's; no driver library is linked (GGML_CUDA_NO_VMM: the memory pool without CUDA VMM). About 40
#           minutes on two cores.
#   bash scripts/build_llama_variant.sh avx2     # prints the folder holding the libraries (built once, then cached)
#   bash scripts/build_llama_variant.sh server   # prints the path of llama-server
#   bash scripts/build_llama_variant.sh arm64    # prints the folder holding kernel_invariance-<march> binaries
#   bash scripts/build_llama_variant.sh cuda     # prints the folder holding the libraries
set -euo pipefail
cd "$(dirname "$0")/.."
VARIANT=${1:-avx2}
TOOLS=OFF CPU="" EXTRA="" PATCHED=1
case "$VARIANT" in
    avx2) FLAGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=OFF"
          TARGET=ggml PRODUCT=lib/kernel_invariance
          [ "$(uname -m)" = x86_64 ] || { echo "the avx2 variant is an x86-64 build; this machine is $(uname -m)" >&2; exit 3; }
          # libllama holds no kernels: the wheel's (scripts/setup.sh) goes beside these ggml libraries, which it
          # loads from its own folder, rather than compiling it again
          LLAMA_LIB=$(ls "$PWD"/.venv/lib/python*/site-packages/llama_cpp/lib/libllama.so 2>/dev/null | head -n 1)
          [ -f "$LLAMA_LIB" ] || { echo "the avx2 variant takes libllama from .venv: run scripts/setup.sh first" >&2; exit 3; }
          EXTRA=$(cat scripts/kernel_invariance.cpp scripts/kernel_bound.cpp "$LLAMA_LIB" | cksum) ;;  # the product's
    server) FLAGS="-DGGML_NATIVE=ON" TARGET=llama-server PRODUCT=lib/llama-server TOOLS=ON PATCHED=0
            CPU=$(grep -m 1 -E '^(flags|Features)' /proc/cpuinfo 2>/dev/null || true)  # a native build is this CPU's
            # as scripts/setup.sh builds the wheel: without AMX (its matmul died with SIGILL on a Xeon here)
            [ "$(uname -s)-$(uname -m)" = Linux-x86_64 ] && export CFLAGS="${CFLAGS--mno-amx-tile -mno-amx-int8 -mno-amx-bf16}" \
                CXXFLAGS="${CXXFLAGS--mno-amx-tile -mno-amx-int8 -mno-amx-bf16}" ;;
    arm64) FLAGS="-DGGML_NATIVE=OFF -DGGML_OPENMP=OFF -DBUILD_SHARED_LIBS=OFF" TARGET=ggml
           MARCHES="armv8.2-a+dotprod+fp16 armv8.2-a+dotprod+i8mm+fp16"
           PRODUCT=lib/kernel_invariance-armv8.2-a+dotprod+fp16
           EXTRA=$(cksum < scripts/kernel_invariance.cpp)  # the check is part of the product
           command -v aarch64-linux-gnu-g++ > /dev/null \
               || { echo "no aarch64-linux-gnu-g++ (Debian: apt-get install g++-aarch64-linux-gnu)" >&2; exit 3; } ;;
    cuda) CUDA_ARCH=${CUDA_ARCH:-90-real}
          NVCC=${CUDACXX:-$(command -v nvcc || ls -d /usr/local/cuda*/bin/nvcc 2>/dev/null | tail -n 1 || true)}
          [ -x "$NVCC" ] || { echo "no nvcc (set CUDACXX, or install the CUDA toolkit)" >&2; exit 3; }
          FLAGS="-DGGML_CUDA=ON -DGGML_CUDA_NO_VMM=ON -DCMAKE_CUDA_ARCHITECTURES=$CUDA_ARCH -DCMAKE_CUDA_COMPILER=$NVCC -DGGML_NATIVE=OFF
                 -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=OFF"
          TARGET=llama PRODUCT=lib/libggml-cuda.so EXTRA=$("$NVCC" --version | tail -n 1) ;;
    *) echo "unknown variant $VARIANT (known: avx2, server, arm64, cuda)" >&2; exit 2 ;;
esac
PY=$PWD/.venv/bin/python
[ -x "$PY" ] || PY=python3
LLAMA=$(grep -o 'llama-cpp-python==[0-9.]*' pyproject.toml | head -n 1)
PATCH=$PWD/scripts/patches/ggml-cpu-batch-invariant.patch
KEY=$(printf '%s|' "$LLAMA" "$VARIANT" "$FLAGS" "${CFLAGS-}" "$([ $PATCHED = 1 ] && cksum < "$PATCH" || echo stock)" \
    "$(uname -sm)" "$CPU" "$EXTRA" \
    | cksum | cut -d ' ' -f 1)
OUT="${XDG_CACHE_HOME:-$HOME/.cache}/mirrorsd/llama-variants/$VARIANT-$KEY"
if [ ! -f "$OUT/$PRODUCT" ]; then
    SRC=$(mktemp -d)
    trap 'rm -rf "$SRC"' EXIT
    "$PY" -m pip download -q --no-deps --no-binary :all: "$LLAMA" -d "$SRC" >&2
    tar xzf "$SRC"/llama_cpp_python-*.tar.gz -C "$SRC"
    VENDOR=$(echo "$SRC"/llama_cpp_python-*/vendor/llama.cpp)
    [ $PATCHED = 0 ] || (cd "$SRC"/llama_cpp_python-*/ && git apply -p1 --directory=vendor/llama.cpp "$PATCH")  # as setup.sh
    if [ "$VARIANT" = arm64 ]; then
        mkdir -p "$OUT.tmp/lib"
        printf '%s\n' 'set(CMAKE_SYSTEM_NAME Linux)' 'set(CMAKE_SYSTEM_PROCESSOR aarch64)' \
            'set(CMAKE_C_COMPILER aarch64-linux-gnu-gcc)' 'set(CMAKE_CXX_COMPILER aarch64-linux-gnu-g++)' \
            > "$SRC/aarch64.cmake"
        for MARCH in $MARCHES; do
            B="$SRC/build-$MARCH"
            cmake -S "$VENDOR" -B "$B" -DCMAKE_TOOLCHAIN_FILE="$SRC/aarch64.cmake" -DCMAKE_BUILD_TYPE=Release $FLAGS \
                -DGGML_CPU_ARM_ARCH="$MARCH" -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
                -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TOOLS=OFF >&2
            cmake --build "$B" --target ggml -j "$(nproc 2>/dev/null || echo 2)" >&2
            aarch64-linux-gnu-g++ -O2 -std=c++17 -I"$VENDOR/ggml/include" scripts/kernel_invariance.cpp \
                "$B/ggml/src/libggml.a" "$B/ggml/src/libggml-cpu.a" "$B/ggml/src/libggml-base.a" -static -pthread \
                -o "$OUT.tmp/lib/kernel_invariance-$MARCH"
        done
        rm -rf "$OUT" && mv "$OUT.tmp" "$OUT"
        echo "$OUT/lib"
        exit 0
    fi
    if [ "$VARIANT" = cuda ] && [ ! -f "$(dirname "$(dirname "$NVCC")")/include/cublas_v2.h" ]; then
        # the pip toolkit (nvidia-cuda-nvcc) has no cuBLAS: its wheel has the headers and the libraries to link
        "$PY" -m pip download -q --no-deps 'nvidia-cublas>=13,<13.1' -d "$SRC/cublas" >&2
        (cd "$SRC/cublas" && "$PY" -m zipfile -e nvidia_cublas-*.whl .)
        CU="$SRC/cublas/nvidia/cu13"
        FLAGS="$FLAGS -DCUDA_cublas_LIBRARY=$CU/lib/libcublas.so.13 -DCUDA_cublasLt_LIBRARY=$CU/lib/libcublasLt.so.13
               -DCMAKE_CUDA_FLAGS=-I$CU/include -DCMAKE_CXX_FLAGS=-I$CU/include
               -DCMAKE_SHARED_LINKER_FLAGS=-Wl,-rpath-link,$CU/lib"
    fi
    # the libraries find each other beside themselves ($ORIGIN), wherever they are copied
    cmake -S "$VENDOR" -B "$SRC/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON $FLAGS \
        -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=$TOOLS \
        -DLLAMA_BUILD_TOOLS=$TOOLS -DCMAKE_BUILD_WITH_INSTALL_RPATH=ON '-DCMAKE_INSTALL_RPATH=$ORIGIN' >&2
    cmake --build "$SRC/build" --target "$TARGET" -j "$(nproc 2>/dev/null || echo 2)" >&2
    mkdir -p "$OUT.tmp/lib"
    cp -P "$SRC"/build/bin/lib*.so* "$OUT.tmp/lib/"
    [ -z "${LLAMA_LIB:-}" ] || cp -P "$(dirname "$LLAMA_LIB")"/libllama.so* "$OUT.tmp/lib/"
    [ "$TARGET" = llama ] || [ "$TARGET" = ggml ] || cp "$SRC/build/bin/$TARGET" "$OUT.tmp/lib/"
    if [ "$VARIANT" = avx2 ]; then
        g++ -O2 -std=c++17 -I"$VENDOR/ggml/include" scripts/kernel_invariance.cpp -L"$SRC/build/bin" \
            -lggml -lggml-base -lggml-cpu -Wl,-rpath,'$ORIGIN' -o "$OUT.tmp/lib/kernel_invariance"
        g++ -O2 -std=c++17 -mavx2 -mfma -pthread scripts/kernel_bound.cpp -L"$SRC/build/bin" -lggml-cpu -lggml-base \
            -Wl,-rpath,'$ORIGIN' -o "$OUT.tmp/lib/kernel_bound"
    fi
    rm -rf "$OUT" && mv "$OUT.tmp" "$OUT"
fi
[ "$TARGET" = llama ] || [ "$TARGET" = ggml ] && echo "$OUT/lib" || echo "$OUT/$PRODUCT"
