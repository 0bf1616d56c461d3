"""Token ids to text one step at a time (SGLang's DetokenizerManager), and stop strings.

A byte-level BPE token can hold part of a UTF-8 character, so a token's text is known only
once the tokens after it have come: each step decodes a short window of the latest ids
(from `prefix_offset`) and emits what lies beyond the text already emitted, unless it ends in
an incomplete character (U+FFFD). The streamed pieces add up to `decode(all ids)`."""

from __future__ import annotations

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0  # the window decoded each step starts here
        self.read_offset = 0  # ids up to here are emitted as text

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, ids: list[int]) -> str:
        """The new text that `ids` complete (possibly empty)."""
        self.ids += ids
        return self._advance(final=False)

    def flush(self) -> str:
        """At the end: whatever is left, an incomplete character included."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        emitted = self._decode(self.ids[self.prefix_offset:self.read_offset])
        text = self._decode(self.ids[self.prefix_offset:])
        if len(text) <= len(emitted) or (text.endswith(REPLACEMENT) and not final):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return text[len(emitted):]


class StopStrings:
    """Finds the first stop string in a stream of text. Text that could be the start of a stop
    string is held back until the next piece tells (it never reaches the client if it is)."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self.pending = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """(the text that can go to the client now, whether a stop string matched)."""
        if not self.stops:
            return text, False
        self.pending += text
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.pending = self.pending[:min(hits)], ""
            return out, True
        keep = max((k for s in self.stops for k in range(1, len(s)) if self.pending.endswith(s[:k])), default=0)
        out, self.pending = self.pending[:len(self.pending) - keep], self.pending[len(self.pending) - keep:]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out
