"""The batch-invariant kernels of another x86 feature level than this machine's: an AVX2 build without AVX-512 (the
CPUs most x86 laptops have), built by scripts/build_llama_variant.sh (scripts/test.sh builds it and names its folder
in MIRRORSD_LLAMA_AVX2), runs test_invariance.py in a child process that loads it (LLAMA_CPP_LIB_PATH): every weight
type, repacked and not, exact on those kernels too, on any x86-64 machine with AVX2; and the kernel-level check
(scripts/kernel_invariance.cpp) against the same build. On an AVX-512 build, the same tests with the multi-row
kernels' other form than this CPU's default (two rows a 512-bit register, or the AVX2 kernels: GGML_CPU_ROW_PAIRS)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]


def avx2_build() -> str:
    lib = os.environ.get("MIRRORSD_LLAMA_AVX2")
    if not lib:
        pytest.skip(os.environ.get("MIRRORSD_LLAMA_AVX2_UNAVAILABLE",
                                   "MIRRORSD_LLAMA_AVX2 is not set: bash scripts/test.sh builds the AVX2 variant"))
    return lib


def run_invariance_tests(env: dict[str, str]) -> subprocess.CompletedProcess:
    # test_invariance.py in a child process: the kernels it loads are chosen at start (library path, environment)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
                           str(HERE / "test_invariance.py")], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=900)


def test_the_invariance_tests_pass_on_an_avx2_build():
    env = {**os.environ, "LLAMA_CPP_LIB_PATH": avx2_build()}
    info = subprocess.run([sys.executable, "-c", "import llama_cpp; print(llama_cpp.llama_print_system_info().decode())"],
                          env=env, capture_output=True, text=True, check=True, timeout=120).stdout
    assert "AVX2 = 1" in info and "AVX512" not in info, info  # the variant it says it is
    run = run_invariance_tests(env)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "skipped" not in run.stdout.splitlines()[-1], run.stdout[-2000:]


def run_kernel_check(*args: str) -> subprocess.CompletedProcess:
    # scripts/kernel_invariance.cpp, linked against the AVX2 build by scripts/build_llama_variant.sh avx2
    return subprocess.run([str(Path(avx2_build()) / "kernel_invariance"), *args], capture_output=True, text=True,
                          timeout=300)


def test_every_column_of_an_avx2_multi_column_mul_mat_is_one_token_decodings():
    run = run_kernel_check()
    assert run.returncode == 0 and run.stdout.splitlines()[-1] == "PASS", run.stdout + run.stderr[-2000:]
    cases = [line for line in run.stdout.splitlines() if "n=1..17" in line]
    # the catalog's Q4_K_M files: Q4_K and Q6_K both repacked on AVX2, and each repacked layout computes what the
    # plain weights compute (up to float rounding: the check fails a kernel that is invariant but wrong)
    for kind in ("q4_K  repacked", "q6_K  repacked"):
        assert any(line.startswith(kind) and "vs plain weights" in line for line in cases), run.stdout


def test_with_the_patch_off_the_avx2_check_fails():
    run = run_kernel_check("--stock")
    assert run.returncode == 1 and "DIFFERS" in run.stdout, run.stdout + run.stderr[-2000:]


def test_the_avx2_kernels_cost_per_row_against_the_cores_multiplier():
    # scripts/kernel_bound.cpp, linked beside kernel_invariance: it runs, and reports every row count of both
    # kernels with a positive cost (what the figures are is docs/exactness.md's business, measured on a quiet machine)
    run = subprocess.run([str(Path(avx2_build()) / "kernel_bound"), "--quick"], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr[-2000:]
    assert run.stdout.startswith("this core: ") and " ns per vpmaddubsw" in run.stdout.splitlines()[0], run.stdout
    rows = [line.split() for line in run.stdout.splitlines() if line.startswith(("q4_K", "q6_K"))]
    assert [(r[0], int(r[1])) for r in rows] == [(t, n) for t in ("q4_K", "q6_K") for n in (1, 2, 4, 8, 16)], run.stdout
    assert all(float(r[2]) > 0 for r in rows), run.stdout


PROBE = ("import llama_cpp; from mirrorsd.runtime.backends import ggml_kernels; "
         "print(llama_cpp.llama_print_system_info().decode()); print('row pairs:', ggml_kernels.row_pairs())")


def probe(env: dict[str, str]) -> str:
    return subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True,
                          timeout=120).stdout


def test_the_invariance_tests_pass_with_the_other_form_of_the_avx512_kernels():
    # the suite's own run of test_invariance.py covers this CPU's default form; a child process the other one
    info = probe(dict(os.environ))
    if "AVX512 = 1" not in info:
        pytest.skip("this llama.cpp build has no AVX-512 kernels (the AVX2 variant's test covers the AVX2 ones)")
    default = "row pairs: True" in info
    assert default or "row pairs: False" in info, info
    env = {**os.environ, "GGML_CPU_ROW_PAIRS": "0" if default else "1"}
    assert f"row pairs: {not default}" in probe(env)
    run = run_invariance_tests(env)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "skipped" not in run.stdout.splitlines()[-1], run.stdout[-2000:]
