"""Graceful shutdown: SIGTERM drains the requests in flight (or aborts them after --drain-timeout,
telling their clients), the scheduler process checks its pools and exits, and the exit code says
which; a second signal exits at once."""

from __future__ import annotations

import http.client
import json
import os
import signal
import threading
import time
from urllib.parse import urlsplit

import pytest

from minisgl.server import launcher
from minisgl.server.launcher import scheduler_pid

pytestmark = pytest.mark.full  # a server start per case
EXIT_WAIT_S = 120.0


def start_stream(url: str, max_tokens: int) -> tuple[threading.Thread, list, list]:
    """A streaming request in a thread; its events land in the first list, once it has started
    (the first event is in) a True in the second."""
    events: list[str] = []
    started: list[bool] = []

    def run() -> None:
        conn = http.client.HTTPConnection(urlsplit(url).netloc, timeout=EXIT_WAIT_S)
        conn.request("POST", "/v1/completions", json.dumps({
            "model": "demo", "prompt": "count 1 to 5:", "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}))
        response = conn.getresponse()
        for line in response:
            if line.startswith(b"data: "):
                events.append(line[6:].decode().strip())
                started.append(True)

    thread = threading.Thread(target=run)
    thread.start()
    while not started:
        time.sleep(0.01)
    return thread, events, started


def finish_reasons(events: list[str]) -> list[str]:
    return [c["finish_reason"] for e in events if e != "[DONE]" for c in json.loads(e)["choices"] if c["finish_reason"]]


@pytest.mark.parametrize("flags, signals, code, reason", [
    pytest.param((), (signal.SIGTERM,), 0, "length", id="sigterm-drains"),
    pytest.param(("--drain-timeout", "0.5"), (signal.SIGTERM,), 3, "abort", id="drain-times-out"),
    pytest.param((), (signal.SIGTERM, signal.SIGTERM), 128 + signal.SIGTERM, "abort", id="second-sigterm"),
    pytest.param((), (signal.SIGTERM, signal.SIGINT), 128 + signal.SIGINT, "abort", id="then-ctrl-c"),
])
def test_shutdown(flags, signals, code, reason, tmp_path):
    log = tmp_path / "server.log"
    with launcher.running_server("--kv-tokens", "4096", *flags, log=log) as (url, proc):
        scheduler = scheduler_pid(proc)
        assert f"HTTP process pid {proc.pid}, scheduler process pid {scheduler}" in log.read_text()  # for ps
        thread, events, _ = start_stream(url, 400)
        for sig in signals:
            proc.send_signal(sig)
            time.sleep(0.2)
        assert not launcher.is_healthy(urlsplit(url).port)  # draining: no new connection is taken
        assert proc.wait(EXIT_WAIT_S) == code, log.read_text()
        # the drain says what it is doing (a quiet wait of up to --drain-timeout looked like a hang)
        assert f"minisgl serve: {signals[0].name}: finishing the requests in flight" in log.read_text()
        timed_out = "minisgl serve: the drain timed out after 0.5 s: aborting 1 generations in flight (exit code 3)"
        assert (timed_out in log.read_text().splitlines()) == (code == 3), log.read_text()
        thread.join(EXIT_WAIT_S)
        assert finish_reasons(events) == [reason] and events[-1] == "[DONE]"  # the client was told
        with pytest.raises(ProcessLookupError):  # the scheduler process is gone (its engine freed)
            os.kill(scheduler, 0)


def test_the_server_exits_with_1_when_its_scheduler_process_dies(tmp_path):
    """It used to answer 503 to everything, forever, with its gauges frozen: a supervisor never
    learned to restart it. Now the clients in flight are told, then it exits."""
    log = tmp_path / "server.log"
    with launcher.running_server("--kv-tokens", "4096", log=log) as (url, proc):
        thread, events, _ = start_stream(url, 400)
        os.kill(scheduler_pid(proc), signal.SIGKILL)
        assert proc.wait(EXIT_WAIT_S) == 1, log.read_text()
        thread.join(EXIT_WAIT_S)
        error = json.loads(events[-2])["error"]
        assert error["message"].startswith("the scheduler process exited") and events[-1] == "[DONE]"
    assert "minisgl serve: exiting: the scheduler process exited (exit code -9)" in log.read_text().splitlines()
