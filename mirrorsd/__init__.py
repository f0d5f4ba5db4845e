"""mirrorsd: lossless speculative decoding on the chips of one machine.

    from mirrorsd import Engine, GenerationConfig
    engine = Engine.load(target="smollm2-135m", draft="auto")
    result = engine.generate("Write a Python quicksort.", GenerationConfig(max_new_tokens=128))
"""

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
    PromptError,
    RollbackUnsupportedError,
    TokenizerMismatchError,
)

# Imported on first use (PEP 562): they pull in torch and transformers, which take seconds to import,
# and `mirrorsd --help` or an argument error should not wait for that.
_LAZY = {
    "Engine": "mirrorsd.engine", "verify": "mirrorsd.rejection",
    **dict.fromkeys(("CausalLM", "Draft", "Drafter", "DraftModel", "Learner", "Ranking", "Step", "Verifier"),
                    "mirrorsd.contracts"),
    **dict.fromkeys(("FinishEvent", "GenerationResult", "GenerationStats", "TokenEvent"), "mirrorsd.results"),
}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'mirrorsd' has no attribute {name!r}")
    import importlib

    value = vars(importlib.import_module(_LAZY[name]))[name]
    globals()[name] = value
    return value


__version__ = "0.1.0"
__all__ = [
    "CausalLM", "DraftModel", "Learner", "Ranking", "SamplingParams", "SpeculativeConfig", "Step",
    "CatalogError", "ChecksumError", "ConfigError", "DatastoreError", "Draft", "EngineBusyError", "EngineClosedError", "Drafter", "Engine", "FinishEvent",
    "GenerationConfig", "GenerationResult", "GenerationStats", "MirrorsdError", "ModelNotFoundError",
    "PromptError", "RollbackUnsupportedError", "TokenEvent", "TokenizerMismatchError", "Verifier", "verify",
]
