"""The grammar clip of a structured-output request: llguidance's matcher over the target's vocabulary.

The verify step (verify.py, `DecodeState`) asks a request's `GrammarConstraint` three things per step:
- `clip(draft)`: the longest prefix of the draft the grammar allows (a forbidden token ends the draft);
- `masks(draft)`: for each of the k+1 verified positions, the tokens the grammar allows there. The target's
  logits are masked before `verify`, so the distribution verified against -- and sampled from -- is the
  constrained target's, exactly as in constrained target-only decoding;
- `advance(tokens)`: the committed tokens move the grammar state on.
The matcher only ever holds committed tokens between steps: the draft tokens consumed to compute the masks
are rolled back at once, as the KV cache past the committed length is.

The grammars themselves are compiled in mirrorsd/structured.py.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from mirrorsd.errors import GrammarError


class GrammarConstraint:
    """One request's grammar state. Not thread-safe: the verify thread alone uses it."""

    def __init__(self, matcher, vocab_size: int, eos_ids: Sequence[int] = ()) -> None:
        """eos_ids: tokens that end a reply. The matcher never consumes one: nothing follows it, and rolling a
        matcher back over an end-of-sequence token corrupted its state (llguidance 1.9, measured)."""
        self.matcher, self.vocab_size, self.eos = matcher, vocab_size, frozenset(eos_ids)
        self._bits = np.zeros((vocab_size + 31) // 32, dtype=np.int32)
        self._synced: list[int] = []
        self._clipped: tuple[tuple[int, ...], torch.Tensor] | None = None  # the last clip's draft and its masks

    def clip(self, tokens: Sequence[int]) -> list[int]:
        """The longest prefix of `tokens` the grammar allows from the committed state, ending at the first
        end-of-sequence token if it has one."""
        tokens = [int(t) for t in tokens]
        n = self.matcher.validate_tokens(tokens)
        end = next((i for i, t in enumerate(tokens[:n]) if t in self.eos), None)
        if end is not None:
            return self._by_the_masks(tokens[:end + 1])
        if n < len(tokens) and tokens[n] in self.eos:  # validate_tokens may stop before an allowed one
            self._consume(tokens[:n])
            allowed = bool(self._allowed()[tokens[n]])
            if n:
                self.matcher.rollback(n)
            n += allowed
        return self._by_the_masks(tokens[:n])

    def _by_the_masks(self, tokens: list[int]) -> list[int]:
        """`tokens` up to the first one its mask forbids: validate_tokens can pass a token the mask, which
        verification applies, does not allow (smollm2 under a JSON schema: "re" where the mask wants "res").
        The masks are kept for the verify pass of this very draft (masks())."""
        if not tokens:
            return tokens
        rows = self.masks(tokens)
        cut = next((i for i, t in enumerate(tokens) if not rows[i, t]), len(tokens))
        self._clipped = (tuple(tokens[:cut]), rows[:cut + 1])
        return tokens[:cut]

    def forced(self, limit: int) -> list[int]:
        """Up to `limit` tokens the grammar forces next from the committed state (llguidance's fast-forward
        tokens: e.g. a schema's fixed keys and punctuation). A draft, not a decision: the target may still pick
        another tokenization of the same text, and verify decides as for any draft."""
        return [int(t) for t in self.matcher.compute_ff_tokens()[:limit]] if limit > 0 else []

    def masks(self, draft: Sequence[int]) -> torch.Tensor:
        """[k+1, V] bool: row i holds the tokens allowed after the committed tokens + draft[:i]. The draft must
        be clipped already; the matcher is back at the committed state on return. Rows after an
        end-of-sequence token repeat its row (they are never used: the reply ends there)."""
        kept, self._clipped = self._clipped, None
        if kept is not None and kept[0] == tuple(int(t) for t in draft):  # clip() computed them a moment ago
            return kept[1]
        rows = np.empty((len(draft) + 1, self.vocab_size), dtype=bool)
        consumed = 0
        for i in range(len(draft) + 1):
            if i > 0 and int(draft[i - 1]) in self.eos:
                rows[i:] = rows[i - 1]
                break
            rows[i] = self._allowed()
            if i < len(draft) and int(draft[i]) not in self.eos:
                self._consume(draft[i:i + 1])
                consumed += 1
        if consumed:
            self.matcher.rollback(consumed)
        return torch.from_numpy(rows)

    def advance(self, tokens: Sequence[int]) -> None:
        """The committed tokens, up to the first end-of-sequence token (the reply ends there)."""
        self._clipped = None
        ended = next((i for i, t in enumerate(tokens) if int(t) in self.eos), len(tokens))
        self._consume(tokens[:ended])

    def sync(self, tokens: Sequence[int]) -> bool:
        """Move the state to after `tokens` (rolling back what differs from the last sync, as a transformers
        logits processor needs under assisted decoding); False if the grammar forbids them."""
        self._clipped = None
        tokens, seen = [int(t) for t in tokens], self._synced
        common = 0
        while common < min(len(tokens), len(seen)) and tokens[common] == seen[common]:
            common += 1
        if len(seen) > common:
            self.matcher.rollback(len(seen) - common)
        self._synced = tokens[:common]
        if self.matcher.validate_tokens(tokens[common:]) < len(tokens) - common:
            return False
        self._consume(tokens[common:])
        self._synced = tokens
        return True

    def _consume(self, tokens: Sequence[int]) -> None:
        # One at a time: consume_tokens refuses an end-of-sequence token after the grammar has completed.
        for t in tokens:
            if not self.matcher.consume_token(int(t)):
                raise GrammarError(f"the grammar engine refused token {t} it had allowed: "
                                   f"{self.matcher.get_error().splitlines()[0]}",
                                   "please report it with the schema")

    def _allowed(self) -> np.ndarray:
        self.matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        return np.unpackbits(self._bits.view(np.uint8), bitorder="little")[: self.vocab_size].astype(bool)


def apply_masks(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """logits [k+1, V] with the grammar's forbidden tokens at -inf (allowed: [k+1, V'] bool, V' <= V)."""
    out = logits.float().clone()
    width = min(out.shape[-1], allowed.shape[-1])
    out[:, :width].masked_fill_(~allowed[:, :width].to(out.device), float("-inf"))
    out[:, width:] = float("-inf")
    return out
