"""The HTTP process's side of the engine (SGLang's TokenizerManager): it starts the scheduler
process, submits generations, routes each step's new tokens to the HTTP request that waits
for them, aborts the generations of requests that went away, and records the latencies.

A generation counts against `max_inflight` while the engine works on it: from its submission
to the engine's last word on it (its finish, or its refusal), or to its abort. Not until its
client has read it: a client that stops reading holds no place in the engine."""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import zmq
import zmq.asyncio

from ..sampling_params import SamplingParams
from .grammar_queue import DEFAULT_TIMEOUT_S, DEFAULT_WORKERS
from .messages import AbortRequest, EngineInfo, GenerateRequest, GrammarSpec, Shutdown, StepOutput, TokenDelta
from .metrics import Metrics
from .scheduler_process import SchedulerArgs, run_scheduler

STARTUP_POLL_S = 0.2
DRAIN_POLL_S = 0.05


class EngineUnavailable(RuntimeError):
    """The scheduler process failed or is shutting down: the request cannot be served."""


class Overloaded(RuntimeError):
    """More generations in flight than the server takes (a 503 with Retry-After)."""


@dataclass
class Submission:
    """The generations of one HTTP request (one per prompt and choice), all on one queue."""

    rids: list[int]
    queue: asyncio.Queue[TokenDelta] = field(default_factory=asyncio.Queue)
    open: set[int] = field(default_factory=set)  # not finished for the client, not aborted


@dataclass
class Timing:
    """When a generation was submitted and when its last token arrived (for TTFT and ITL)."""

    submitted: float
    last_token: float | None = None


class EngineClient:
    def __init__(self, model: Path, engine_kwargs: dict, metrics: Metrics, max_inflight: int,
                 grammar_timeout_s: float = DEFAULT_TIMEOUT_S, grammar_workers: int = DEFAULT_WORKERS) -> None:
        self.model = model
        self.engine_kwargs = engine_kwargs
        self.metrics = metrics
        self.max_inflight = max_inflight
        self.grammar_timeout_s = grammar_timeout_s
        self.grammar_workers = grammar_workers
        self.info: EngineInfo | None = None
        self.failure: str | None = None  # the scheduler process died or the engine failed
        self.closing = False
        self.last_heard = time.monotonic()  # the scheduler's last output (a heartbeat at least every second)
        self._ids = itertools.count()
        self._submissions: dict[int, Submission] = {}  # by rid, while the engine works on the generation
        self._timing: dict[int, Timing] = {}
        self._receiver: asyncio.Task | None = None

    # ---------------------------------------------------------------- lifecycle
    async def start(self) -> EngineInfo:
        """Start the scheduler process and wait until its engine is built; ValueError if it cannot be."""
        self._dir = tempfile.TemporaryDirectory(prefix="minisgl-serve-")
        self._ctx = zmq.asyncio.Context()
        self._requests, self._outputs = self._ctx.socket(zmq.PUSH), self._ctx.socket(zmq.PULL)
        requests_addr, outputs_addr = f"ipc://{self._dir.name}/requests", f"ipc://{self._dir.name}/outputs"
        self._requests.bind(requests_addr)
        self._outputs.bind(outputs_addr)
        args = SchedulerArgs(str(self.model), self.engine_kwargs, requests_addr, outputs_addr, self.grammar_timeout_s,
                             self.grammar_workers)
        # spawn: a fresh interpreter, so no thread or lock of this process is inherited half-held
        self.process = multiprocessing.get_context("spawn").Process(target=run_scheduler, args=(args,),
                                                                    name="minisgl-scheduler", daemon=True)
        self.process.start()
        while not await self._outputs.poll(int(STARTUP_POLL_S * 1000)):
            if not self.process.is_alive():
                raise ValueError(f"the scheduler process exited while starting (exit code {self.process.exitcode})")
        info = await self._outputs.recv_pyobj()
        self._outputs_now = zmq.Socket.shadow(self._outputs.underlying)  # the same socket, read without awaiting
        if info.error is not None:
            self.process.join()
            raise ValueError(info.error)
        self.info = info
        self.last_heard = time.monotonic()
        self._receiver = asyncio.create_task(self._receive_loop())
        return info

    @property
    def silent_s(self) -> float:
        """Seconds since the scheduler process last sent anything."""
        return time.monotonic() - self.last_heard

    @property
    def in_flight(self) -> int:
        """Generations submitted and not finished yet."""
        return len(self._submissions)

    async def drain(self, timeout_s: float) -> bool:
        """Take no new request; wait until every generation in flight is finished (True), or
        until the timeout (False)."""
        self.closing = True
        deadline = time.monotonic() + timeout_s
        while self._submissions and time.monotonic() < deadline and self.failure is None:
            await asyncio.sleep(DRAIN_POLL_S)
        return not self._submissions

    def abort_all(self) -> None:
        """Every generation in flight ends with finish_reason "abort" (its client is told), and
        the scheduler process exits once they are out."""
        self.closing = True
        if self.process.is_alive():
            self._send(Shutdown(drain=False))

    async def stop(self, timeout_s: float) -> int | None:
        """The scheduler process checks its pools, frees the engine and exits; its exit code.
        Killed if it does not within the timeout (a hung device)."""
        self.closing = True
        if self.process.is_alive():
            self._send(Shutdown(drain=True))
            await asyncio.to_thread(self.process.join, timeout_s)
        if self.process.is_alive():
            self.process.kill()
            await asyncio.to_thread(self.process.join)
        if self._receiver is not None:
            self._receiver.cancel()
        self._requests.close(linger=0)
        self._outputs.close(linger=0)
        self._ctx.term()
        self._dir.cleanup()
        return self.process.exitcode

    # ---------------------------------------------------------------- requests
    def submit(self, generations: list[tuple[list[int], SamplingParams]], grammar: GrammarSpec | None) -> Submission:
        if self.failure is not None or self.closing:
            raise EngineUnavailable(self.failure or "the server is shutting down")
        if len(self._submissions) + len(generations) > self.max_inflight:
            raise Overloaded(f"the server has {len(self._submissions)} generations in flight (at most "
                             f"{self.max_inflight}); retry later")
        sub = Submission([next(self._ids) for _ in generations])
        now = time.perf_counter()
        for rid, (prompt_ids, params) in zip(sub.rids, generations):
            self._submissions[rid] = sub
            self._timing[rid] = Timing(now)
            sub.open.add(rid)
            self._send(GenerateRequest(rid, prompt_ids, params, grammar))
            self.metrics.prompt_tokens.inc(len(prompt_ids))
        return sub

    def finish(self, sub: Submission, rid: int) -> None:
        """The generation `rid` is over for its client: its last delta is read. The engine was done
        with it already: _route freed its place in the same call that queued that delta."""
        sub.open.discard(rid)

    def release(self, sub: Submission) -> None:
        """The HTTP request is over (answered, or its client went away): abort what still runs."""
        for rid in list(sub.open):
            self.abort(sub, rid)

    def abort(self, sub: Submission, rid: int) -> None:
        """The client went away, or the server stops: `rid` is cut short (counted as aborted)."""
        if rid in self._submissions:
            self.metrics.aborted.inc()
        self.stop_generation(sub, rid)

    def stop_generation(self, sub: Submission, rid: int) -> None:
        """The engine stops generating `rid`: its client has what it asked for (a stop string), or is gone."""
        sub.open.discard(rid)
        if rid in self._submissions:  # else the engine is done with it already: nothing to stop
            self._engine_done(rid)
            self._send(AbortRequest(rid))

    def _engine_done(self, rid: int) -> None:
        """The engine works on `rid` no more: its place is free for another generation."""
        self._submissions.pop(rid, None)
        self._timing.pop(rid, None)

    def _send(self, msg: object) -> None:
        # Not awaited: a PUSH socket queues the message at once (the HWM is far above what a
        # server has in flight), and an abort must go out even from a cancelled request's finally.
        if not self._requests.closed:  # after stop(): the scheduler process is gone already
            self._requests.send_pyobj(msg)

    # ---------------------------------------------------------------- tokens coming back
    async def _receive_loop(self) -> None:
        while True:
            if not await self._outputs.poll(int(STARTUP_POLL_S * 1000)):
                if not self.process.is_alive() and not self.closing:
                    self._fail(f"the scheduler process exited (exit code {self.process.exitcode})")
                    return
                continue
            self.last_heard = time.monotonic()
            # Every step's output that is waiting is routed before any stream runs again: a stream
            # behind by several steps then finds all its tokens queued and sends them in one chunk
            # (one at a time, it would pay a JSON chunk and a socket write per token and stay behind).
            for out in self._waiting_outputs():
                self._route(out)
                if out.fatal is not None:
                    self._fail(f"the engine failed: {out.fatal}")
                    return

    def _waiting_outputs(self) -> Iterator[StepOutput]:
        """The StepOutputs queued on the socket now, without waiting for more (the scheduler sends
        at most one a step, far slower than these are read: this ends)."""
        while True:
            try:
                yield self._outputs_now.recv_pyobj(zmq.NOBLOCK)
            except zmq.Again:
                return

    def _route(self, out: StepOutput) -> None:
        now = time.perf_counter()
        self.metrics.observe_load(out.load)
        tokens = 0
        for delta in out.deltas:
            tokens += self._record(delta, now)
            sub = self._submissions.get(delta.rid)
            if sub is not None:  # else its client is gone, or a stop string ended it
                sub.queue.put_nowait(delta)
            if delta.finish_reason is not None or delta.error is not None:  # the engine's last word on it
                self._engine_done(delta.rid)
        if tokens:  # counted once a step, not once a delta: per-token work is what limits this process
            self.metrics.generation_tokens.inc(tokens)
            self.metrics.rate.add(tokens, time.monotonic())

    def _fail(self, reason: str) -> None:
        """No more tokens will come: every open generation ends with an error, the gauges go to 0
        (nothing runs), and the server exits (cli.py)."""
        self.failure = reason
        for rid, sub in self._submissions.items():
            sub.queue.put_nowait(TokenDelta(rid, [], error=reason))
        self._submissions.clear()
        self._timing.clear()
        self.metrics.clear_load()

    def _record(self, delta: TokenDelta, now: float) -> int:
        """TTFT or ITL of one delta; its tokens, counted (0 for a request already gone)."""
        n = len(delta.token_ids)
        timing = self._timing.get(delta.rid)
        if not n or timing is None:
            return 0
        if timing.last_token is None:
            self.metrics.ttft.observe(now - timing.submitted)
        else:
            self.metrics.itl.observe((now - timing.last_token) / n, times=n)  # tokens that came together share the gap
        timing.last_token = now
        return n
