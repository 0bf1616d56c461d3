"""Generations waiting for their grammar, compiled off the scheduler's loop (SGLang's grammar queue).

Compiling a grammar can take seconds, and longer than its size suggests; on the loop it would
stop every running request for that long. So the scheduler process compiles on a few worker
threads (xgrammar releases the GIL while it compiles), and a generation with a grammar waits here
until its grammar is ready, then enters the engine. The compile happens in this process because a
compiled grammar does not leave it cheaply: xgrammar's serialized form is many times its memory
and took longer to read back than to compile (benchmarks/history/, "Figures that were in code
comments").

A compile past the time limit refuses its generations, but a thread cannot be stopped: the
compile runs to its end on its thread, and its grammar is dropped. Meanwhile the other threads
compile the next grammars; once every thread holds such a compile, the next grammars wait (their
time limit counting from their arrival). A waiting generation that is aborted (its client went
away) leaves at once, and takes its compile along if that has not started and no other generation
waits for it."""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable

from ..constraint import Constraint
from .messages import GenerateRequest, GrammarSpec
from .worker_threads import WorkerThreads

DEFAULT_TIMEOUT_S = 30.0  # serve --grammar-timeout
DEFAULT_WORKERS = 2  # serve --grammar-workers


@dataclass
class Compile:
    """One grammar's compile, shared by the generations that wait for it."""

    spec: GrammarSpec
    future: Future  # of the Constraint
    waiters: int = 0


@dataclass
class Waiting:
    request: GenerateRequest
    compile: Compile
    deadline: float  # time.monotonic()


class GrammarQueue:
    def __init__(self, compile: Callable[[GrammarSpec], Constraint], timeout_s: float, workers: int) -> None:
        self.compile = compile  # runs on the worker threads, up to `workers` grammars at once
        self.timeout_s = timeout_s
        self.workers = WorkerThreads("minisgl-grammar", workers)
        self.compiling: dict[GrammarSpec, Compile] = {}  # while a generation waits for it
        self.waiting: dict[int, Waiting] = {}  # by the HTTP process's request id

    def add(self, request: GenerateRequest) -> None:
        spec = request.grammar
        assert spec is not None
        compile = self.compiling.get(spec)
        if compile is None:
            compile = self.compiling[spec] = Compile(spec, self.workers.submit(self.compile, spec))
        compile.waiters += 1
        self.waiting[request.rid] = Waiting(request, compile, time.monotonic() + self.timeout_s)

    def drop(self, rid: int) -> bool:
        """Take a waiting generation out (aborted); False if it was not waiting."""
        waiting = self.waiting.pop(rid, None)
        if waiting is not None:
            self._release(waiting)
        return waiting is not None

    def ready(self) -> list[tuple[GenerateRequest, Constraint | str]]:
        """The generations done waiting, each with its grammar or why it has none (its compile
        failed, or ran past the time limit)."""
        now = time.monotonic()
        done = []
        for rid, waiting in list(self.waiting.items()):
            compiled = waiting.compile.future
            if compiled.done():
                error = compiled.exception()
                done.append((waiting.request, compiled.result() if error is None else str(error)))
            elif now > waiting.deadline:
                done.append((waiting.request, f"the grammar did not compile within {self.timeout_s:g} s"))
            else:
                continue
            del self.waiting[rid]
            self._release(waiting)
        return done

    def _release(self, gone: Waiting) -> None:
        """A compile no generation waits for any more is forgotten (cancelled, if not started)."""
        compile = gone.compile
        compile.waiters -= 1
        if compile.waiters == 0:
            compile.future.cancel()
            del self.compiling[compile.spec]
