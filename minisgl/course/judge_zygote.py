"""The judge's process starter: imports the heavy libraries once, then forks one fresh child per check.

    python minisgl/course/judge_zygote.py FD

Run by path (not as a module of the package: this process imports no minisgl at all, so no
teacher's code is in any child's memory) and started by judge.py, which sends it one datagram per
check on the socket FD: the check's copy, environment, tests, nonce and memory limit as JSON, with
the write end of the check's report pipe attached. The zygote forks; the child starts a session of
its own, moves into the copy and runs judge_child there exactly as a fresh interpreter would, only
without paying for `import torch`, transformers and pytest again (seconds of CPU a check). The
zygote answers with the child's pid, and with its exit status and peak resident size once it is
reaped.

Defence in depth, where the OS offers it (Linux): the zygote is a child subreaper, so whatever a
check leaves behind (a daemon that left its session, its working folder and its environment) is
re-parented to the zygote and killed once no check runs; and each child confines itself with
Landlock before any submission code runs: it may write, create, remove or rename files only in
its copy (and a few devices, /dev/shm for multiprocessing's semaphores), may read only its copy,
the interpreter's folders and the system's (never the teacher's checkout, the other submissions
or the grades), may not signal or connect to processes outside its own checks' domain, and may
not open TCP connections. The zygote's first datagram tells the judge which
Landlock ABI the kernel offers (0: none, the checks run unconfined). This file is run from a copy
in the run's scratch folder: no path of the teacher's checkout is in any process's argv.
"""

import ctypes
import json
import os
import resource
import select
import signal
import socket
import sys
import time
import traceback

sys.path.pop(0)  # this file's folder (the teacher's package) is no place to import from
for library in ("torch", "numpy", "pytest", "_pytest.assertion.rewrite", "transformers", "safetensors", "rich",
                "triton"):
    try:
        __import__(library)
    except ImportError:  # optional here (triton on a CPU machine): the child imports what it needs
        pass


PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS, PR_SET_CHILD_SUBREAPER = 1, 38, 36
try:
    LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None
    PRCTL = LIBC.prctl if LIBC is not None else None
except (OSError, AttributeError):
    LIBC = PRCTL = None

# Landlock (linux/landlock.h); the syscall numbers are the same on x86_64 and arm64
SYS_CREATE_RULESET, SYS_ADD_RULE, SYS_RESTRICT_SELF = 444, 445, 446
WRITE_FILE, READ_FILE, READ_DIR = 1 << 1, 1 << 2, 1 << 3
MAKE_ALL, REFER, TRUNCATE = sum(1 << b for b in range(4, 13)), 1 << 13, 1 << 14
NET_TCP = (1 << 0) | (1 << 1)  # bind and connect
SCOPES = (1 << 0) | (1 << 1)  # abstract unix sockets and signals outside the domain
DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom", "/dev/tty")
# what a check may read besides its copy and the interpreter's own folders: the system's libraries,
# configuration, devices and /proc, /sys (CPU and GPU queries); never a folder above a hidden one
SYSTEM_READABLE = ("/usr", "/lib", "/lib32", "/lib64", "/libx32", "/bin", "/sbin", "/etc", "/opt", "/nix", "/proc",
                   "/sys", "/dev", "/run")


def readable_roots(hidden: tuple[str, ...] | list[str]) -> list[str]:
    """The folders a check may read outside its copy: the interpreter's (its prefixes and import
    path) and the system's, less any that holds a hidden folder (the teacher's checkout: a venv
    inside it stays readable, the checkout around it does not)."""
    hidden_dirs = [os.path.join(os.path.realpath(h), "") for h in hidden]
    found = []
    for path in (sys.prefix, sys.base_prefix, sys.exec_prefix, *sys.path, *SYSTEM_READABLE):
        real = os.path.join(os.path.realpath(path or "."), "")
        if os.path.isdir(real) and not any(h.startswith(real) for h in hidden_dirs) and real not in found:
            found.append(real)
    return found


def landlock_abi() -> int:
    """The Landlock ABI this kernel offers (0: none)."""
    if LIBC is None or os.uname().machine not in ("x86_64", "aarch64"):
        return 0
    abi = LIBC.syscall(SYS_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(1))
    return max(abi, 0)


def confine(abi: int, writable: str, readable: list[str]) -> None:
    """Let this process (and all it starts) write only under `writable` and to a few devices, read
    only there and under `readable`, and, as far as the ABI goes, neither use TCP nor signal or
    reach processes outside its domain. Raises OSError."""
    if abi <= 0:
        return

    class Ruleset(ctypes.Structure):
        _fields_ = [("fs", ctypes.c_uint64), ("net", ctypes.c_uint64), ("scoped", ctypes.c_uint64)]

    class PathBeneath(ctypes.Structure):
        _pack_ = 1
        _fields_ = [("allowed", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]

    handled = WRITE_FILE | READ_FILE | READ_DIR | MAKE_ALL | (REFER if abi >= 2 else 0) | (TRUNCATE if abi >= 3 else 0)
    ruleset = Ruleset(handled, NET_TCP if abi >= 4 else 0, SCOPES if abi >= 6 else 0)
    size = 8 if abi < 4 else 16 if abi < 6 else 24

    def check(result: int) -> int:
        if result < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"landlock: {os.strerror(err)}")
        return result

    fd = check(LIBC.syscall(SYS_CREATE_RULESET, ctypes.byref(ruleset), ctypes.c_size_t(size), ctypes.c_uint32(0)))
    try:
        file_rights = WRITE_FILE | READ_FILE | (TRUNCATE if abi >= 3 else 0)
        paths = [(writable, handled), ("/dev/shm", handled)]
        paths += [(folder, READ_FILE | READ_DIR) for folder in readable]
        paths += [(d, file_rights) for d in DEVICES]
        paths += [(os.path.join(folder, n), file_rights) for folder in ("/dev", "/dev/dri") if os.path.isdir(folder)
                  for n in sorted(os.listdir(folder)) if n.startswith(("nvidia", "card", "renderD"))]
        for path, rights in paths:
            try:
                target = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except OSError:
                continue  # a device this machine lacks
            try:
                if not os.path.isdir(path):
                    rights &= file_rights
                rule = PathBeneath(rights, target)
                check(LIBC.syscall(SYS_ADD_RULE, fd, ctypes.c_int(1), ctypes.byref(rule), ctypes.c_uint32(0)))
            finally:
                os.close(target)
        check(PRCTL(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0))
        check(LIBC.syscall(SYS_RESTRICT_SELF, fd, ctypes.c_uint32(0)))
    finally:
        os.close(fd)


def child(request: dict, report_fd: int, control: socket.socket) -> None:
    """In the forked child: become the fresh process judge_child expects, then run it. (The
    zygote's limits on core files and file sizes are inherited; dying with it is not; the limit
    on memory is the check's own.) Never returns into the zygote's loop, whatever happens."""
    code = 1
    try:
        control.close()
        os.setsid()
        if PRCTL is not None:
            PRCTL(PR_SET_PDEATHSIG, signal.SIGKILL)
        os.chdir(request["copy"])
        output = os.open(os.path.join(request["copy"], "home", "output.txt"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0), os.dup2(output, 1), os.dup2(output, 2)
        os.environ.clear()
        os.environ.update(request["env"])
        # the teacher's checkout: nothing of it on the import path (the interpreter's own folders kept)
        hidden = tuple(os.path.join(h, "") for h in request.get("hide", ()))
        own = tuple(os.path.join(os.path.realpath(p), "") for p in (sys.prefix, sys.base_prefix))
        sys.path[:] = [p for p in sys.path if os.path.join(os.path.realpath(p or "."), "").startswith(own)
                       or not os.path.join(os.path.realpath(p or "."), "").startswith(hidden)]
        sys.meta_path[:] = [f for f in sys.meta_path if "__editable__" not in getattr(f, "__module__", "")]
        sys.path_importer_cache.clear()
        sys.dont_write_bytecode = True
        sys.path.insert(0, request["copy"])  # the copy's minisgl, as PYTHONPATH does for an interpreter
        confine(request.get("landlock", 0), request["copy"], readable_roots(request.get("hide", ())))
        if request.get("memory"):  # before any code of the submission runs
            try:
                resource.setrlimit(resource.RLIMIT_DATA, (request["memory"], request["memory"]))
            except (OSError, ValueError):  # an OS that refuses it: the judge still sees the peak resident size
                pass
        sys.argv = ["judge_child", str(report_fd), *request["tests"]]
        from minisgl.course.judge_child import run  # the copy's (the student edition's) harness

        code = run(request["nonce"], report_fd, request["tests"])
    except BaseException:  # noqa: BLE001 - reported in the check's output; the judge sees a crash
        traceback.print_exc()
    finally:
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(code)


def kill_strays(children: set[int]) -> None:
    """Kill every process re-parented to this subreaper that is not a check it started: what a
    check left behind (Linux: /proc)."""
    me = str(os.getpid())
    try:
        entries = [e for e in os.listdir("/proc") if e.isdigit() and int(e) not in children]
    except OSError:
        return
    for entry in entries:
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = f.read().rsplit(")", 1)[1].split()[1]
            if parent == me:
                os.kill(int(entry), signal.SIGKILL)
        except (OSError, IndexError, ValueError):
            continue


def main() -> None:
    control = socket.socket(fileno=int(sys.argv[1]))
    subreaper = PRCTL is not None and PRCTL(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    abi = landlock_abi()
    control.send(json.dumps({"landlock": abi, "subreaper": subreaper}).encode())
    children: set[int] = set()
    swept = time.monotonic()
    while True:
        ready, _, _ = select.select([control], [], [], 0.05)
        while True:
            try:
                pid, status, usage = os.wait4(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            if pid in children:  # a check ended; a stray re-parented here is not reported
                children.discard(pid)
                if subreaper:  # what it left behind goes with it (before the judge hears it ended)
                    kill_strays(children)
                peak_rss = usage.ru_maxrss * (1 if sys.platform == "darwin" else 1024)  # bytes there, KiB here
                control.send(json.dumps({"exited": pid, "code": os.waitstatus_to_exitcode(status),
                                         "peak_rss": peak_rss}).encode())
        if subreaper and not children and time.monotonic() > swept + 1:
            kill_strays(children)
            swept = time.monotonic()
        if not ready:
            continue
        message, fds, _, _ = socket.recv_fds(control, 1 << 20, 1)
        if not message:  # the judge closed its end: grading is over
            for pid in children:
                os.killpg(pid, signal.SIGKILL)
            return
        request = json.loads(message)
        request["landlock"] = abi if request.get("confine", True) else 0  # off only where a test asks
        pid = os.fork()
        if pid == 0:
            child(request, fds[0], control)
        os.close(fds[0])
        children.add(pid)
        control.send(json.dumps({"id": request["id"], "pid": pid}).encode())


if __name__ == "__main__":
    main()
