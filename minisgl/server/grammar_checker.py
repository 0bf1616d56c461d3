"""Grammar checks in child processes, which can be stopped (the HTTP process's side of grammars).

Before a generation with a grammar goes to the engine, the HTTP process parses its grammar
(xgrammar, without the tokenizer), so that a bad one is a 400 naming its parameter. Most parse
at once, but some within every size limit parse for longer than any client waits. A thread cannot
be stopped: a check past its time limit would run on, burning a core, and every check behind it
would wait. A process can be killed. So each check runs in a child process, at most `workers` at
once (`--grammar-workers`); a check past `--grammar-timeout`, or whose client left, has its child
killed, and the next check that finds no idle child starts a new one. A slow grammar holds up
another's check only while every child is busy, and never past the time limit.

Children start on demand: the first grammar starts the first child, and another starts only
when a check finds every started one busy. A child imports xgrammar, which imports torch: slow,
and a good share of memory, that a server which never sees a grammar should not pay. The wait
for a new child to be ready does not count against its check's time limit; only the parse does.
Children are spawned, a fresh interpreter each (the only way on Windows): a fork of this process
would copy its event loop and its threads' locks in whatever state they are. A child ignores
Ctrl-C (the HTTP process ends it) and exits once the HTTP process is gone, even mid-parse.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import threading
from collections import deque
from multiprocessing.connection import Connection
from multiprocessing.context import SpawnContext
from typing import Any, Callable

from .messages import GrammarSpec
from .worker_threads import WorkerThreads


class Checker:
    """One child process and this process's end of its pipe. Its calls block: on a worker thread."""

    def __init__(self, context: SpawnContext) -> None:
        self.pipe, child_end = context.Pipe()
        self.process = context.Process(target=serve, args=(child_end,), name="minisgl-grammar-check", daemon=True)
        self.process.start()
        child_end.close()  # the child holds the only other end: its exit is this end's EOF
        self.ready = False  # it has said it is (once xgrammar is imported)

    def wait_ready(self) -> None:
        """Returns once the child has imported xgrammar (its first message)."""
        self._receive()

    def parse(self, spec: GrammarSpec) -> str | None:
        """Why the grammar does not parse (None: it does)."""
        self.pipe.send(spec)
        return self._receive()

    def _receive(self) -> Any:
        try:
            return self.pipe.recv()
        except EOFError:  # killed (past its time limit, or from outside): reaped here, off the loop
            self.process.join()
            raise


class CheckerClosed(Exception):
    """The server is shutting down: a check not done by then is not made."""


class GrammarChecker:
    """The HTTP process's grammar checks, each in one of at most `workers` child processes."""

    def __init__(self, workers: int) -> None:
        self.closed = False  # the drain began: checks waiting or running are refused, no child starts
        self.context = multiprocessing.get_context("spawn")
        self.turns = asyncio.Semaphore(workers)  # checks at once
        self.idle: deque[Checker] = deque()
        self.children: set[Checker] = set()  # idle or checking
        self.threads = WorkerThreads("minisgl-http-grammar", workers)  # each waits on one child's pipe

    async def check(self, spec: GrammarSpec, timeout_s: float) -> None:
        """Parse the grammar in a child: a ValueError says why it does not parse, asyncio.TimeoutError
        that the parse ran past timeout_s, EOFError that the child died, CheckerClosed that the
        server began to shut down first. Then, or when cancelled (its client left), the child is killed."""
        async with self.turns:
            if self.closed:  # else a check waiting for its turn would start a child during the drain
                raise CheckerClosed()
            child = self._idle_child()
            try:
                if not child.ready:
                    await self._on_thread(child.wait_ready)
                    child.ready = True
                error = await asyncio.wait_for(self._on_thread(child.parse, spec), timeout_s)
            except BaseException:  # past the time limit, cancelled, or the child died
                child.process.kill()
                self.children.discard(child)
                if self.closed:  # killed by close(): the drain, not the grammar, ended it
                    raise CheckerClosed() from None
                raise
            self.idle.append(child)
        if error is not None:
            raise ValueError(error)

    def close(self) -> None:
        """Kill every child (the server is shutting down): the checks running and waiting end with
        CheckerClosed, and later ones at once."""
        self.closed = True
        for child in self.children:
            child.process.kill()
        for child in self.children:
            child.process.join()
        self.children.clear()

    def _idle_child(self) -> Checker:
        """An idle child, or a new one. One killed from outside while idle is dropped."""
        while self.idle:
            child = self.idle.popleft()
            if child.process.is_alive():
                return child
            self.children.discard(child)
        child = Checker(self.context)
        self.children.add(child)
        return child

    def _on_thread(self, fn: Callable[..., Any], *args: Any) -> asyncio.Future:
        return asyncio.wrap_future(self.threads.submit(fn, *args))


def serve(pipe: Connection) -> None:
    """A child's entry point: say it is ready, then answer each grammar sent with why it does not
    parse (None: it does), until the HTTP process closes its end."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group
    threading.Thread(target=exit_with_parent, daemon=True).start()
    from ..features.xgrammar_backend import check_grammar

    pipe.send(None)
    while True:
        try:
            spec: GrammarSpec = pipe.recv()
        except EOFError:
            return
        try:
            check_grammar(spec.kind, spec.text)
        except ValueError as exc:
            pipe.send(str(exc))
        else:
            pipe.send(None)


def exit_with_parent() -> None:
    """Ends the child when the HTTP process exits, even in the middle of a parse: a killed HTTP
    process (or one that left at once on a second Ctrl-C) closes nothing in order."""
    multiprocessing.parent_process().join()
    os._exit(0)
