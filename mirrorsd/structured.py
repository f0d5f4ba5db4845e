"""Structured output: grammar-constrained decoding with llguidance.

A request's JSON schema, regex or Lark grammar becomes a `GrammarConstraint` (runtime/decode/grammar.py, where
the verify step clips drafts and masks logits with it): `grammar_text` compiles the request's settings,
`Grammars` builds the matcher over the target's vocabulary.

llguidance was picked over xgrammar and outlines-core: it installs as one small abi3 wheel with no torch
dependency, needs no per-vocabulary index build (masks are computed lazily, ~0.1-1 ms per position on these
vocabularies; docs/structured-output.md) and takes JSON schema, regex and Lark grammars.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from mirrorsd.config import SCHEMA_HINT as HINT
from mirrorsd.errors import ConfigError
from mirrorsd.runtime.decode.grammar import GrammarConstraint, apply_masks


JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""JSON replies on one line, laid out as Python's json.dumps does. Free whitespace would let a model pad a reply
with newlines until the token limit; a schema's own "x-guidance" options override this."""


def grammar_text(json_schema: str | None, regex: str | None, grammar: str | None) -> str | None:
    """The llguidance grammar for a request's structure settings (at most one is set; None: no constraint)."""
    import llguidance

    if json_schema is not None:
        return llguidance.LLMatcher.grammar_from_json_schema(json_schema, defaults=JSON_LAYOUT)
    if regex is not None:
        return llguidance.LLMatcher.grammar_from_regex(regex)
    if grammar is not None:
        return llguidance.LLMatcher.grammar_from_lark(grammar)
    return None


class Grammars:
    """Builds request constraints for one target vocabulary. The llguidance tokenizer (about a second to build
    for a 150k vocabulary) is made on first use and kept."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: Sequence[int]) -> None:
        self.tokenizer, self.vocab_size, self.eos_ids = tokenizer, vocab_size, sorted(eos_ids)
        self._lltok = None
        self._lock = threading.Lock()

    def constraint(self, grammar: str) -> GrammarConstraint:
        """A fresh matcher for `grammar`; ConfigError with llguidance's message when the grammar is invalid."""
        import llguidance

        matcher = llguidance.LLMatcher(self._tokenizer(), grammar, log_level=0, limits=_limits())
        if matcher.is_error():
            raise ConfigError(f"the structured-output grammar is invalid: {matcher.get_error()}", HINT)
        return GrammarConstraint(matcher, self.vocab_size, self.eos_ids)

    def _tokenizer(self):
        with self._lock:
            if self._lltok is None:
                try:
                    import llguidance.hf
                except ImportError:  # pragma: no cover - a base dependency
                    raise ConfigError("structured output needs the llguidance package",
                                      "pip install llguidance") from None
                try:
                    self._lltok = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=self.vocab_size,
                                                               eos_token=self.eos_ids)
                except ValueError as exc:
                    raise ConfigError(f"structured output needs a fast (Rust) tokenizer: {exc}", "") from None
            return self._lltok


def _limits():
    """llguidance's per-step budgets, raised: at its default lexer fuel a mask step over a 150k vocabulary inside a
    JSON string can run out (measured on qwen2.5-coder with a schema of records), and a parser out of fuel allows
    only end-of-sequence. A step at these limits costs at most about a second."""
    import llguidance

    return llguidance.LLParserLimits(step_lexer_fuel=10_000_000, step_max_items=500_000)


class GrammarLogitsProcessor:
    """A transformers logits processor for a peer's constrained generation (bench): the tokens after the prompt
    set the grammar state, forbidden tokens get -inf. Rows after a forbidden candidate (assisted decoding) are
    left as they are: transformers discards them."""

    def __init__(self, constraint: GrammarConstraint, prompt_len: int) -> None:
        self.constraint, self.prompt_len = constraint, prompt_len

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if not self.constraint.sync(input_ids[0, self.prompt_len:].tolist()):
            return scores
        return apply_masks(scores, self.constraint.masks([])).to(scores.dtype)
