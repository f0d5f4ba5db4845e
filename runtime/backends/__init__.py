"""Model backends: each runs one model on one device behind mirrorsd.contracts.CausalLM.

Adding a backend is one class (a PrefixCachedLM subclass, base.py) and one `register_backend` call;
the decode loops, the pipeline and the apps take any CausalLM. `Engine.load(target, backend=NAME)` and
model drafters (`make_drafter`) load through this registry.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from mirrorsd.contracts import CausalLM
from mirrorsd.errors import ConfigError


@dataclass(frozen=True)
class LoadedModel:
    """What a backend's loader returns."""

    lm: CausalLM
    tokenizer: object  # a transformers tokenizer: the text <-> token id mapping of the model
    eos_ids: frozenset[int]  # token ids that end a reply


Loader = Callable[..., LoadedModel]
"""loader(spec, device="auto", dtype="auto", progress=False, role="target") -> LoadedModel; spec: a model
argument (catalog name, folder, .gguf file, hub id) or whatever the backend takes; role: "target" or "draft"."""

BACKENDS: dict[str, Loader] = {}


def register_backend(name: str, loader: Loader) -> None:
    BACKENDS[name] = loader


def load_lm(spec: str, backend: str = "torch", device: str | None = "auto", dtype=None,
            progress: bool = False, role: str = "target") -> LoadedModel:
    """Load `spec` on the named backend. role: "target", or "draft" (a backend may then choose speed over
    exactness: a draft's passes are verified anyway)."""
    if backend not in BACKENDS:
        raise ConfigError(f"unknown backend {backend!r}", f"use one of: {', '.join(sorted(BACKENDS))}")
    return BACKENDS[backend](spec, device=device, dtype=dtype, progress=progress, role=role)


def eos_ids(model, tokenizer) -> frozenset[int]:
    """EOS ids of a transformers model: its generation config's and its tokenizer's."""
    ids: set[int] = set()
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is not None:
        ids.update(eos if isinstance(eos, (list, tuple)) else [eos])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(int(i) for i in ids)


def _load_torch(spec: str, device: str | None = "auto", dtype=None, progress: bool = False,
                role: str = "target", static: bool | None = None) -> LoadedModel:
    """transformers on a torch device. On a CUDA GPU (or with static=True anywhere) a Llama / Qwen2 / Mistral
    model runs the static-shape backend (torch_static.py: fixed-shape passes replayed as CUDA graphs, bfloat16
    by default, exact where the invariance check says so); elsewhere float32 on the CPU with batch-invariant
    kernels (exact verify passes), else its linear layers on oneDNN where that applies. role "draft": a draft
    model, whose passes need no exactness (one-row steps on the static backend)."""
    import torch

    from mirrorsd.devices import parse_dtype, resolve_device
    from mirrorsd.models import load_model

    dev = resolve_device(device)
    static = dev.type == "cuda" if static is None else static
    graphed_default = static and dev.type == "cuda" and dtype in (None, "auto")  # exact in bfloat16 there
    torch_dtype = torch.bfloat16 if graphed_default else parse_dtype(dtype, dev)
    model, tokenizer = load_model(spec, dev, torch_dtype, progress)
    # (transformers' modelling code, seconds to import, only once the model is found: a wrong name fails fast)
    from mirrorsd.runtime.backends.cpu_kernels import use_onednn_linear
    from mirrorsd.runtime.backends.torch_invariant import make_batch_invariant
    from mirrorsd.runtime.backends.torch_lm import TorchCausalLM
    from mirrorsd.runtime.backends.torch_static import supports

    if static and supports(model):
        lm = _static_lm(model, dev, spec, role)
    else:
        if not make_batch_invariant(model):
            use_onednn_linear(model)
        lm = TorchCausalLM(model, dev)
    return LoadedModel(lm, tokenizer, eos_ids(model, tokenizer))


def _load_torch_static(spec: str, device: str | None = "auto", dtype=None, progress: bool = False,
                       role: str = "target") -> LoadedModel:
    return _load_torch(spec, device, dtype, progress, role, static=True)


def _static_lm(model, device, spec: str, role: str):
    """A StaticTorchLM: a target with the invariance check's verdict (measured once per model, dtype, device and
    shape, kept in the calibrations file: `calibrations_path()`), or a draft with one-row steps."""
    import torch

    from mirrorsd.runtime.backends.torch_static import DEFAULT_ROWS, StaticTorchLM

    if role == "draft":
        return StaticTorchLM(model, device, rows=1, prefill_rows=DEFAULT_ROWS, exact_batches=False)
    lm = StaticTorchLM(model, device, exact_batches=False)
    from mirrorsd.runtime.backends.invariance import check_fixed_shape

    lm.exact_batches = invariance_verdict(
        f"invariance of {spec} on {lm.backend} in {lm.dtype}, {lm.rows} rows, {lm.max_context} cells, "
        f"torch {torch.__version__}", lambda: check_fixed_shape(lm, lm.rows))
    return lm


def invariance_verdict(what: str, check, torch_threads: bool = True) -> bool:
    """The invariance check's verdict on a fixed-shape model: measured once per model, shape, device and build
    (`what` names them), kept in the calibrations file (`calibrations_path()`) with the machine and mirrorsd's
    version (torch_threads=False: a verdict on kernels that are not torch's, kept whatever torch's thread count)."""
    from mirrorsd import __version__
    from mirrorsd.catalog import calibrations_path
    from mirrorsd.devices import machine_id
    from mirrorsd.runtime.decode.policy.calibrate import CalibrationStore

    from mirrorsd.runtime.backends.invariance import FIXED_CHECK

    store = CalibrationStore(calibrations_path())
    key = " | ".join((what, FIXED_CHECK, machine_id(torch_threads), f"mirrorsd {__version__}"))
    verdict = store.get_verdict(key)
    if verdict is None:
        verdict = check()
        store.put_verdict(key, verdict)
    return verdict


def _load_llamacpp(spec: str, device: str | None = "auto", dtype=None, progress: bool = False,
                   role: str = "target", static: bool | None = None) -> LoadedModel:
    """The GGUF file as it is, on llama.cpp's kernels (dtype does not apply: the file's quantization is
    used). device "cpu" keeps every layer on the CPU; otherwise layers go to the GPU where the build has one.
    static: fixed-shape passes (llamacpp_lm.py) on llama.cpp's stock kernels, exact where the invariance check
    says so (measured once per model and device, cached); default: a model on a GPU (target or draft), whose
    kernels have no batch-invariant mode. On the CPU the patched kernels are exact at every shape and cost less."""
    from mirrorsd.models import load_tokenizer, resolve_gguf
    from mirrorsd.runtime.backends.llamacpp_lm import LlamaCppLM, import_llama_cpp
    from mirrorsd.runtime.backends.invariance import FIXED_ROWS

    llama_cpp = import_llama_cpp()  # before any download: say at once that the extra is missing
    if _gpu_beyond_llamacpp(device):
        raise ConfigError(f"device {device!r} asked for, but this llama-cpp-python build runs on the CPU only",
                          "use --device cpu (or auto); on an NVIDIA GPU --backend torch runs the model there, or "
                          'rebuild llama.cpp for it: CMAKE_ARGS="-DGGML_CUDA=on" bash scripts/setup.sh')
    gguf, tokenizer_dir = resolve_gguf(spec, progress)
    on_gpu = device != "cpu" and bool(llama_cpp.llama_supports_gpu_offload())
    static = on_gpu if static is None else static
    # A draft runs the target's kernels (the CPU's kernel mode is process-wide and a draft computes beside the
    # target: ggml_kernels.py) and its one shape too. Its passes need no exactness, but with rows that do not
    # depend on the pass, its probabilities do not depend on which tokens its cache took in which pass (a
    # prompt's cached prefix, a mode's catch-up), so a seeded sampled run is the same in every mode and after
    # any earlier request. (On a GPU eager torch measured 16 rows at 1.04x one row; llama.cpp's: unmeasured.)
    lm = LlamaCppLM(gguf, gpu_layers=0 if device == "cpu" else None, exact=not static, flash_attn=True,
                    fixed_rows=FIXED_ROWS if static else None)
    if lm.fixed_rows:
        from mirrorsd.runtime.backends.ggml_kernels import build_id
        from mirrorsd.runtime.backends.invariance import check_fixed_shape

        lm.exact_batches = invariance_verdict(
            f"invariance of {spec} ({gguf.name}) on {lm.backend}, {FIXED_ROWS} rows, flash attention, "
            f"llama.cpp build {build_id()}",
            lambda: check_fixed_shape(lm, FIXED_ROWS), torch_threads=False)
        if not lm.exact_batches:
            lm.fixed_rows = None  # not exact at one shape either: the cheaper passes of any shape (declared inexact)
    tokenizer = load_tokenizer(tokenizer_dir)
    special = set(tokenizer.all_special_ids) | set(tokenizer.added_tokens_decoder)
    eos = lm.eog_ids(special) | eos_ids(None, tokenizer)
    return LoadedModel(lm, tokenizer, eos)


def _load_llamacpp_static(spec: str, device: str | None = "auto", dtype=None, progress: bool = False,
                          role: str = "target") -> LoadedModel:
    return _load_llamacpp(spec, device, dtype, progress, role, static=True)


def _load_onnx(spec: str, device: str | None = "auto", dtype=None, progress: bool = False,
               role: str = "target") -> LoadedModel:
    """An export folder (`mirrorsd export --role target`) on ONNX Runtime: the CUDA provider where it is
    installed (device auto/cuda; the KV cache then stays on the GPU), else the CPU provider on the
    physical cores. dtype does not apply: the export's precision and quantization are used."""
    from pathlib import Path

    from transformers import AutoTokenizer

    from mirrorsd.errors import ExportError
    from mirrorsd.export_format import TOKENIZER_DIR, is_export, read_manifest
    from mirrorsd.runtime.backends.cpu_kernels import physical_cores
    from mirrorsd.runtime.backends.exported import load_export_lm

    if not is_export(spec):
        raise ConfigError(f"the onnx backend runs an export folder, and {spec!r} is not one",
                          f"export it once: mirrorsd export --role target --model {spec} --out DIR "
                          "--quant int4, then pass DIR as the model")
    manifest = read_manifest(spec)
    if manifest["format"] != "onnx":
        raise ConfigError(f"{spec} is a {manifest['format']} export; the onnx backend runs ONNX exports",
                          "export with --format onnx --role target")
    if not (Path(spec) / TOKENIZER_DIR).is_dir():
        raise ExportError(f"{spec} holds no tokenizer (exported by an older mirrorsd)",
                          "re-export it with `mirrorsd export --role target`")
    tokenizer = AutoTokenizer.from_pretrained(Path(spec) / TOKENIZER_DIR)
    provider = onnx_provider(device)
    lm = load_export_lm(spec, manifest, provider, threads=physical_cores() if provider == "cpu" else None)
    return LoadedModel(lm, tokenizer, frozenset(manifest.get("eos_ids", [])) | eos_ids(None, tokenizer))


def onnx_provider(device: str | None) -> str:
    """The ONNX Runtime provider for a device argument: auto -> CUDA where installed, else the CPU."""
    if device in (None, "auto", "gpu"):
        import onnxruntime as ort

        return "cuda" if "CUDAExecutionProvider" in ort.get_available_providers() else "cpu"
    return device


def _gpu_beyond_llamacpp(device: str | None) -> bool:
    """A GPU device asked for, and the installed llama-cpp-python build cannot offload to one."""
    if device in (None, "auto", "cpu"):
        return False
    import llama_cpp

    return not llama_cpp.llama_supports_gpu_offload()


def llamacpp_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("llama_cpp") is not None


def auto_backend(spec: str) -> str:
    """"onnx" for an export folder; "llamacpp" for a GGUF model (every catalog model, a .gguf file) where
    llama-cpp-python is installed: the file's own quantized kernels; "torch" (float32) otherwise. (Loading with a
    GPU device that the llama.cpp build cannot use picks "torch" instead.)"""
    from mirrorsd.export_format import is_export
    from mirrorsd.models import is_gguf

    if is_export(spec):
        return "onnx"
    return "llamacpp" if is_gguf(spec) and llamacpp_installed() else "torch"


def _load_auto(spec: str, device: str | None = "auto", dtype=None, progress: bool = False,
               role: str = "target") -> LoadedModel:
    backend = auto_backend(spec)
    if backend == "llamacpp" and _gpu_beyond_llamacpp(device):
        backend = "torch"  # a GPU asked for, which this llama.cpp build cannot use: torch runs the model there
    return BACKENDS[backend](spec, device=device, dtype=dtype, progress=progress, role=role)


register_backend("torch", _load_torch)
register_backend("torch-static", _load_torch_static)
register_backend("llamacpp", _load_llamacpp)
register_backend("llamacpp-static", _load_llamacpp_static)
register_backend("onnx", _load_onnx)
register_backend("auto", _load_auto)
