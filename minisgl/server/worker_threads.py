"""Worker threads for the work that must not run on a loop (the HTTP process's event loop, the
scheduler's loop): compiling grammars, tokenizing a long prompt, waiting on a grammar checker.

Like a ThreadPoolExecutor, with one difference: the threads are daemons, so they never hold up
the process's exit. A grammar compile cannot be interrupted and can run for a minute; an
executor's threads would be joined at exit, and the exit would wait for them."""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable


class WorkerThreads:
    def __init__(self, name: str, count: int = 1) -> None:
        self.calls: queue.SimpleQueue[tuple[Future, Callable[..., Any], tuple]] = queue.SimpleQueue()
        for _ in range(count):
            threading.Thread(target=self._run, name=name, daemon=True).start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        """Run fn(*args) on the first free thread, after the calls submitted before have started;
        a call cancelled before it starts never runs."""
        future: Future = Future()
        self.calls.put((future, fn, args))
        return future

    def _run(self) -> None:
        while True:
            future, fn, args = self.calls.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - the caller gets it from the future
                future.set_exception(exc)
