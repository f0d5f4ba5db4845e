"""Model backends (each a `CausalLM`): load a model by catalog name, folder, .gguf or export on a backend, or
wrap one you hold; check a backend's batch invariance (docs/exactness.md); and say what a loaded model is
(`model_facts`: family, parameters, format, quantization, size)."""

from mirrorsd._lazy import lazy_names

SOURCES = {
    "mirrorsd.runtime.backends": ("llamacpp_installed", "load_lm"),
    "mirrorsd.runtime.backends.torch_lm": ("TorchCausalLM",),
    "mirrorsd.runtime.backends.torch_static": ("StaticTorchLM",),
    "mirrorsd.runtime.backends.cpu_kernels": ("physical_cores",),
    "mirrorsd.runtime.backends.torch_invariant": ("make_batch_invariant",),
    "mirrorsd.runtime.backends.llamacpp_lm": ("LlamaCppLM",),
    "mirrorsd.runtime.backends.exported": ("load_export_lm",),
    "mirrorsd.runtime.backends.invariance": ("check_batch_invariance", "greedy_tokens"),
    "mirrorsd.runtime.backends.facts": ("ModelFacts", "model_facts"),
}
__all__ = [name for names in SOURCES.values() for name in names]
__getattr__ = lazy_names(globals(), SOURCES)
