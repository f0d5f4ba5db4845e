"""Streaming text: the pieces add up to the whole reply's decode (whole characters only, stop strings cut),
and the work per token does not grow with the reply (the decode is incremental, not the whole reply again
per token)."""

from __future__ import annotations

import random

import pytest

from mirrorsd.text_stream import StreamingText


def stream(tokenizer, ids, stops=()) -> tuple[list[str], bool]:
    text = StreamingText(tokenizer, stops)
    pieces, stopped = [], False
    for token in ids:
        piece, stopped = text.push(token)
        pieces.append(piece)
        if stopped:
            break
    pieces.append(text.flush())
    return pieces, stopped


def full(tokenizer, ids) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


@pytest.mark.parametrize("seed", range(20))
def test_the_pieces_are_the_whole_decode(tokenizer, seed):
    rng = random.Random(seed)
    ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 80))]  # specials and partial bytes too
    pieces, _ = stream(tokenizer, ids)
    assert "".join(pieces) == full(tokenizer, ids)
    assert all("\ufffd" not in piece for piece in pieces[:-1] if "\ufffd" not in full(tokenizer, ids))


def test_multibyte_characters_come_out_whole(tokenizer):
    ids = tokenizer("naïve café — 日本語 🙂 done", add_special_tokens=False)["input_ids"]
    pieces, _ = stream(tokenizer, ids)
    assert "".join(pieces) == "naïve café — 日本語 🙂 done"
    assert not any("\ufffd" in piece for piece in pieces)


def test_a_stop_string_is_cut_and_never_partly_emitted(tokenizer):
    ids = tokenizer("hello world. STOP here", add_special_tokens=False)["input_ids"]
    pieces, stopped = stream(tokenizer, ids, stops=("STOP",))
    assert stopped and "".join(pieces) == "hello world. "
    assert not any("S" in piece for piece in pieces)


class CountingTokenizer:
    """The real tokenizer, counting the token ids it is asked to decode."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.decoded = tokenizer, 0

    def decode(self, ids, **kwargs) -> str:
        self.decoded += len(ids)
        return self.tokenizer.decode(ids, **kwargs)


def test_decoding_work_is_linear_in_the_reply(tokenizer):
    """A 4,000-token reply decodes a few ids per token, not the whole reply per token (8 million ids)."""
    ids = tokenizer("def f(x):\n    return x + 1  # ünïcode\n" * 300, add_special_tokens=False)["input_ids"][:4000]
    counting = CountingTokenizer(tokenizer)
    text = StreamingText(counting, ("\n\n\n",))
    for token in ids:
        text.push(token)
    text.flush()
    assert text.text == full(tokenizer, ids)
    assert counting.decoded < 6 * len(ids), counting.decoded
