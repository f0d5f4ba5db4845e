"""Draft and target must share a tokenizer: the same id must mean the same text to both."""

from __future__ import annotations

import hashlib
import json

from mirrorsd.errors import TokenizerMismatchError


def check_tokenizers_match(target_tok, draft_tok, target_name: str = "target", draft_name: str = "draft") -> None:
    """Raise TokenizerMismatchError naming the first differences (vocab, special tokens, token text)."""
    problems: list[str] = []
    tv, dv = target_tok.get_vocab(), draft_tok.get_vocab()
    if len(tv) != len(dv):
        problems.append(f"vocabulary sizes differ ({len(tv)} vs {len(dv)})")
    differing = [tok for tok, i in tv.items() if dv.get(tok) != i]
    if differing:
        sample = ", ".join(repr(t) for t in differing[:5])
        problems.append(f"{len(differing)} tokens map to different ids (e.g. {sample})")
    for attr in ("eos_token_id", "bos_token_id", "pad_token_id", "unk_token_id"):
        a, b = getattr(target_tok, attr, None), getattr(draft_tok, attr, None)
        if a != b:
            problems.append(f"{attr} differs ({a} vs {b})")
    probe = "def f(x):\n    return x * 2  # héllo, 世界"
    if target_tok.encode(probe, add_special_tokens=False) != draft_tok.encode(probe, add_special_tokens=False):
        problems.append("the same text encodes to different ids")
    if problems:
        raise TokenizerMismatchError(
            f"the {draft_name} model's tokenizer does not match the {target_name}'s: " + "; ".join(problems),
            "pick a draft from the target's model family (same tokenizer), e.g. qwen2.5-coder-0.5b for "
            "qwen2.5-coder-1.5b, or use a model-free drafter (--draft ngram)",
        )


def tokenizer_fingerprint(tokenizer) -> str:
    """SHA-256 over the vocabulary and special token ids: equal fingerprints, equal token ids.
    (Computed once per tokenizer object: hashing a 150k vocabulary takes a few hundred ms.)"""
    cached = getattr(tokenizer, "_mirrorsd_fingerprint", None)
    if cached is None:
        vocab = sorted(tokenizer.get_vocab().items())
        special = [getattr(tokenizer, a, None) for a in ("eos_token_id", "bos_token_id", "pad_token_id",
                                                         "unk_token_id")]
        cached = hashlib.sha256(json.dumps([vocab, special], ensure_ascii=False).encode()).hexdigest()
        try:
            tokenizer._mirrorsd_fingerprint = cached
        except AttributeError:
            pass
    return cached
