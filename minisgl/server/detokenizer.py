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

import functools
import re
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


@functools.cache  # a chat response's Format asks for it: once a process, not once a request
def byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's characters (GPT-2's scheme, Qwen's and Llama 3's tokenizers): a byte that is
    a printable Latin-1 character stands for itself, each other byte, in order, for chr(256 + n)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + n): b for n, b in enumerate(others)}


BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's token for one raw byte


def token_bytes(tokenizer) -> Callable[[int], bytes]:
    """`id -> the bytes the token stands for`, also where they are only part of a character (whose
    text alone is U+FFFD): a byte-level BPE token through its alphabet, a SentencePiece byte token
    as its byte, any other as its piece's UTF-8 ("\u2581" being a space)."""
    from tokenizers.decoders import ByteLevel

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and isinstance(backend.decoder, ByteLevel):
        alphabet = byte_level_alphabet()

        def byte_level_bytes(token_id: int) -> bytes:
            piece = tokenizer.convert_ids_to_tokens(token_id) or ""  # None: an id the tokenizer lacks
            if all(c in alphabet for c in piece):
                return bytes(alphabet[c] for c in piece)
            return piece.encode("utf-8")  # an added token, kept as written
        return byte_level_bytes

    def piece_bytes(token_id: int) -> bytes:
        piece = tokenizer.convert_ids_to_tokens(token_id) or ""
        byte = BYTE_FALLBACK.fullmatch(piece)
        return bytes([int(byte.group(1), 16)]) if byte else piece.replace("\u2581", " ").encode("utf-8")
    return piece_bytes


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
