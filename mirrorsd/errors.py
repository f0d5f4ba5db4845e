"""Every error mirrorsd raises on purpose: a clear message plus how to fix it.

All derive from :class:`MirrorsdError`, so an embedding program can catch one type. Each carries a
``hint`` (what to do about it), which the CLI prints under the message.
"""

from __future__ import annotations


class MirrorsdError(Exception):
    """Base class. ``str(err)`` is the problem; ``err.hint`` is how to fix it."""

    def __init__(self, message: str, hint: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return f"{self.message}\n  hint: {self.hint}" if self.hint else self.message


class ConfigError(MirrorsdError, ValueError):
    """An invalid generation setting (temperature < 0, max_new_tokens < 1, ...)."""


class PromptError(MirrorsdError, ValueError):
    """The prompt cannot be generated from: empty, or longer than the model's context window."""


class ModelNotFoundError(MirrorsdError):
    """A model argument that is neither a catalog name, a local folder, a .gguf file nor a reachable hub id."""


class CatalogError(MirrorsdError):
    """Fetching or building a catalog model failed (no network, checksum mismatch, bad package)."""


class ChecksumError(CatalogError):
    """An assembled catalog file does not have the SHA-256 the catalog promises."""


class TokenizerMismatchError(MirrorsdError):
    """Draft and target do not share a tokenizer, so draft token ids mean nothing to the target."""


class RollbackUnsupportedError(MirrorsdError):
    """The model's KV cache cannot be truncated after a rejected draft (recurrent / linear-attention layers)."""


class DatastoreError(MirrorsdError):
    """A retrieval datastore that cannot be used: missing, truncated, corrupt, or built for another tokenizer."""


class ExportError(MirrorsdError):
    """A draft model that cannot be exported, or an export folder that fails to load or validate."""


class ProviderError(MirrorsdError):
    """An execution provider / device that is not installed here or refuses the exported draft."""


class EngineClosedError(MirrorsdError):
    """A request on an Engine after its close() (or after its `with` block ended)."""


class EngineBusyError(MirrorsdError):
    """A call on an Engine from the thread whose open stream holds it (waiting would wait for ever)."""


class RequestCancelled(MirrorsdError):
    """A request stopped mid-pass because its caller cancelled it (a server's client left during a long prompt):
    it ends without a reply; the engine takes the next request at once."""


class ModelOutputError(MirrorsdError):
    """The target's logits are not numbers (NaN, infinite) or all equal: damaged weights (a corrupted file) or a
    backend that overflowed. Refused rather than decoded into token 0 over and over."""


class GrammarError(MirrorsdError):
    """The structured-output grammar engine failed mid-reply (its state refused a token it had allowed, or hit a
    resource limit): the reply stops with this error rather than leave the grammar."""
