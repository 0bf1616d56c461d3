"""Token ids to text one step at a time (SGLang's DetokenizerManager), and stop strings.

A byte-level BPE token can hold part of a UTF-8 character, so a token's text is known only
once the tokens after it have come. Each step decodes a short window of ids: the latest piece
of text's ids (context: a tokenizer that drops the leading space of a decode's first token sees
the token before), then the ids not yet sent. What lies beyond the `emitted` characters of it is
new text, unless it ends in an incomplete character (U+FFFD). One decode a step; a second one
when the window, longer than WINDOW ids, slides forward. Ids that add no text (special tokens
skipped, ids the tokenizer does not have) leave the window at once, so that it stays short.
The streamed pieces add up to `decode(all ids)`."""

from __future__ import annotations

from typing import Callable

REPLACEMENT = "\ufffd"
WINDOW = 16  # ids in the window beyond which it slides


def text_decoder(tokenizer, skip_special_tokens: bool = True) -> Callable[[list[int]], str]:
    """`ids -> tokenizer.decode(ids, skip_special_tokens=...)`. For a fast tokenizer whose decode is
    nothing but its Rust backend's (no clean-up of spaces, no override), the backend is called
    directly: transformers' code around it costs several times the decode of a few ids, and the
    server decodes once per token of every stream."""
    from transformers import PreTrainedTokenizerFast

    cls = type(tokenizer)
    if (isinstance(tokenizer, PreTrainedTokenizerFast) and not tokenizer.clean_up_tokenization_spaces
            and cls.decode is PreTrainedTokenizerFast.decode and cls._decode is PreTrainedTokenizerFast._decode):
        backend = tokenizer.backend_tokenizer
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    def __init__(self, tokenizer) -> None:
        self.decode = text_decoder(tokenizer)
        self.window: list[int] = []  # the ids decoded each step
        self.emitted = 0  # characters of the window's text already sent
        self.read = 0  # window ids up to here are sent as text

    def add(self, ids: list[int]) -> str:
        """The new text that `ids` complete (possibly empty)."""
        self.window += ids
        return self._advance(final=False)

    def flush(self) -> str:
        """At the end: whatever is left, an incomplete character included."""
        return self._advance(final=True) if self.read < len(self.window) else ""

    def _advance(self, final: bool) -> str:
        text = self.decode(self.window)
        if len(text) < self.emitted or (text.endswith(REPLACEMENT) and not final):
            return ""  # the rest of a character is still to come
        if len(text) == self.emitted:
            # Ids without text after some text: nothing later changes that, they go. Before any text
            # they stay: a decode's first space, which some tokenizers strip, may be theirs.
            if self.read:
                del self.window[self.read:]
            return ""
        new = text[self.emitted:]
        if len(self.window) > WINDOW:  # this piece's ids stay, as the next window's context
            del self.window[:self.read]
            self.emitted = len(self.decode(self.window))
        else:
            self.emitted = len(text)
        self.read = len(self.window)
        return new


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
