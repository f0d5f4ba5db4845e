"""mirrorsd: lossless speculative decoding on the chips of one machine.

    from mirrorsd import Engine, GenerationConfig
    engine = Engine.load(target="smollm2-135m", draft="auto")
    result = engine.generate("Write a Python quicksort.", GenerationConfig(max_new_tokens=128))
"""

from mirrorsd._lazy import lazy_names
from mirrorsd.config import GenerationConfig, SamplingParams, SpeculativeConfig
from mirrorsd.errors import (
    CatalogError,
    ChecksumError,
    ConfigError,
    DatastoreError,
    EngineBusyError,
    EngineClosedError,
    MirrorsdError,
    ModelNotFoundError,
    ModelOutputError,
    PromptError,
    RequestCancelled,
    RollbackUnsupportedError,
    TokenizerMismatchError,
)

# Imported on first use (mirrorsd/_lazy.py): they pull in torch and transformers.
_SOURCES = {
    "mirrorsd.engine": ("Engine",), "mirrorsd.runtime.decode.verify": ("verify",),
    "mirrorsd.contracts": ("CausalLM", "Draft", "Drafter", "DraftModel", "Learner", "Ranking", "Step"),
    "mirrorsd.results": ("FinishEvent", "GenerationResult", "GenerationStats", "StepStats", "TokenEvent"),
}
__getattr__ = lazy_names(globals(), _SOURCES)


__version__ = "0.1.0"
__all__ = [
    "CausalLM", "DraftModel", "Learner", "Ranking", "SamplingParams", "SpeculativeConfig", "Step",
    "CatalogError", "ChecksumError", "ConfigError", "DatastoreError", "Draft", "EngineBusyError", "EngineClosedError", "Drafter", "Engine", "FinishEvent",
    "GenerationConfig", "GenerationResult", "GenerationStats", "MirrorsdError", "ModelNotFoundError",
    "ModelOutputError", "PromptError", "RequestCancelled", "RollbackUnsupportedError", "StepStats", "TokenEvent", "TokenizerMismatchError", "verify",
]
