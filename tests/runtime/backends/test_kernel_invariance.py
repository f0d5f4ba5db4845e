"""The batch-invariant patch on ARM64, at the kernel level: scripts/kernel_invariance.cpp cross-built against the
patched ggml for NEON with dotprod (as Apple M1) and with i8mm too (Apple M2 and later, Snapdragon X), by
scripts/build_llama_variant.sh arm64 (scripts/test.sh builds it and names its folder in MIRRORSD_KERNEL_ARM64), run
under qemu-user: every weight type, plain and repacked, n = 1..17 columns each bit for bit one-token decoding's. The
same binaries with the patch off (--stock) must differ, so the check can fail."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

MARCHES = ["armv8.2-a+dotprod+fp16", "armv8.2-a+dotprod+i8mm+fp16"]


def arm64_build() -> Path:
    folder = os.environ.get("MIRRORSD_KERNEL_ARM64")
    if not folder:
        pytest.skip(os.environ.get("MIRRORSD_KERNEL_ARM64_UNAVAILABLE",
                                   "MIRRORSD_KERNEL_ARM64 is not set: bash scripts/test.sh builds the ARM64 check"))
    if shutil.which("qemu-aarch64") is None:
        pytest.skip("no qemu-aarch64 to run the ARM64 check (Debian: apt-get install qemu-user)")
    return Path(folder)


def run_check(march: str, *args: str) -> subprocess.CompletedProcess:
    binary = arm64_build() / f"kernel_invariance-{march}"
    # -cpu max: every feature the binary may use (dotprod, i8mm, fp16); SVE off, as on the laptops this is for
    return subprocess.run(["qemu-aarch64", "-cpu", "max,sve=off", str(binary), *args],
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("march", MARCHES)
def test_every_column_of_a_multi_column_mul_mat_is_one_token_decodings(march):
    run = run_check(march)
    assert run.returncode == 0 and run.stdout.splitlines()[-1] == "PASS", run.stdout + run.stderr[-2000:]
    cases = [line for line in run.stdout.splitlines() if "n=1..17" in line]
    # plain and repacked Q4_0, Q8_0 and the K-quants the catalog's Q4_K_M files hold, besides the float types
    assert len(cases) >= 11, run.stdout
    assert any(line.startswith("q4_K  repacked") for line in cases), run.stdout


@pytest.mark.parametrize("march", MARCHES)
def test_with_the_patch_off_the_same_check_fails(march):
    run = run_check(march, "--stock")
    assert run.returncode == 1 and "DIFFERS" in run.stdout, run.stdout + run.stderr[-2000:]
