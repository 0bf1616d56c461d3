"""The judge's process starter: imports the heavy libraries once, then forks one fresh child per check.

    python minisgl/course/judge_zygote.py FD

Run by path (not as a module of the package: this process imports no minisgl at all, so no
teacher's code is in any child's memory) and started by judge.py, which sends it one datagram per
check on the socket FD: the check's copy, environment, tests and nonce as JSON, with the write
end of the check's report pipe attached. The zygote forks; the child starts a session of its
own, moves into the copy and runs judge_child there exactly as a fresh interpreter would, only
without paying for `import torch`, transformers and pytest again (seconds of CPU a check). The
zygote answers with the child's pid, and with its exit status once it is reaped.
"""

import ctypes
import json
import os
import select
import signal
import socket
import sys
import traceback

sys.path.pop(0)  # this file's folder (the teacher's package) is no place to import from
for library in ("torch", "numpy", "pytest", "_pytest.assertion.rewrite", "transformers", "safetensors", "rich",
                "triton"):
    try:
        __import__(library)
    except ImportError:  # optional here (triton on a CPU machine): the child imports what it needs
        pass


PR_SET_PDEATHSIG = 1
try:
    PRCTL = ctypes.CDLL(None, use_errno=True).prctl if sys.platform == "linux" else None
except (OSError, AttributeError):
    PRCTL = None


def child(request: dict, report_fd: int, control: socket.socket) -> None:
    """In the forked child: become the fresh process judge_child expects, then run it. (The
    zygote's limits on core files and file sizes are inherited; dying with it is not.) Never
    returns into the zygote's loop, whatever happens."""
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
        sys.path.insert(0, request["copy"])  # the copy's minisgl, as PYTHONPATH does for an interpreter
        sys.argv = ["judge_child", str(report_fd), *request["tests"]]
        from minisgl.course.judge_child import run  # the copy's (the student edition's) harness

        code = run(request["nonce"], report_fd, request["tests"])
    except BaseException:  # noqa: BLE001 - reported in the check's output; the judge sees a crash
        traceback.print_exc()
    finally:
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(code)


def main() -> None:
    control = socket.socket(fileno=int(sys.argv[1]))
    children: set[int] = set()
    while True:
        ready, _, _ = select.select([control], [], [], 0.05)
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            children.discard(pid)
            control.send(json.dumps({"exited": pid, "code": os.waitstatus_to_exitcode(status)}).encode())
        if not ready:
            continue
        message, fds, _, _ = socket.recv_fds(control, 1 << 20, 1)
        if not message:  # the judge closed its end: grading is over
            for pid in children:
                os.killpg(pid, signal.SIGKILL)
            return
        request = json.loads(message)
        pid = os.fork()
        if pid == 0:
            child(request, fds[0], control)
        os.close(fds[0])
        children.add(pid)
        control.send(json.dumps({"id": request["id"], "pid": pid}).encode())


if __name__ == "__main__":
    main()
