#!/usr/bin/env bash
# The GPU check (scripts/gpu_check.py) on a lent GPU machine, which reaches no registry and takes 64 MiB a call.
#   bash scripts/gpu_check.sh prepare   # here: wheels the device lacks, the prompts, and one bundle -- the
#                                       # smollm2-135m GGUF and llama.cpp built for CUDA (scripts/build_llama_variant.sh
#                                       # cuda: about 40 minutes the first time; NO_CUDA_BUILD=1 leaves it out) -- split
#                                       # into parts of 45 MB, all under .gpu/ (kept out of git); it prints the calls
# then one device call per part, the machine kept warm between them, from the repository root:
#   carry [".gpu/pN"]              command: bash scripts/gpu_check.sh keep N     (every part but the last)
#   carry [".gpu/whl", ".gpu/pN"]  command: bash scripts/gpu_check.sh run        (the last; writes $OUT)
# `run` checks the reassembled bundle's SHA-256, so a part left out is an error, not a wrong result. PARTS=...
# picks gpu_check.py's parts (default all: shapes,smollm2,pair,llamacpp; about 5 minutes without llamacpp, which
# has not run on a GPU yet: on a call's 10 minutes, run it in a second call, carrying .gpu/whl again; the warm
# machine keeps the bundle); words after `run` go to gpu_check.py. A dry run here, after `keep` of every part but the
# last: PYTHON=.venv/bin/python DEVICE=cpu bash scripts/gpu_check.sh run --small
set -euo pipefail
cd "$(dirname "$0")/.."
SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  # MODELS.md: the assembled smollm2 GGUF
KEEP=/tmp/keep
PY=${PYTHON:-python3}  # the device's Python, which has torch
case "${1:-}" in
prepare)
    rm -rf .gpu/p* .gpu/bundle && mkdir -p .gpu/whl .gpu/bundle
    grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo /.gpu/ >> .git/info/exclude
    PLAT="--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
    for w in gguf llguidance prompt_toolkit wcwidth platformdirs diskcache; do
        .venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
            $PLAT -d .gpu/whl "$w" || .venv/bin/python -m pip download -q --no-deps -d .gpu/whl "$w"
    done
    GGUF=$(.venv/bin/python -c 'from mirrorsd.models import resolve_gguf; print(resolve_gguf("smollm2-135m")[0])')
    cp "$GGUF" .gpu/bundle/smollm2-135m.gguf
    # llama-cpp-python as scripts/setup.sh built it here, unpacked; with llama.cpp for CUDA, its Python side only
    WHEELS="${XDG_CACHE_HOME:-$HOME/.cache}/mirrorsd/llama-cpp-wheels/$(cat .venv/.llama-cpp-build)"
    .venv/bin/python -m zipfile -e "$WHEELS"/llama_cpp_python-*.whl .gpu/bundle/site
    rm -rf .gpu/bundle/site/lib .gpu/bundle/site/include  # copies of llama_cpp/lib, and headers, for builders
    if [ "${NO_CUDA_BUILD:-0}" != 1 ]; then
        cp -a "$(bash scripts/build_llama_variant.sh cuda | tail -n 1)" .gpu/bundle/llama-cuda  # links kept
        rm -rf .gpu/bundle/site/llama_cpp/lib
    fi
    tar -C .gpu/bundle -cf - . | xz -T 2 -6 > .gpu/bundle.tar.xz
    rm -rf .gpu/bundle
    (cd .gpu && split -b 45000000 -d -a 1 bundle.tar.xz part && rm bundle.tar.xz)
    N=0
    for f in .gpu/part*; do N=$((N + 1)); mkdir -p ".gpu/p$N"; mv "$f" ".gpu/p$N/part"; done
    for i in $(seq 1 $N); do cat ".gpu/p$i/part"; done | sha256sum | cut -d ' ' -f 1 > .gpu/whl/bundle.sha256
    .venv/bin/python scripts/gpu_check.py --write-prompts .gpu/whl/prompts.jsonl
    du -sh .gpu/*
    for i in $(seq 1 $((N - 1))); do
        echo "call $i: carry [\".gpu/p$i\"]  command: bash scripts/gpu_check.sh keep $i"
    done
    echo "call $N: carry [\".gpu/whl\", \".gpu/p$N\"]  command: bash scripts/gpu_check.sh run"
    ;;
keep)
    mkdir -p $KEEP && cp ".gpu/p$2/part" "$KEEP/part$2" && ls -l $KEEP
    ;;
run)
    mkdir -p $KEEP
    for d in .gpu/p*; do [ -f "$d/part" ] && cp "$d/part" "$KEEP/part${d#.gpu/p}"; done
    export MIRRORSD_CACHE=${MIRRORSD_CACHE:-/tmp/mirrorsd-cache} HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
    if [ ! -d /tmp/bundle ]; then
        N=$(ls $KEEP | wc -l)
        for i in $(seq 1 "$N"); do cat "$KEEP/part$i"; done > /tmp/bundle.tar.xz
        echo "$(cat .gpu/whl/bundle.sha256)  /tmp/bundle.tar.xz" | sha256sum -c -
        mkdir -p /tmp/bundle && xz -dc /tmp/bundle.tar.xz | tar -C /tmp/bundle -xf -
    fi
    DEST=$MIRRORSD_CACHE/models/smollm2-135m/gguf
    if [ ! -f "$DEST/smollm2-135m.gguf" ]; then
        mkdir -p "$DEST" && cp /tmp/bundle/smollm2-135m.gguf "$DEST/"
        echo "$SHA  $DEST/smollm2-135m.gguf" | sha256sum -c -
        # the catalog's record of a checked file (it re-hashes once, the time not matching, and keeps it)
        printf '{"sha256": "%s", "size": %s}' $SHA "$(stat -c %s "$DEST/smollm2-135m.gguf")" > "$DEST/checked.json"
    fi
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl
    "$PY" -m pip install -q --no-deps --no-build-isolation --no-compile --target /tmp/site . >/dev/null
    export PYTHONPATH=/tmp/site:/tmp/bundle/site
    if [ -d /tmp/bundle/llama-cuda ]; then
        # llama.cpp for CUDA, on the CUDA 13 runtime and cuBLAS that torch's install brings
        CU=$("$PY" -c 'import glob, site; print(" ".join(sorted({p.rsplit("/", 1)[0] for s in site.getsitepackages()
                         for lib in ("libcublas.so.13", "libcudart.so.13")
                         for p in glob.glob(f"{s}/nvidia/**/{lib}", recursive=True)})))')
        export LLAMA_CPP_LIB_PATH=/tmp/bundle/llama-cuda LD_LIBRARY_PATH=${CU// /:}:${LD_LIBRARY_PATH:-}
        echo "llama.cpp for CUDA: $LLAMA_CPP_LIB_PATH, the CUDA runtime and cuBLAS from ${CU:-nowhere}"
    fi
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || true
    OUTDIR=${OUT:-gpu-check}
    "$PY" scripts/gpu_check.py --prompts .gpu/whl/prompts.jsonl --out "$OUTDIR" --device "${DEVICE:-cuda}" \
        --parts "${PARTS:-shapes,smollm2,pair,llamacpp}" "${@:2}" 2>&1 | tee "$OUTDIR.log"
    cp "$OUTDIR.log" "$OUTDIR/log.txt" 2>/dev/null || true
    ;;
*)
    echo "usage: bash scripts/gpu_check.sh prepare | keep N | run" >&2
    exit 2
    ;;
esac
