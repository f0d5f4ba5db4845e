"""The llama.cpp build's identity, which measured costs are kept under: the same kernel library gives the same id,
a rebuilt one another (so a calibration measured with old kernels is not reused with new ones)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("llama_cpp")
from llama_cpp import llama_cpp as api  # noqa: E402

from mirrorsd.runtime.backends.ggml_kernels import build_id  # noqa: E402

PRINT_ID = "from mirrorsd.runtime.backends.ggml_kernels import build_id; print(build_id())"


def test_the_build_id_is_a_digest_of_the_kernels_in_use_and_changes_with_them(tmp_path):
    here = build_id()
    assert re.fullmatch(r"[0-9a-f]{12}", here) and build_id.__wrapped__() == here
    copy = tmp_path / "lib"
    shutil.copytree(Path(api._lib._name).parent, copy, symlinks=True)
    env = {**os.environ, "LLAMA_CPP_LIB_PATH": str(copy)}
    run = lambda: subprocess.run([sys.executable, "-c", PRINT_ID], env=env, capture_output=True, text=True,  # noqa: E731
                                 check=True).stdout.strip()
    assert run() == here  # the same files elsewhere: the same build
    for kernels in copy.glob("*ggml-cpu*"):
        if kernels.is_file() and not kernels.is_symlink():
            with open(kernels, "ab") as f:
                f.write(b"\0")  # another build of the kernels, as far as their bytes go
    assert run() != here


def test_the_engines_costs_are_kept_under_the_build_of_the_kernels_they_run_on(tiny_folder):
    from mirrorsd import Engine

    on_llamacpp = Engine.load(target="smollm2-135m", draft="ngram")
    assert f"llama.cpp build {build_id()}" in on_llamacpp.calibrated.target_id
    on_llamacpp.close()
    on_torch = Engine.load(target=str(tiny_folder), draft="ngram", dtype="float32")
    assert "llama.cpp" not in on_torch.calibrated.target_id
    on_torch.close()


def test_a_target_on_torch_loads_no_llama_cpp(tiny_folder):
    """Naming the build must not cost a torch target the import of llama.cpp (over a second at start-up)."""
    code = ("import sys; from mirrorsd import Engine; "
            f"Engine.load(target={str(tiny_folder)!r}, draft='ngram', dtype='float32').close(); "
            "print(sorted(m for m in sys.modules if m.startswith('llama_cpp')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "[]"
