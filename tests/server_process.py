"""A real `python -m minisgl serve` process on a free port, for the server tests."""

from __future__ import annotations

import asyncio
import http.client
import json
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator
from urllib.parse import urlsplit

from minisgl.server import launcher

# A JSON schema whose output the demo model completes within 64 tokens (for "add 12 5:").
PET_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["animal", "n"],
              "properties": {"animal": {"enum": ["cat", "dog", "owl"]}, "n": {"type": "integer", "minimum": 0,
                                                                                "maximum": 99}}}


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


@dataclass
class RawResponse:
    status: int
    headers: dict[str, str]
    body: bytes

    def events(self) -> list[str]:
        """The server-sent events' data fields."""
        return [e[len("data: "):] for e in self.body.decode().split("\n\n") if e.startswith("data: ")]

    def stream_text(self) -> str:
        return "".join(c["text"] for e in self.events() if e != "[DONE]" for c in json.loads(e)["choices"])


def _dechunk(body: bytes) -> bytes:
    out, rest = [], body
    while rest:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            break
        out.append(rest[:size])
        rest = rest[size + 2:]
    return b"".join(out)


async def raw_post(url: str, path: str, body: dict, read_delay_s: float = 0.0) -> RawResponse:
    """One request over a plain asyncio connection (light enough for a thousand at once); with
    `read_delay_s`, a slow reader that takes one small piece at a time."""
    host, port = urlsplit(url).hostname, urlsplit(url).port
    reader, writer = await asyncio.open_connection(host, port)
    payload = json.dumps(body).encode()
    writer.write(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n".encode() + payload)
    await writer.drain()
    pieces = []
    while piece := await reader.read(64 if read_delay_s else 65536):
        pieces.append(piece)
        if read_delay_s:
            await asyncio.sleep(read_delay_s)
    writer.close()
    head, _, rest = b"".join(pieces).partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    if headers.get("transfer-encoding") == "chunked":
        rest = _dechunk(rest)
    return RawResponse(int(lines[0].split()[1]), headers, rest)
