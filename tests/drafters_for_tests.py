"""Real drafters with known behaviour, for the end-to-end tests."""

from __future__ import annotations

import time

import numpy as np

from mirrorsd import Draft, GenerationConfig


class RandomTokenDrafter:
    """Proposes uniformly random tokens: almost every draft is rejected, so rollback runs every step."""

    name = "random"
    model = None
    learner = None
    bounded = False

    def __init__(self, vocab_size: int, seed: int = 0) -> None:
        self.vocab_size = vocab_size
        self.rng = np.random.default_rng(seed)

    def start(self, config: GenerationConfig) -> None:
        pass

    def propose(self, committed, max_tokens):
        return Draft([int(t) for t in self.rng.integers(0, self.vocab_size, max_tokens)], None, self.name)

    def accepted(self, committed, n_accepted):
        pass


def _q(vocab: int, tokens: list[int], how: str) -> np.ndarray:
    """[k, vocab] draft distributions broken in the chosen way (each row's own token kept likely)."""
    q = np.full((len(tokens), vocab), 0.5 / vocab)
    q[np.arange(len(tokens)), tokens] += 0.5
    if how == "nan-q":
        q[:] = np.nan
    elif how == "inf-q":
        q[:, 0] = np.inf
    elif how == "negative-q":
        q[:, 1] = -0.3
    elif how == "unnormalised-q":
        q *= 3.0
    elif how == "zero-q-for-token":
        q[np.arange(len(tokens)), tokens] = 0.0
        q /= q.sum(axis=1, keepdims=True)
    elif how == "1d-q":
        return q[0]
    elif how == "wide-q":  # a valid distribution, zero beyond the vocabulary, but twice as wide
        return np.pad(q, ((0, 0), (0, vocab)))
    return q


class FailingDrafter(RandomTokenDrafter):
    """Works for `good_steps` proposals, then misbehaves in the chosen way (FAULTS)."""

    name = "failing"
    FAULTS = ("raise", "garbage", "too-long", "feedback-raises", "nan-q", "inf-q", "negative-q", "unnormalised-q",
              "zero-q-for-token", "1d-q", "narrow-q", "wide-q", "string-ids", "float-ids", "not-a-draft", "start-raises", "hang",
              "mutate-history", "bad-match")

    def __init__(self, vocab_size: int, how: str, good_steps: int = 2, hang_s: float = 3.0,
                 bounded: bool = False) -> None:
        """bounded: declares that its calls return promptly (they run on the request's thread)."""
        super().__init__(vocab_size)
        self.how, self.left, self.hang_s, self.bounded = how, good_steps, hang_s, bounded

    def start(self, config: GenerationConfig) -> None:
        if self.how == "start-raises":
            raise RuntimeError("could not open the NPU")

    def propose(self, committed, max_tokens):
        self.left -= 1
        good = super().propose(committed, max_tokens)
        if self.left >= 0:
            return good
        how = self.how
        if how == "raise":
            raise RuntimeError("NPU went away")
        if how == "garbage":
            return Draft([self.vocab_size + 5] * max_tokens, None, self.name)
        if how == "too-long":
            return Draft([0] * (max_tokens + 3), None, self.name)
        if how == "narrow-q":  # a valid distribution over half the vocabulary: another tokenizer's
            tokens = [t % (self.vocab_size // 2) for t in good.tokens]
            return Draft(tokens, _q(self.vocab_size // 2, tokens, how), self.name)
        if "-q" in how:
            return Draft(good.tokens, _q(self.vocab_size, good.tokens, how), self.name)
        if how == "string-ids":
            return Draft([str(t) for t in good.tokens], None, self.name)
        if how == "float-ids":
            return Draft([t + 0.5 for t in good.tokens], None, self.name)
        if how == "not-a-draft":
            return good.tokens
        if how == "bad-match":  # a match length must be a non-negative integer
            return Draft(good.tokens, None, self.name, match=-2)
        if how == "hang":
            time.sleep(self.hang_s)
        if how == "mutate-history":
            committed.append(0)  # the history is read-only: this must raise
        return good

    def accepted(self, committed, n_accepted):
        if self.how == "feedback-raises" and self.left < 0:
            raise RuntimeError("lost its state")


class PacedDrafter:
    """A real drafter on a slow device: wraps another drafter and takes `delay_s` to take in each
    step's outcome (called every step, even while the gate pauses drafting), so a reply lasts long
    enough for a test to stop it (or disconnect) midway, whatever the machine's speed."""

    def __init__(self, inner, delay_s: float = 0.02) -> None:
        self.inner, self.delay_s = inner, delay_s
        self.name, self.model, self.learner = inner.name, inner.model, inner.learner
        self.bounded = False  # it sleeps

    def start(self, config: GenerationConfig) -> None:
        self.inner.start(config)

    def propose(self, committed, max_tokens):
        return self.inner.propose(committed, max_tokens)

    def accepted(self, committed, n_accepted):
        time.sleep(self.delay_s)
        self.inner.accepted(committed, n_accepted)


class HistoryCorruptingDrafter(RandomTokenDrafter):
    """Breaks the Drafter contract: appends a token to the committed history it is handed (which it must
    only read) and proposes nothing. The history is handed over read-only, so this raises and the drafter
    is dropped; were it writable, the output would continue from a history the target never produced."""

    name = "corrupting"

    def propose(self, committed, max_tokens):
        committed.append(int(self.rng.integers(0, self.vocab_size)))
        return Draft([], None, self.name)


class ScriptedDrafter:
    """Knows the target's greedy outputs: proposes the true continuation for its first `correct` tokens and
    wrong tokens after that, so its acceptance by draft position is known exactly (1 up to `correct`, then 0)."""

    name = "scripted"
    model = None
    learner = None
    bounded = True

    def __init__(self, sequences: list[list[int]], vocab_size: int, correct: int = 1 << 30) -> None:
        self.sequences, self.vocab_size, self.correct = sequences, vocab_size, correct

    def start(self, config: GenerationConfig) -> None:
        pass

    def propose(self, committed, max_tokens):
        n = len(committed)
        full = next((s for s in self.sequences if len(s) > n and s[:n] == list(committed)), None)
        if full is None:
            return Draft([], None, self.name)
        truth = full[n:n + max_tokens]
        return Draft([t if i < self.correct else (t + 1) % self.vocab_size for i, t in enumerate(truth)], None,
                     self.name)

    def accepted(self, committed, n_accepted):
        pass
