"""What a loaded model is, as model listings show it (ollama's /api/tags and /api/show, `mirrorsd models`): its
family, parameter count, weight format and size. Read from the backend's own model (the GGUF's metadata, a torch
model's config and tensors); what a backend cannot tell stays empty."""

from __future__ import annotations

from dataclasses import dataclass

from mirrorsd.contracts import CausalLM

# llama.cpp's llama_ftype (general.file_type) -> the quantization name ollama and llama.cpp print
GGUF_FILE_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K",
                   11: "Q3_K_S", 12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M",
                   18: "Q6_K", 19: "IQ2_XXS", 20: "IQ2_XS", 21: "Q2_K_S", 22: "IQ3_XS", 23: "IQ3_XXS", 24: "IQ1_S",
                   25: "IQ4_NL", 26: "IQ3_S", 27: "IQ3_M", 28: "IQ2_S", 29: "IQ2_M", 30: "IQ4_XS", 31: "IQ1_M",
                   32: "BF16"}


@dataclass(frozen=True)
class ModelFacts:
    family: str = ""  # the architecture: "llama", "qwen2", ...
    parameters: int = 0  # weights, counted
    format: str = ""  # "gguf", "torch", "onnx", ...
    quantization: str = ""  # "Q4_K_M", "BF16", "F32", ...
    size_bytes: int = 0  # the weights' bytes as loaded (a GGUF: its tensors)

    @property
    def parameter_size(self) -> str:
        """ollama's form: "135M", "1.5B"."""
        if not self.parameters:
            return ""
        for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
            if self.parameters >= scale:
                return f"{self.parameters / scale:.1f}".rstrip("0").rstrip(".") + unit
        return str(self.parameters)


def model_facts(lm: CausalLM) -> ModelFacts:
    from mirrorsd.runtime.backends.torch_lm import TorchCausalLM
    from mirrorsd.runtime.backends.torch_static import StaticTorchLM

    if isinstance(lm, (TorchCausalLM, StaticTorchLM)) and lm.model is not None:
        tensors = [*lm.model.parameters(), *lm.model.buffers()]
        dtypes = {str(t.dtype).removeprefix("torch.") for t in lm.model.parameters()}
        return ModelFacts(getattr(lm.model.config, "model_type", ""), sum(p.numel() for p in lm.model.parameters()),
                          "torch", {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}.get(
                              dtypes.pop(), "") if len(dtypes) == 1 else "",
                          sum(t.numel() * t.element_size() for t in tensors))
    try:
        from mirrorsd.runtime.backends.llamacpp_lm import LlamaCppLM
    except ImportError:  # llama-cpp-python not installed: no llama.cpp model can be loaded either
        return ModelFacts(format=lm.backend.split(":")[0])
    if isinstance(lm, LlamaCppLM) and lm.llm is not None:
        meta, api = lm.llm.metadata, lm._api
        file_type = meta.get("general.file_type", "")
        return ModelFacts(meta.get("general.architecture", ""), int(api.llama_model_n_params(lm.llm.model)), "gguf",
                          GGUF_FILE_TYPES.get(int(file_type), "") if file_type.isdigit() else "",
                          int(api.llama_model_size(lm.llm.model)))
    return ModelFacts(format=lm.backend.split(":")[0])
