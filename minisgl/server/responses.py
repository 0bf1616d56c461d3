"""OpenAI's response shapes: completions and chat, whole or as stream chunks, with logprobs."""

from __future__ import annotations

import math
import time
import uuid
from itertools import accumulate

from ..sampling_params import TokenLogprob
from .detokenizer import text_decoder, token_bytes
from .generation import Choice, Piece

LOGPROB_FLOOR = -9999.0  # what OpenAI reports for a token the model gives no chance (JSON has no -inf)


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else LOGPROB_FLOOR


class Format:
    """The fields every response of one request shares, and its usage."""

    object_full = object_chunk = ""
    prefix = ""

    def __init__(self, model: str, tokenizer) -> None:
        self.id = f"{self.prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.decode = text_decoder(tokenizer, skip_special_tokens=False)

    def envelope(self, obj: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    @staticmethod
    def usage(prompt_tokens: int, completion_tokens: int) -> dict:
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict:
        return {**self.envelope(self.object_chunk, []), "usage": self.usage(prompt_tokens, completion_tokens)}

    def token_text(self, token_id: int) -> str:
        return self.decode([token_id])

    def first_chunks(self, n: int) -> list[dict]:
        return []


class CompletionFormat(Format):
    object_full = object_chunk = "text_completion"
    prefix = "cmpl"

    def __init__(self, model: str, tokenizer) -> None:
        super().__init__(model, tokenizer)
        self.offsets: dict[int, int] = {}  # by choice: characters of its text so far (a stream's chunks)
        self.shown = text_decoder(tokenizer)  # a token's text as the choice's text has it: none for a special one

    def logprobs(self, index: int, entries: list[TokenLogprob | None]) -> dict:
        """`text_offset`: where each token's text starts in the choice's text (a special token, e.g.
        an EOS that ignore_eos let through, is listed but adds no text)."""
        entries = [e for e in entries if e is not None]
        tokens = [self.token_text(e.token_id) for e in entries]
        offsets = list(accumulate((len(self.shown([e.token_id])) for e in entries), initial=self.offsets.get(index, 0)))
        self.offsets[index] = offsets.pop()
        return {"tokens": tokens, "text_offset": offsets,
                "token_logprobs": [_finite(e.logprob) for e in entries],
                "top_logprobs": [{self.token_text(t): _finite(lp) for t, lp in e.top} for e in entries]}

    def chunk(self, piece: Piece, with_logprobs: bool) -> dict:
        return self.envelope(self.object_chunk, [{
            "index": piece.index, "text": piece.text, "finish_reason": piece.finish_reason,
            "logprobs": self.logprobs(piece.index, piece.logprobs) if with_logprobs else None}])

    def full(self, choices: list[Choice], with_logprobs: bool, prompt_tokens: int) -> dict:
        return {**self.envelope(self.object_full, [{
            "index": c.index, "text": "".join(c.text), "finish_reason": c.finish_reason,
            "logprobs": self.logprobs(c.index, c.logprobs) if with_logprobs else None} for c in choices]),
            "usage": self.usage(prompt_tokens, sum(c.completion_tokens for c in choices))}


class ChatFormat(Format):
    object_full, object_chunk = "chat.completion", "chat.completion.chunk"
    prefix = "chatcmpl"

    def __init__(self, model: str, tokenizer) -> None:
        super().__init__(model, tokenizer)
        self.token_bytes = token_bytes(tokenizer)

    def _token(self, token_id: int, logprob: float) -> dict:
        # `bytes`: the token's own, which rebuild a character that several tokens share (its text is U+FFFD)
        return {"token": self.token_text(token_id), "logprob": _finite(logprob), "bytes": list(self.token_bytes(token_id))}

    def logprobs(self, entries: list[TokenLogprob | None]) -> dict:
        return {"content": [{**self._token(e.token_id, e.logprob), "top_logprobs": [self._token(t, lp) for t, lp in e.top]}
                            for e in entries if e is not None]}

    def first_chunks(self, n: int) -> list[dict]:
        return [self.envelope(self.object_chunk, [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                    "logprobs": None, "finish_reason": None}]) for i in range(n)]

    def chunk(self, piece: Piece, with_logprobs: bool) -> dict:
        return self.envelope(self.object_chunk, [{
            "index": piece.index, "delta": {"content": piece.text} if piece.text else {},
            "finish_reason": piece.finish_reason,
            "logprobs": self.logprobs(piece.logprobs) if with_logprobs else None}])

    def full(self, choices: list[Choice], with_logprobs: bool, prompt_tokens: int) -> dict:
        return {**self.envelope(self.object_full, [{
            "index": c.index, "message": {"role": "assistant", "content": "".join(c.text)},
            "finish_reason": c.finish_reason,
            "logprobs": self.logprobs(c.logprobs) if with_logprobs else None} for c in choices]),
            "usage": self.usage(prompt_tokens, sum(c.completion_tokens for c in choices))}
