#!/usr/bin/env bash
# The GPU check (scripts/gpu_check.py) on a lent GPU machine, which reaches no registry and takes 64 MiB a call.
#   bash scripts/gpu_check.sh prepare   # here: wheels the device lacks, the smollm2-135m GGUF in three parts, the
#                                       # prompts, all under .gpu/ (kept out of git)
# then three device calls in a row, the machine kept warm between them, from the repository root:
#   1. carry [".gpu/whl", ".gpu/p1"]  command: bash scripts/gpu_check.sh keep 1
#   2. carry [".gpu/p2"]              command: bash scripts/gpu_check.sh keep 2
#   3. carry [".gpu/whl", ".gpu/p3"]  command: bash scripts/gpu_check.sh run     (about 5 minutes; writes $OUT)
# `run` also works alone on a machine that has the whole GGUF in .gpu/ (p1..p3) or in MIRRORSD_CACHE.
set -euo pipefail
cd "$(dirname "$0")/.."
SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  # MODELS.md: the assembled smollm2 GGUF
KEEP=/tmp/keep
case "${1:-}" in
prepare)
    mkdir -p .gpu/whl
    grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo /.gpu/ >> .git/info/exclude
    PLAT="--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
    for w in gguf llguidance prompt_toolkit wcwidth platformdirs diskcache; do
        .venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
            $PLAT -d .gpu/whl "$w" || .venv/bin/python -m pip download -q --no-deps -d .gpu/whl "$w"
    done
    GGUF=$(.venv/bin/python -c 'from mirrorsd.models import resolve_gguf; print(resolve_gguf("smollm2-135m")[0])')
    split -n 3 -d -a 1 "$GGUF" .gpu/part && for i in 0 1 2; do mkdir -p .gpu/p$((i + 1)); mv .gpu/part$i .gpu/p$((i + 1))/part; done
    .venv/bin/python scripts/gpu_check.py --write-prompts .gpu/prompts.jsonl
    du -sh .gpu/*
    ;;
keep)
    mkdir -p $KEEP && cp ".gpu/p$2/part" "$KEEP/part$2" && ls -l $KEEP
    ;;
run)
    mkdir -p $KEEP
    for i in 1 2 3; do [ -f ".gpu/p$i/part" ] && cp ".gpu/p$i/part" "$KEEP/part$i"; done
    export MIRRORSD_CACHE=${MIRRORSD_CACHE:-/tmp/mirrorsd-cache} HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
    DEST=$MIRRORSD_CACHE/models/smollm2-135m/gguf
    if [ ! -f "$DEST/smollm2-135m.gguf" ]; then
        mkdir -p "$DEST"
        cat $KEEP/part1 $KEEP/part2 $KEEP/part3 > "$DEST/smollm2-135m.gguf"
        echo "$SHA  $DEST/smollm2-135m.gguf" | sha256sum -c -
        # the catalog's record of a checked file (it re-hashes once, the time not matching, and keeps it)
        printf '{"sha256": "%s", "size": %s}' $SHA "$(stat -c %s "$DEST/smollm2-135m.gguf")" > "$DEST/checked.json"
    fi
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl
    python3 -m pip install -q --no-deps --no-build-isolation --no-compile --target /tmp/site . >/dev/null
    export PYTHONPATH=/tmp/site
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || true
    OUTDIR=${OUT:-gpu-check}
    python3 scripts/gpu_check.py --prompts .gpu/prompts.jsonl --out "$OUTDIR" --device "${DEVICE:-cuda}" 2>&1 \
        | tee "$OUTDIR.log"
    cp "$OUTDIR.log" "$OUTDIR/log.txt" 2>/dev/null || true
    ;;
*)
    echo "usage: bash scripts/gpu_check.sh prepare | keep N | run" >&2
    exit 2
    ;;
esac
