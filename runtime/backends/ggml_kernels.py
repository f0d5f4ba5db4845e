"""The batch-invariant mode of ggml's CPU kernels, where the llama.cpp build has it.

scripts/setup.sh builds llama-cpp-python with scripts/patches/ggml-cpu-batch-invariant.patch, which adds
`ggml_cpu_set_batch_invariant(bool)` to libggml-cpu: with it on, every row of a batch is computed by the
kernels one-token decoding uses, so a verify pass reproduces one-token logits bit for bit. A stock build
lacks the symbol, and its batched kernels are not invariant (docs/exactness.md).

The mode is process-wide and read by every compute thread of a pass: switch it only between passes,
never while another thread of this process computes with llama.cpp (bench runs its stock-kernel peer
alone, between our runs).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
from collections.abc import Callable, Iterator
from pathlib import Path

PATCH_FUNCTIONS = ("ggml_cpu_set_batch_invariant", "ggml_cpu_get_batch_invariant", "ggml_cpu_get_row_pairs")


@functools.cache
def _library() -> ctypes.CDLL | None:
    """libllama as llama-cpp-python loaded it (LLAMA_CPP_LIB_PATH included): symbols looked up through it
    resolve in the very libggml-cpu its kernels run from. (Opening lib/libggml-cpu.so by path may load a second
    copy: the wheel ships the library under three names as three files.)"""
    try:
        from llama_cpp import llama_cpp as api
    except ImportError:
        return None
    cdll = getattr(api, "_lib", None)  # llama-cpp-python's handle of the library it loaded
    # A stock build has none of the patch's functions; a build of an older patch (a LLAMA_CPP_LIB_PATH of the
    # user's) lacks some, and its kernels are not the ones the invariance tests vouch for: neither counts.
    if cdll is None or not all(hasattr(cdll, name) for name in PATCH_FUNCTIONS):
        return None
    cdll.ggml_cpu_set_batch_invariant.argtypes = [ctypes.c_bool]
    cdll.ggml_cpu_get_batch_invariant.restype = ctypes.c_bool
    cdll.ggml_cpu_get_row_pairs.restype = ctypes.c_bool
    return cdll


@functools.cache
def build_id() -> str:
    """Which llama.cpp build computes our passes: a digest of the CPU kernel library beside the libllama that
    llama-cpp-python loaded (or of libllama itself, a static build), "none" without llama-cpp-python. Measured
    costs are kept under it (calibrate.py), since a rebuilt kernel changes what a verify pass costs."""
    try:
        from llama_cpp import llama_cpp as api
    except ImportError:
        return "none"
    loaded = Path(getattr(getattr(api, "_lib", None), "_name", None) or "")
    if not loaded.is_file():
        return "unknown"
    kernels = sorted(f for f in loaded.parent.glob("*ggml-cpu*") if f.is_file())
    with open(kernels[0] if kernels else loaded, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()[:12]


def batch_invariant_switch() -> Callable[[bool], None] | None:
    """The setter of the process-wide batch-invariant mode; None where this llama.cpp build lacks it."""
    lib = _library()
    return None if lib is None else lib.ggml_cpu_set_batch_invariant


def batch_invariant() -> bool | None:
    """Whether the mode is on now; None without the patched build."""
    lib = _library()
    return None if lib is None else bool(lib.ggml_cpu_get_batch_invariant())


def row_pairs() -> bool | None:
    """With AVX-512, whether the multi-row kernels put two rows in each 512-bit register (True) or run the AVX2
    ones (False: the default on AMD Zen 4; GGML_CPU_ROW_PAIRS overrides); False without AVX-512, None without
    the patched build. The same bits either way (docs/exactness.md)."""
    lib = _library()
    return None if lib is None else bool(lib.ggml_cpu_get_row_pairs())


@contextlib.contextmanager
def stock_kernels() -> Iterator[None]:
    """llama.cpp's own batched kernels inside the block (a peer's runs in bench), the mode as it was after."""
    switch, before = batch_invariant_switch(), batch_invariant()
    if switch is not None:
        switch(False)
    try:
        yield
    finally:
        if switch is not None:
            switch(bool(before))
