"""The reply's text as its tokens arrive, decoded incrementally (linear in the reply's length).

Each new token is decoded in a short window with the token before it as context (the "prefix / read
offset" scheme of transformers' TextStreamer, TGI and vLLM), so a token costs the same at the 4,000th
position as at the first. Text is released in whole characters only (a token may end inside a UTF-8
sequence), and never text that could still turn out to be the start of a stop string.
"""

from __future__ import annotations


class StreamingText:
    """push(token) -> (new text, stopped); flush() -> the rest at the end; .text is the whole reply so far
    (cut before a stop string once one is found)."""

    def __init__(self, tokenizer, stops: tuple[str, ...] = ()) -> None:
        self.tokenizer, self.stops = tokenizer, stops
        self.hold = max((len(s) for s in stops), default=1) - 1  # chars that might begin a stop string
        self.ids: list[int] = []
        self.prefix = 0  # ids[prefix:read]: the context the next tokens are decoded with (already in .text)
        self.read = 0  # ids[read:]: not yet in .text (an unfinished character, or a skipped special token)
        self.text = ""
        self.emitted = 0  # characters of .text handed out
        self.done = False

    def push(self, token: int) -> tuple[str, bool]:
        self.ids.append(token)
        self._decode_new(final=False)
        for stop in self.stops:
            at = self.text.find(stop, max(0, self.emitted - len(stop)))
            if at >= 0:
                self.text, self.done = self.text[:at], True
                return self._rest(), True
        end = len(self.text) - self.hold
        if end <= self.emitted:
            return "", False
        delta, self.emitted = self.text[self.emitted:end], end
        return delta, False

    def flush(self) -> str:
        """The text not handed out yet; an unfinished character at the end comes out as U+FFFD, as a
        decode of the whole reply gives it."""
        if not self.done:
            self._decode_new(final=True)
            self.done = True
        return self._rest()

    def _decode_new(self, final: bool) -> None:
        known = self._decode(self.ids[self.prefix:self.read])
        window = self._decode(self.ids[self.prefix:])
        if len(window) > len(known) and (final or not window.endswith("\ufffd")):
            self.text += window[len(known):]
            self.prefix, self.read = self.read, len(self.ids)

    def _decode(self, ids: list[int]) -> str:
        # No clean-up of spaces: it rewrites text across window edges (" ." -> "."), so the stream would
        # depend on where the windows fall; the reply is the tokens' own text.
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def _rest(self) -> str:
        delta, self.emitted = self.text[self.emitted:], len(self.text)
        return delta
