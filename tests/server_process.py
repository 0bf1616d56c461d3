"""A real `python -m minisgl serve` process on a free port, for the server tests."""

from __future__ import annotations

import http.client
import json
from contextlib import contextmanager
from typing import Iterator
from urllib.parse import urlsplit

from minisgl.server import launcher


@contextmanager
def running_server(*flags: str) -> Iterator[str]:
    """A real server process (minisgl/server/launcher.py); yields its base URL."""
    with launcher.running_server(*flags) as (url, _):
        yield url


def request(url: str, method: str, path: str, body: bytes | None = None,
            headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    """One plain HTTP request (the standard library's client): status and body."""
    conn = http.client.HTTPConnection(urlsplit(url).netloc, timeout=60)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def post_json(url: str, path: str, body: object) -> tuple[int, dict]:
    status, raw = request(url, "POST", path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    return status, json.loads(raw)


def metric(url: str, name: str) -> float:
    """One sample of /metrics (the first series of that name)."""
    for line in request(url, "GET", "/metrics")[1].decode().splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)
