#!/usr/bin/env bash
# Create .venv and install mirrorsd into it (editable), with the test extras.
# torch is pinned to 2.13.0 here only because that CPU wheel ships on this project's machines;
# a bare `torch` requirement would download a multi-GB CUDA build. Elsewhere any torch >= 2.5 works.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
.venv/bin/python -m pip install -q "torch==2.13.0" -e ".[test]"
