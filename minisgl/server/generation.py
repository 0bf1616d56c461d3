"""One HTTP request's generations, from submission to their last piece of text.

Each choice (one per prompt and `n`) is a generation in the engine; its new tokens become
text through its own incremental detokenizer, then pass its stop strings. A stop string
aborts the generation in the engine at once (its tokens beyond it are never sent). Neither a
stop string nor a stop token (`stop_token_ids`, or an end-of-sequence id) is part of the text,
as in SGLang's server; the stop token still counts in the usage and keeps its logprob."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import AsyncIterator

from ..sampling_params import SamplingParams, TokenLogprob, stop_ids
from .detokenizer import IncrementalDetokenizer, StopStrings
from .engine_client import EngineClient
from .messages import GrammarSpec, TokenDelta


class GenerationFailed(RuntimeError):
    """The engine refused or lost a generation: its message goes to the client."""


@dataclass
class Piece:
    """New text of one choice; `finish_reason` on its last piece."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]
    finish_reason: str | None = None

    def extend(self, later: Piece) -> None:
        """This choice's next piece joined to this one (one chunk carries both)."""
        self.text += later.text
        self.token_ids = self.token_ids + later.token_ids
        self.logprobs = self.logprobs + later.logprobs
        self.finish_reason = later.finish_reason


@dataclass
class Choice:
    index: int
    detokenizer: IncrementalDetokenizer
    stops: StopStrings
    stop_ids: frozenset[int]  # the token ids that end this choice, as the engine's Req has them
    completion_tokens: int = 0
    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob | None] = field(default_factory=list)
    finish_reason: str | None = None


class Generation:
    def __init__(self, client: EngineClient, tokenizer, generations: list[tuple[list[int], SamplingParams]],
                 stop: tuple[str, ...], grammar: GrammarSpec | None) -> None:
        self.client = client
        self.sub = client.submit(generations, grammar)
        eos_ids = frozenset(client.info.eos_ids)
        self.choices = {rid: Choice(i, IncrementalDetokenizer(tokenizer), StopStrings(stop), stop_ids(params, eos_ids))
                        for i, (rid, (_, params)) in enumerate(zip(self.sub.rids, generations))}

    @property
    def completion_tokens(self) -> int:
        return sum(c.completion_tokens for c in self.choices.values())

    async def pieces(self) -> AsyncIterator[list[Piece]]:
        """Every choice's pieces as they come, until each has finished: each time, one piece per
        choice from all its tokens that have arrived (a stream behind the engine catches up in
        fewer, larger chunks). The caller must call close() afterwards, also when it stops early
        (a client gone away)."""
        sub = self.sub
        while sub.open:
            ready: dict[int, Piece] = {}  # by rid, in the order they came
            for delta in await self._arrived():
                if delta.rid not in sub.open:
                    continue  # a generation a stop string ended: the engine's last word on it
                if delta.error is not None:
                    if ready:  # what came before the error still reaches the client
                        yield list(ready.values())
                    raise GenerationFailed(delta.error)
                piece = self._advance(delta)
                if delta.rid in ready:
                    ready[delta.rid].extend(piece)
                else:
                    ready[delta.rid] = piece
            if ready:
                yield list(ready.values())

    async def _arrived(self) -> list[TokenDelta]:
        """The deltas queued for this request, waiting for the first one."""
        queue = self.sub.queue
        deltas = [await queue.get()]
        while not queue.empty():
            deltas.append(queue.get_nowait())
        return deltas

    def _advance(self, delta: TokenDelta) -> Piece:
        """One delta through its choice's detokenizer and stop strings, delta by delta: a stop
        string ends the generation at the delta it completes (its usage counts up to there)."""
        choice = self.choices[delta.rid]
        choice.completion_tokens += len(delta.token_ids)
        finish = delta.finish_reason
        ids = delta.token_ids
        if finish == "stop" and ids and ids[-1] in choice.stop_ids:
            ids = ids[:-1]  # ended by a stop token: the engine commits it last, in the finishing delta
        text = choice.detokenizer.add(ids)
        if finish is not None:
            text += choice.detokenizer.flush()
        text, stopped = choice.stops.feed(text)
        if stopped:  # the request's own end, not an abort: the engine just stops early
            self.client.stop_generation(self.sub, delta.rid)
            finish = "stop"
        elif finish is not None:
            text += choice.stops.flush()
            self.client.finish(self.sub, delta.rid)
        return Piece(choice.index, text, delta.token_ids, delta.logprobs, finish)

    async def collect(self) -> list[Choice]:
        """Run to the end; the choices with their whole text, in order."""
        by_index = {c.index: c for c in self.choices.values()}
        async for pieces in self.pieces():
            for piece in pieces:
                choice = by_index[piece.index]
                choice.text.append(piece.text)
                choice.logprobs += piece.logprobs
                choice.finish_reason = piece.finish_reason or choice.finish_reason
        return [by_index[i] for i in sorted(by_index)]

    def close(self) -> None:
        """Abort what still runs (the client went away, or the answer is complete)."""
        self.client.release(self.sub)
