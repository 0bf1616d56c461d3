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
    """Finds the first stop string in a stream of text: the one that ends first (at one end, the
    longer one), wherever the pieces of text were cut. Text that could be the start of a stop
    string is held back until the next piece tells (it never reaches the client if it is).

    A piece costs its length times the number of stop strings, whatever came before it: each stop
    string's match advances one character at a time (StopMatch). Nothing is fed after a match."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.matches = [StopMatch(s) for s in stops]
        self.pending = ""  # held back: the longest partial match, at most the longest stop string less one

    def feed(self, text: str) -> tuple[str, bool]:
        """(the text that can go to the client now, whether a stop string matched)."""
        if not self.matches:
            return text, False
        start = len(self.pending)
        self.pending += text
        for i, char in enumerate(text):
            found = [len(m.stop) for m in self.matches if m.advance(char)]
            if found:
                out, self.pending = self.pending[:start + i + 1 - max(found)], ""
                return out, True
        keep = max(m.matched for m in self.matches)
        out, self.pending = self.pending[:len(self.pending) - keep], self.pending[len(self.pending) - keep:]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


class StopMatch:
    """How much of one stop string the text seen so far ends with (Knuth-Morris-Pratt)."""

    def __init__(self, stop: str) -> None:
        self.stop = stop
        self.matched = 0  # the text ends with stop[:matched]
        # fallback[k]: the longest proper prefix of stop[:k] that is also its suffix
        self.fallback = [0] * (len(stop) + 1)
        k = 0
        for i in range(1, len(stop)):
            while k and stop[i] != stop[k]:
                k = self.fallback[k]
            if stop[i] == stop[k]:
                k += 1
            self.fallback[i + 1] = k

    def advance(self, char: str) -> bool:
        """One more character of text; True when it completes the stop string."""
        k = self.matched
        while k and char != self.stop[k]:
            k = self.fallback[k]
        if char == self.stop[k]:
            k += 1
        self.matched = k
        return k == len(self.stop)
