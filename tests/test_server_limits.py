"""The server against clients that would hold it up: a grammar that parses or compiles for long, a
client that stops reading its stream, a client that never finishes its request or opens too many
connections, and a scheduler whose loop stops. One server with short limits."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import jsonschema
import pytest

from minisgl.server import launcher
from minisgl.server.launcher import scheduler_pid

from .server_process import PET_SCHEMA, metric, post_json, request

pytestmark = pytest.mark.full  # a server of its own, and waits of seconds

WRITE_TIMEOUT_S = 10.0
GRAMMAR_TIMEOUT_S = 1.0
HEARTBEAT_TIMEOUT_S = 2.0
MAX_INFLIGHT = 64
REQUEST_TIMEOUT_S = 2.0
MAX_CONNECTIONS = 32
# A pattern xgrammar parses at once and compiles for seconds (7 s on the 2-core machine): the
# scheduler's loop used to stop for all of it.
SLOW_PATTERN = "[a-z]{0,60}{0,60}"
# One it takes long to parse, before any compile (benchmarks/history/, "Grammar checks in child
# processes"): its check holds a child process of the HTTP process until the time limit.
SLOW_TO_PARSE = "[a-z]{0,30000}"


@pytest.fixture(scope="module")
def server_log(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("serve") / "server.log"


@pytest.fixture(scope="module")
def server(server_log):
    flags = ("--kv-tokens", "16384", "--max-inflight", str(MAX_INFLIGHT), "--write-timeout", str(WRITE_TIMEOUT_S),
             "--grammar-timeout", str(GRAMMAR_TIMEOUT_S), "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT_S),
             "--request-timeout", str(REQUEST_TIMEOUT_S), "--max-connections", str(MAX_CONNECTIONS))
    with launcher.running_server(*flags, log=server_log) as (url, proc):
        yield url, proc


def plain(url: str) -> tuple[int, float]:
    start = time.monotonic()
    status, _ = post_json(url, "/v1/completions", {"model": "demo", "prompt": "count 3 to 9:", "max_tokens": 8,
                                                   "temperature": 0})
    return status, time.monotonic() - start


def test_a_grammar_that_compiles_for_long_is_refused_and_holds_up_nobody(server):
    url, _ = server
    answer: list = []
    body = {"model": "demo", "prompt": "hi", "max_tokens": 8, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": SLOW_PATTERN}}}}
    slow = threading.Thread(target=lambda: answer.append(post_json(url, "/v1/completions", body)))
    slow.start()
    time.sleep(0.3)
    for _ in range(3):  # while it compiles, the other requests run
        status, seconds = plain(url)
        assert status == 200 and seconds < GRAMMAR_TIMEOUT_S + 1.0, seconds
        assert request(url, "GET", "/health")[0] == 200
    slow.join(30)
    [(status, error)] = answer
    assert status == 500 and error["error"]["message"] == f"the grammar did not compile within {GRAMMAR_TIMEOUT_S:g} s"


def with_schema(schema: dict) -> dict:
    """A chat request whose answer follows the schema."""
    return {"model": "demo", "messages": [{"role": "user", "content": "add 12 5:"}], "max_tokens": 64,
            "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}


def grammar_checkers(proc: subprocess.Popen) -> set[int]:
    """The HTTP process's grammar checkers: the processes it spawned but the scheduler (Linux /proc)."""
    children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
    spawned = {int(pid) for pid in children if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()}
    return spawned - {scheduler_pid(proc)}


def test_a_grammar_that_parses_for_long_is_refused_at_the_limit_and_holds_up_no_other(server):
    """Its check runs in a child process, killed at --grammar-timeout; the next grammar is checked
    in another child meanwhile. One thread used to check every grammar: the slow one held it for
    all of its parse, and the grammars behind it were refused."""
    url, proc = server
    assert post_json(url, "/v1/chat/completions", with_schema(PET_SCHEMA))[0] == 200  # a child ready, idle
    checkers = grammar_checkers(proc)
    answer: list = []
    start = time.monotonic()
    slow = threading.Thread(target=lambda: answer.append(
        (post_json(url, "/v1/chat/completions", with_schema({"type": "string", "pattern": SLOW_TO_PARSE})),
         time.monotonic() - start)))
    slow.start()
    time.sleep(0.3)
    status, out = post_json(url, "/v1/chat/completions", with_schema(PET_SCHEMA))  # in another child
    assert status == 200
    jsonschema.validate(json.loads(out["choices"][0]["message"]["content"]), PET_SCHEMA)
    assert time.monotonic() - start < 20.0  # the slow one's parse alone runs longer, had it not been stopped
    slow.join(30)
    [((status, error), seconds)] = answer
    assert status == 400 and error["error"]["param"] == "response_format", error
    assert error["error"]["message"] == (f"the json_schema was not checked within {GRAMMAR_TIMEOUT_S:g} s "
                                         "(the server's --grammar-timeout)")
    assert seconds < GRAMMAR_TIMEOUT_S + 2.0
    deadline = time.monotonic() + 10
    while all(Path(f"/proc/{pid}").exists() for pid in checkers):
        assert time.monotonic() < deadline, "the slow grammar's checker was not killed"
        time.sleep(0.05)
    assert sum(Path(f"/proc/{pid}").exists() for pid in checkers) == len(checkers) - 1  # that one only


def stalled_stream(url: str, n: int, max_tokens: int) -> socket.socket:
    """A streaming request whose client reads nothing (a small receive buffer, never read)."""
    host, port = urlsplit(url).hostname, urlsplit(url).port
    payload = json.dumps({"model": "demo", "prompt": "count 3 to 9:", "max_tokens": max_tokens, "n": n,
                          "logprobs": 20, "temperature": 0, "ignore_eos": True, "stream": True}).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, port))
    sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    return sock


def engine_idle(url: str) -> bool:
    return not any(metric(url, m) for m in ("minisgl:num_running_reqs", "minisgl:num_queue_reqs",
                                            "minisgl:token_usage"))


def test_a_client_that_stops_reading_holds_no_place_and_is_dropped(server, server_log):
    """Its generations leave --max-inflight when the engine finishes them (they used to stay until
    the client read them: every new request got 503 meanwhile), and after --write-timeout of
    reading nothing its stream ends: what it reads then stops short of [DONE]."""
    url, _ = server
    sock = stalled_stream(url, n=MAX_INFLIGHT, max_tokens=120)  # 64 x 120 tokens, 20 logprobs each: megabytes
    try:
        deadline = time.monotonic() + 30  # on a loaded machine the stalled request may take a while to be admitted
        while (status := post_json(url, "/v1/completions", {"model": "demo", "prompt": "hi"})[0]) != 503:
            assert status == 200 and time.monotonic() < deadline, f"all 64 places should be held: got {status}"
            time.sleep(0.2)
        deadline = time.monotonic() + 60
        while not engine_idle(url):
            assert time.monotonic() < deadline, "the stalled request's generations never finished"
            time.sleep(0.1)
        assert "read nothing" not in server_log.read_text()  # still stalled, not dropped yet
        assert plain(url)[0] == 200
        time.sleep(WRITE_TIMEOUT_S + 2.0)
        assert "read nothing for" in server_log.read_text()
        sock.settimeout(30)
        received = b""
        while chunk := sock.recv(1 << 20):  # what the server had written before; then its close
            received += chunk
        assert received.startswith(b"HTTP/1.1 200") and b"data: [DONE]" not in received
    finally:
        sock.close()


def test_health_says_503_while_the_scheduler_loop_is_stuck(server):
    """The scheduler sends every second; stopped (SIGSTOP, as a wedged engine), it goes silent."""
    url, proc = server
    scheduler = scheduler_pid(proc)
    os.kill(scheduler, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + HEARTBEAT_TIMEOUT_S + 10
        while (answer := request(url, "GET", "/health"))[0] == 200:
            assert time.monotonic() < deadline, "/health said ok all along"
            time.sleep(0.2)
        assert answer[0] == 503 and b"the scheduler has sent nothing for" in answer[1]
    finally:
        os.kill(scheduler, signal.SIGCONT)
    deadline = time.monotonic() + 10
    while request(url, "GET", "/health")[0] != 200:
        assert time.monotonic() < deadline, "/health did not recover"
        time.sleep(0.2)


def closed_by_server(sock: socket.socket, within_s: float) -> bool:
    """Whether the server closes this connection (the next read ends) within `within_s` seconds."""
    sock.settimeout(within_s)
    try:
        return sock.recv(1024) == b""
    except (socket.timeout, ConnectionResetError) as exc:
        return isinstance(exc, ConnectionResetError)


def test_a_request_never_finished_is_cut_off_and_connections_beyond_the_cap_are_closed(server):
    url, _ = server
    address = (urlsplit(url).hostname, urlsplit(url).port)
    unfinished = socket.create_connection(address)
    unfinished.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # slowloris: headers never end
    opened = time.monotonic()
    held = [socket.create_connection(address) for _ in range(MAX_CONNECTIONS)]
    try:
        # the unfinished one and MAX_CONNECTIONS - 1 of these fill the cap; the last is closed as it is made
        assert closed_by_server(held[-1], 2.0), "a connection beyond --max-connections must be closed at once"
        assert not closed_by_server(held[0], 0.2), "a connection within the cap stays open"
    finally:
        for sock in held:
            sock.close()
    assert closed_by_server(unfinished, REQUEST_TIMEOUT_S + 3.0), (
        "a request whose headers never end must be cut off after --request-timeout")
    assert time.monotonic() - opened >= REQUEST_TIMEOUT_S - 0.1, "cut off before its time"
    unfinished.close()
    assert plain(url)[0] == 200, "the server answers afterwards"
