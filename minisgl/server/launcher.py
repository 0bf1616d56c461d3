"""A `python -m minisgl serve` child process on a free port, for the tests and the HTTP bench."""

from __future__ import annotations

import http.client
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 300.0  # a loaded 2-core machine: two interpreters import torch
STOP_TIMEOUT_S = 60.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def is_healthy(port: int) -> bool:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
    try:
        conn.request("GET", "/health")
        return conn.getresponse().status == 200
    except OSError:
        return False
    finally:
        conn.close()


@contextmanager
def running_server(*flags: str, env: dict[str, str] | None = None,
                   log: Path | None = None) -> Iterator[tuple[str, subprocess.Popen]]:
    """Start the server, wait until /health answers; yields (base URL, process). Ctrl-C afterwards.
    Its stdout and stderr go to `log` (a temporary file when None)."""
    port = free_port()
    child_env = {**os.environ, **(env or {})}
    child_env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), child_env.get("PYTHONPATH")) if p)
    # A file, not a pipe: nobody reads a pipe while the server runs, and once its 64 KiB are full
    # the server's next log line blocks its event loop (no connection is accepted any more).
    with tempfile.TemporaryDirectory(prefix="minisgl-serve-log-") as tmp:
        log = log or Path(tmp) / "server.log"
        with open(log, "w") as out:
            proc = subprocess.Popen([sys.executable, "-m", "minisgl", "serve", "--port", str(port), *flags],
                                    cwd=ROOT, env=child_env, stdout=out, stderr=subprocess.STDOUT, text=True)
        try:
            deadline = time.monotonic() + START_TIMEOUT_S
            while not is_healthy(port):
                if proc.poll() is not None:
                    raise RuntimeError(f"the server exited with {proc.returncode}: {log.read_text()}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the server did not answer /health within {START_TIMEOUT_S:g} s")
                time.sleep(0.2)
            yield f"http://127.0.0.1:{port}", proc
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(timeout=STOP_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def scheduler_pid(proc: subprocess.Popen) -> int:
    """The server's scheduler process: the first process it spawned (its grammar checkers come
    later, and the resource tracker is not spawned; Linux /proc, children in the order they started)."""
    children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
    return next(int(pid) for pid in children if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes())


def rss_mb(pid: int) -> float:
    """A process's resident memory (Linux /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise KeyError(f"no VmRSS for process {pid}")
