"""The processes of a grading run: how a check's child is started, limited and killed, and the
watch on the teacher's checkout (judge_verdict.py decides the verdicts).

- ProcessStarter talks to the zygote (judge_zygote.py), which forks each check's child in a
  session of its own, from a copy of itself in the run's scratch, with no path of the teacher's
  checkout in its argv, PATH or import path.
- kill_run_processes finds and kills whatever a check left running: its session, any process
  working in its copy or carrying the run's token in its environment.
- CheckoutWatch lists the teacher's checkout before and after each check.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import NamedTuple

RUN_ENV = "MINISGL_GRADE_RUN"  # set in every child: the grader finds (and kills) what a check left running
PASSED_ENV = ("PATH", "LANG", "LC_ALL", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "CUDA_VISIBLE_DEVICES", "SYSTEMROOT")


def kill_session(pid: int) -> None:
    if os.name == "posix":
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def kill_run_processes(token: str, folder: Path) -> int:
    """Kill every process of a check (or a run) that left its session: one working in `folder`
    (a forked child keeps its parent's working folder), or one whose environment carries a token
    that starts with `token` (a program started from a check gets the check's environment).
    Linux only (/proc). Returns how many were killed."""
    killed, needle, inside = 0, f"{RUN_ENV}={token}".encode(), str(folder)
    proc = Path("/proc")
    if not proc.is_dir():
        return 0
    for entry in proc.iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cwd = os.readlink(entry / "cwd")
            if (cwd == inside or cwd.startswith(inside + os.sep)
                    or any(var.startswith(needle) for var in (entry / "environ").read_bytes().split(b"\0"))):
                os.kill(int(entry.name), signal.SIGKILL)
                killed += 1
        except (OSError, ValueError):
            continue
    return killed


try:
    import resource
except ImportError:  # Windows: no rlimits, no sessions; a check is still killed past its limit
    resource = None
try:  # looked up here: between fork and exec the child may only call it
    _PRCTL = ctypes.CDLL(None, use_errno=True).prctl if sys.platform == "linux" else None
except (OSError, AttributeError):
    _PRCTL = None
PR_SET_PDEATHSIG = 1


def _child_limits() -> None:
    """In the child before exec: killed when the grader's thread that started it ends (a grader
    killed with SIGKILL takes its checks along); no core files; no file over 1 GiB."""
    if _PRCTL is not None:
        _PRCTL(PR_SET_PDEATHSIG, signal.SIGKILL)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 30, 1 << 30))


ZYGOTE = Path(__file__).resolve().with_name("judge_zygote.py")


def _interpreter() -> str:
    """This interpreter, named through its virtual environment's real folder where there is one
    (a venv is often a link into, or a folder of, the teacher's checkout)."""
    if sys.prefix != sys.base_prefix:
        real = Path(os.path.realpath(sys.prefix)) / "bin" / Path(sys.executable).name
        if real.exists():
            return str(real)
    return sys.executable


def path_without(hidden: list[str]) -> dict[str, str]:
    """PATH without the folders of the teacher's checkout (an activated venv inside it, say)."""
    if "PATH" not in os.environ:
        return {}
    def inside(p: str) -> bool:
        return any((q + os.sep).startswith(h + os.sep) for q in (os.path.abspath(p), os.path.realpath(p))
                   for h in hidden)

    kept = [p for p in os.environ["PATH"].split(os.pathsep) if not inside(p)]
    return {"PATH": os.pathsep.join(kept)}


class CheckoutWatch:
    """The teacher's checkout, listed (path -> mtime, size) before and after each check: a file
    that appeared, changed or vanished there while a check ran means the check wrote outside its
    copy, or ran beside one that did (grade with --jobs 1 to tell which). Byte-code caches,
    git's object store and a virtual environment are left out; its hooks and config are not."""

    SKIPPED = frozenset({"__pycache__", ".git", ".venv", "venv", ".pytest_cache", ".mypy_cache", ".ruff_cache"})

    def __init__(self, root: Path, skip: list[Path]):
        self.root = root
        self.skip = {os.path.realpath(p) for p in skip}

    def listing(self) -> dict[str, tuple[int, int]]:
        found: dict[str, tuple[int, int]] = {}
        extra = [self.root / ".git" / "config", *sorted((self.root / ".git" / "hooks").glob("*"))]
        for folder, dirs, files in os.walk(self.root):
            dirs[:] = [d for d in dirs if d not in self.SKIPPED
                       and os.path.realpath(os.path.join(folder, d)) not in self.skip]
            for name in files + [d for d in dirs if os.path.islink(os.path.join(folder, d))]:
                self._add(found, os.path.join(folder, name))
        for path in extra:
            self._add(found, str(path))
        return found

    @staticmethod
    def _add(found: dict[str, tuple[int, int]], path: str) -> None:
        try:
            st = os.lstat(path)
        except OSError:
            return
        found[path] = (st.st_mtime_ns, st.st_size)

    @staticmethod
    def changed(before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]]) -> list[str]:
        return sorted(p for p in before.keys() | after.keys() if before.get(p) != after.get(p))


class Exit(NamedTuple):
    code: int  # the exit code (negative: the signal that ended it)
    peak_rss: int  # the largest resident size it reached, in bytes


class ProcessStarter:
    """The judge's side of judge_zygote.py: a process that imported torch, transformers and pytest
    once, and forks each check's fresh process from there."""

    def __init__(self, scratch: Path, hidden: list[str] = ()) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.hidden = sorted({f(h) for h in hidden for f in (os.path.abspath, os.path.realpath)})
        env = {k: os.environ[k] for k in PASSED_ENV if k in os.environ}
        env.update(path_without(self.hidden), OPENBLAS_NUM_THREADS="1", PYTHONHASHSEED="0")  # no BLAS thread
        zygote = scratch / ZYGOTE.name  # run from the scratch: no path of the teacher's checkout in any argv
        shutil.copyfile(ZYGOTE, zygote)
        with open(scratch / "zygote.log", "wb") as log:
            self.process = subprocess.Popen([_interpreter(), zygote.name, str(theirs.fileno())], cwd=scratch, env=env,
                                            pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, stdout=log,
                                            stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_child_limits)
        theirs.close()
        self.sock, self.cond = ours, threading.Condition()
        self.pids: dict[int, int] = {}  # request -> the pid of its process
        self.exits: dict[int, Exit] = {}  # pid -> how it ended
        self.requests, self.dead = 0, False
        self.confinement: dict | None = None  # the zygote's first word: Landlock's ABI, a subreaper or not
        threading.Thread(target=self._listen, daemon=True).start()

    def _listen(self) -> None:
        self.sock.settimeout(0.5)  # a datagram socket sees no end when its peer dies: look at the process
        while True:
            try:
                message = json.loads(self.sock.recv(1 << 16))
            except socket.timeout:
                if self.process.poll() is None:
                    continue
                message = None
            except (OSError, ValueError):
                message = None
            with self.cond:
                if message is None:
                    self.dead = True
                elif "landlock" in message:
                    self.confinement = message
                elif "pid" in message:
                    self.pids[message["id"]] = message["pid"]
                else:
                    self.exits[message["exited"]] = Exit(message["code"], message["peak_rss"])
                self.cond.notify_all()
            if message is None:
                return

    def start(self, copy: Path, env: dict[str, str], tests: list[str], nonce: str, report_fd: int,
              confine: bool = True, memory: int = 0) -> int:
        """Start a check's process in `copy`; its pid (the id of its session too). `confine`:
        behind Landlock where the kernel has it (off only in a test of what the judge sees without).
        `memory`: the bytes of data it may hold (RLIMIT_DATA; 0: no limit)."""
        with self.cond:
            self.requests += 1
            request = self.requests
        socket.send_fds(self.sock, [json.dumps({"id": request, "copy": str(copy), "env": env, "tests": tests,
                                                "nonce": nonce, "hide": self.hidden, "confine": confine,
                                                "memory": memory}).encode()],
                        [report_fd])
        with self.cond:
            self.cond.wait_for(lambda: request in self.pids or self.dead, timeout=120)
            if request not in self.pids:
                raise RuntimeError("the judge's process starter is gone: no mark can be given")
            return self.pids.pop(request)

    def wait(self, pid: int, timeout: float) -> Exit | None:
        """How `pid` ended, or None if it is still running after `timeout` seconds."""
        with self.cond:
            self.cond.wait_for(lambda: pid in self.exits or self.dead, timeout=timeout)
            return self.exits.pop(pid, None)

    def close(self) -> None:
        """Stop the starter (and whatever it started that is still in its session); any wait ends."""
        kill_session(self.process.pid)
        self.process.wait()
        with self.cond:
            self.dead = True
            self.cond.notify_all()
