"""The scheduler process: an `LLM` driven by its stepping API, behind a ZMQ queue.

Its loop takes every message that has arrived (new requests, aborts, shutdown), runs one
scheduler step, and sends the tokens committed in it. It owns the engine alone, so nothing
else ever touches the scheduler's state between two steps; it blocks on the socket only when
no request is queued or running. A request with a grammar waits outside the engine until a
worker thread has compiled it (grammar_queue.py). The loop sends something at least every
HEARTBEAT_S, idle or not: the HTTP process's /health tells a wedged loop from an idle one.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass, field, replace

import zmq

from ..constraint import Constraint
from ..invariants import memory_report
from .grammar_queue import GrammarQueue
from .messages import AbortRequest, EngineInfo, GenerateRequest, GrammarSpec, Load, Shutdown, StepOutput, TokenDelta


IDLE_POLL_MS = 500  # while idle, how often the loop wakes (to check that the HTTP process exists, to send a heartbeat)
GRAMMAR_POLL_MS = 5  # while only compiles are pending: how soon a compiled grammar's requests start
HEARTBEAT_S = 1.0  # the longest the loop stays silent while it runs


@dataclass(frozen=True)
class SchedulerArgs:
    """What the process needs to build its engine and reach the HTTP process (picklable)."""

    model: str
    engine_kwargs: dict
    requests_addr: str  # it PULLs requests here
    outputs_addr: str  # it PUSHes StepOutputs here
    grammar_timeout_s: float  # a grammar not compiled by then refuses its requests
    grammar_workers: int  # grammars compiled at once, each on a thread


@dataclass
class Tracked:
    """The requests in the engine: HTTP id <-> LLM id, and how many tokens were sent."""

    llm_rid: dict[int, int] = field(default_factory=dict)
    http_rid: dict[int, int] = field(default_factory=dict)
    sent: dict[int, int] = field(default_factory=dict)  # by LLM id

    def add(self, http_rid: int, llm_rid: int) -> None:
        self.llm_rid[http_rid], self.http_rid[llm_rid], self.sent[llm_rid] = llm_rid, http_rid, 0

    def remove(self, llm_rid: int) -> int:
        http_rid = self.http_rid.pop(llm_rid)
        del self.llm_rid[http_rid], self.sent[llm_rid]
        return http_rid


def run_scheduler(args: SchedulerArgs) -> None:
    """Process entry point. Ctrl-C and SIGTERM go to the HTTP process, which shuts this one down in
    order (a signal to the whole process group must not kill the engine under its clients)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    ctx = zmq.Context()
    requests, outputs = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    requests.connect(args.requests_addr)
    outputs.connect(args.outputs_addr)
    try:
        from ..frontend.llm import LLM

        try:
            llm = LLM(args.model, **args.engine_kwargs)
        except (ValueError, TypeError, OSError) as exc:
            outputs.send_pyobj(EngineInfo(error=str(exc)))
            return
        with llm:
            config = llm.config
            outputs.send_pyobj(EngineInfo(llm.engine.model.vocab_size, config.max_seq_len, config.loop,
                                          str(llm.device), memory_report(llm.scheduler)["kv_total"],
                                          speculative=config.speculative_algorithm, eos_ids=tuple(sorted(llm.eos_ids))))
            SchedulerLoop(llm, requests, outputs, args.grammar_timeout_s, args.grammar_workers).run()
    finally:
        outputs.close(linger=1000)  # the last StepOutput still reaches the HTTP process
        requests.close(linger=0)
        ctx.term()


class SchedulerLoop:
    def __init__(self, llm, requests: zmq.Socket, outputs: zmq.Socket, grammar_timeout_s: float,
                 grammar_workers: int) -> None:
        self.llm = llm
        self.requests = requests
        self.outputs = outputs
        self.tracked = Tracked()
        self.shutdown: Shutdown | None = None
        self.grammars = GrammarQueue(self.compile, grammar_timeout_s, grammar_workers)
        self.compiler = None  # features/xgrammar_backend.py GrammarCompiler, once a request has a grammar
        self.compiler_made = threading.Lock()  # the first compiles, on several threads, make one compiler
        self.parent = os.getppid()
        self.last_load: Load | None = None
        self.last_sent = time.monotonic()

    def run(self) -> None:
        llm = self.llm
        while True:
            busy = llm.has_unfinished()
            if self.shutdown is not None and not busy and not self.grammars.waiting:
                llm.check_invariants()  # drained: every KV slot and row is back
                return
            deltas = self.stop_all() if os.getppid() != self.parent else []  # nobody is left to answer
            deltas += self.receive(0 if busy else GRAMMAR_POLL_MS if self.grammars.waiting else IDLE_POLL_MS)
            deltas += self.admit_compiled()
            try:
                finished = llm.step() if llm.has_unfinished() else []
            except Exception as exc:  # noqa: BLE001 - the engine refuses further work: tell every client
                lost = [TokenDelta(rid, [], error=f"the engine failed: {exc}")
                        for rid in [*self.tracked.llm_rid, *self.grammars.waiting]]
                self.outputs.send_pyobj(StepOutput(deltas + lost, self.load(), fatal=repr(exc)))
                raise
            deltas += self.new_tokens(finished)
            load = self.load()
            # The gauges in /metrics follow every change; silence longer than HEARTBEAT_S means wedged.
            if deltas or load != self.last_load or time.monotonic() - self.last_sent >= HEARTBEAT_S:
                self.outputs.send_pyobj(StepOutput(deltas, load))
                self.last_load, self.last_sent = load, time.monotonic()

    def receive(self, wait_ms: int) -> list[TokenDelta]:
        """Act on every message waiting (waiting up to wait_ms for the first one); the refusals."""
        refused: list[TokenDelta] = []
        if wait_ms and not self.requests.poll(wait_ms):
            return refused
        while True:
            try:
                msg = self.requests.recv_pyobj(zmq.NOBLOCK)
            except zmq.Again:
                return refused
            if isinstance(msg, GenerateRequest):
                if self.shutdown is not None:
                    refused.append(TokenDelta(msg.rid, [], error="the server is shutting down"))
                elif msg.grammar is not None:
                    self.grammars.add(msg)
                else:
                    refused += self.admit(msg, msg.params)
            elif isinstance(msg, AbortRequest):
                llm_rid = self.tracked.llm_rid.get(msg.rid)
                if llm_rid is not None:
                    self.llm.abort(llm_rid)
                else:  # its grammar is compiling, or it finished already (nothing to stop)
                    self.grammars.drop(msg.rid)
            elif isinstance(msg, Shutdown):
                if msg.drain:
                    self.shutdown = msg
                else:
                    refused += self.stop_all()

    def admit(self, msg: GenerateRequest, params) -> list[TokenDelta]:
        """The request into the engine; its refusal if the engine will not take it."""
        try:
            self.tracked.add(msg.rid, self.llm.add_request(msg.prompt_ids, params))
        except (ValueError, TypeError) as exc:  # e.g. check_fits: more than the KV pool holds
            return [TokenDelta(msg.rid, [], error=str(exc))]
        return []

    def admit_compiled(self) -> list[TokenDelta]:
        """The requests whose grammar is compiled into the engine; the refusals (it did not compile)."""
        refused = []
        for msg, grammar in self.grammars.ready():
            if isinstance(grammar, str):
                refused.append(TokenDelta(msg.rid, [], error=grammar))
            else:
                refused += self.admit(msg, replace(msg.params, grammar=grammar))
        return refused

    def stop_all(self) -> list[TokenDelta]:
        """Abort every request (each finishes "abort" at the next step; one waiting for its grammar
        at once: the deltas returned) and exit once they are out."""
        self.shutdown = Shutdown(drain=False)
        for llm_rid in self.tracked.http_rid:
            self.llm.abort(llm_rid)
        waiting = list(self.grammars.waiting)
        for rid in waiting:
            self.grammars.drop(rid)
        return [TokenDelta(rid, [], finish_reason="abort") for rid in waiting]

    def compile(self, spec: GrammarSpec) -> Constraint:
        """An xgrammar grammar for this model (the compiler, and xgrammar, load on first use). On
        the grammar queue's worker threads, several at once: xgrammar's compiler takes compiles
        from several threads."""
        with self.compiler_made:
            if self.compiler is None:
                from ..features.xgrammar_backend import GrammarCompiler

                llm = self.llm
                self.compiler = GrammarCompiler(llm.tokenizer, llm.engine.model.vocab_size, llm.eos_ids)
        return self.compiler.compile(spec.kind, spec.text)

    def new_tokens(self, finished) -> list[TokenDelta]:
        tracked = self.tracked
        deltas = []
        for llm_rid, (ids, logprobs) in self.llm.new_output(tracked.sent).items():
            tracked.sent[llm_rid] += len(ids)
            deltas.append(TokenDelta(tracked.http_rid[llm_rid], ids, logprobs))
        for out in finished:
            start = tracked.sent[out.rid]
            logprobs = out.logprobs[start:] if out.logprobs is not None else []
            deltas.append(TokenDelta(tracked.remove(out.rid), out.token_ids[start:], logprobs, out.finish_reason))
        return deltas

    def load(self) -> Load:
        s = self.llm.scheduler
        mem = memory_report(s)
        running = sum(not r.finished for r in s.running.reqs)  # a finished one leaves at the next schedule
        return Load(running + len(s.prefilling), len(s.waiting) + len(self.grammars.waiting),
                    mem["kv_total"] - mem["kv_free"] - mem["kv_cached"], mem["kv_total"])
