"""mirrorsd: lossless speculative decoding on the chips of one machine.

    from mirrorsd import Engine, GenerationConfig
    engine = Engine.load(target="smollm2-135m", draft="auto")
    result = engine.generate("Write a Python quicksort.", GenerationConfig(max_new_tokens=128))
"""

from mirrorsd.config import GenerationConfig, SamplingParams, SpeculativeConfig
from mirrorsd.contracts import CausalLM, Draft, Drafter, DraftModel, LearningDrafter, Step, Verifier
from mirrorsd.engine import Engine
from mirrorsd.errors import (
    CatalogError,
    ChecksumError,
    ConfigError,
    DatastoreError,
    EngineClosedError,
    MirrorsdError,
    ModelNotFoundError,
    PromptError,
    RollbackUnsupportedError,
    TokenizerMismatchError,
)
from mirrorsd.results import FinishEvent, GenerationResult, GenerationStats, TokenEvent
from mirrorsd.verify import verify

__version__ = "0.1.0"
__all__ = [
    "CausalLM", "DraftModel", "LearningDrafter", "SamplingParams", "SpeculativeConfig", "Step",
    "CatalogError", "ChecksumError", "ConfigError", "DatastoreError", "Draft", "EngineClosedError", "Drafter", "Engine", "FinishEvent",
    "GenerationConfig", "GenerationResult", "GenerationStats", "MirrorsdError", "ModelNotFoundError",
    "PromptError", "RollbackUnsupportedError", "TokenEvent", "TokenizerMismatchError", "Verifier", "verify",
]
