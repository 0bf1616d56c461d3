"""The HTTP routes: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics.

Every route runs on the event loop and only waits (on the engine's sockets, on the client):
the engine runs in the scheduler process, so a slow client never slows a step. Work that grows
with what a client sends runs elsewhere, raced against the client leaving: a long prompt is
tokenized on a worker thread (worker_threads.py), a grammar is checked in a child process that
is killed when it runs past its time limit (grammar_checker.py). On the loop it would stall every
other client for as long."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, TypeVar

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..sampling_params import SPECULATIVE_WHY, SamplingParams, speculative_refuses
from .chat import render_chat
from .engine_client import EngineClient, EngineUnavailable, Overloaded
from .event_stream import EventStream
from .generation import Generation, GenerationFailed
from .grammar_checker import CheckerClosed, GrammarChecker
from .messages import GrammarSpec
from .metrics import Metrics
from .protocol import APIError, Options, check_text, grammar_param, parse_chat, parse_completion, parse_json
from .responses import ChatFormat, CompletionFormat, Format
from .worker_threads import WorkerThreads

MAX_BODY_BYTES = 8 << 20
RETRY_AFTER_S = 1
CLIENT_GONE = 499  # nginx's "client closed request": nobody reads it; the access log says what happened
INLINE_TOKENIZE_CHARS = 2048  # text up to this long is tokenized on the event loop (a few milliseconds at most)
T = TypeVar("T")


@dataclass
class ServerState:
    client: EngineClient
    tokenizer: object
    model_name: str
    metrics: Metrics
    write_timeout_s: float  # a stream whose client reads nothing for this long ends
    heartbeat_timeout_s: float  # /health says 503 when the scheduler has been silent this long
    grammar_checker: GrammarChecker
    tokenizing: WorkerThreads = field(default_factory=lambda: WorkerThreads("minisgl-http-tokenize"))
    max_token_chars: int = field(init=False)  # the most characters of text one token stands for

    def __post_init__(self) -> None:
        # No token of this tokenizer spans more characters than its longest vocabulary entry (bytes
        # of byte-level BPE, pieces of SentencePiece): a longer text cannot fit in the context.
        # A smaller figure here would refuse prompts that fit.
        self.max_token_chars = max(map(len, self.tokenizer.get_vocab()))

    @property
    def vocab_size(self) -> int:
        return self.client.info.vocab_size

    @property
    def max_seq_len(self) -> int:
        return self.client.info.max_seq_len


def error_response(error: APIError) -> JSONResponse:
    headers = {"Retry-After": str(RETRY_AFTER_S)} if error.status == 503 else {}
    if error.status == 413:  # the body was left unread: it must not be parsed as the next request
        headers["Connection"] = "close"
    return JSONResponse(error.body(), status_code=error.status, headers=headers or None)


def build_app(state: ServerState) -> Starlette:
    async def completions(request: Request) -> Response:
        body = parse_json(await read_body(request))
        req = parse_completion(body)
        check_model(state, req.model)
        check_engine_takes(state, len(req.prompts), req.options)
        await check_grammar(state, request, req.options.grammar)

        def tokenize_all() -> list[list[int]]:
            return [tokenize(state, p, "prompt") for p in req.prompts]

        size = sum(map(len, req.prompts))  # characters, or token ids (each costs about as much to check)
        prompts = await prepare_input(state, request, size, tokenize_all)
        return await respond(state, request, prompts, req.options, CompletionFormat(state.model_name, state.tokenizer))

    async def chat_completions(request: Request) -> Response:
        body = parse_json(await read_body(request))
        req = parse_chat(body)
        check_model(state, req.model)
        check_engine_takes(state, 1, req.options)
        await check_grammar(state, request, req.options.grammar)

        def tokenize_chat() -> list[int]:
            for i, m in enumerate(req.messages):
                check_text(m["content"], f"messages[{i}].content")
            try:
                text = render_chat(state.tokenizer, req.messages)
            except Exception as exc:  # noqa: BLE001 - a template's own error (jinja2) on these messages
                raise APIError(f"the chat template cannot render these messages: {exc}", "messages") from None
            check_chars(state, len(text), "messages")  # the text tokenized: the contents and the template's own
            return check_ids(state, state.tokenizer.encode(text, add_special_tokens=False), "messages")

        chars = sum(len(m["content"]) for m in req.messages)
        ids = await prepare_input(state, request, chars, tokenize_chat)
        return await respond(state, request, [ids], req.options, ChatFormat(state.model_name, state.tokenizer))

    def model_card() -> dict:
        return {"id": state.model_name, "object": "model", "created": 0, "owned_by": "minisgl",
                "max_model_len": state.max_seq_len}

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [model_card()]})

    async def model(request: Request) -> Response:
        check_model(state, request.path_params["model_id"])
        return JSONResponse(model_card())

    async def health(request: Request) -> Response:
        client = state.client
        if client.failure is not None or client.closing or not client.process.is_alive():
            return error_response(APIError(client.failure or "the server is shutting down", status=503,
                                           type="service_unavailable"))
        if client.silent_s > state.heartbeat_timeout_s:  # its loop is stuck (it sends every second)
            return error_response(APIError(f"the scheduler has sent nothing for {client.silent_s:.0f} s",
                                           status=503, type="service_unavailable"))
        return JSONResponse({"status": "ok"})

    async def metrics(request: Request) -> Response:
        return Response(state.metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def api_error(request: Request, exc: APIError) -> Response:
        return error_response(exc)

    async def client_disconnected(request: Request, exc: ClientDisconnect) -> Response:
        # A client gone while its body was read or its input prepared: no traceback in the log per client.
        return Response(status_code=CLIENT_GONE)

    async def http_error(request: Request, exc: HTTPException) -> Response:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return error_response(APIError(message, status=exc.status_code, type=kind))

    routes = [Route("/v1/completions", completions, methods=["POST"]),
              Route("/v1/chat/completions", chat_completions, methods=["POST"]),
              Route("/v1/models", models, methods=["GET"]),
              Route("/v1/models/{model_id:path}", model, methods=["GET"]),
              Route("/health", health, methods=["GET"]),
              Route("/metrics", metrics, methods=["GET"])]
    return Starlette(routes=routes, exception_handlers={
        APIError: api_error, HTTPException: http_error, ClientDisconnect: client_disconnected})


async def read_body(request: Request) -> bytes:
    """The body, refused (413) beyond MAX_BODY_BYTES before it is all read."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise APIError(f"the request body is {declared} bytes; at most {MAX_BODY_BYTES}", status=413)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise APIError(f"the request body is over {MAX_BODY_BYTES} bytes", status=413)
        chunks.append(chunk)
    return b"".join(chunks)


def check_model(state: ServerState, model: str) -> None:
    """An unknown model is a 404, as OpenAI's API answers it (the client raises NotFoundError)."""
    if model != state.model_name:
        raise APIError(f"the model {model!r} does not exist; this server serves {state.model_name!r}", "model",
                       status=404, code="model_not_found")


def check_engine_takes(state: ServerState, prompts: int, options: Options) -> None:
    """What this engine can never run is a 400, before any work."""
    generations = prompts * options.n
    if generations > state.client.max_inflight:
        raise APIError(f"the request asks for {generations} generations (prompts times n); this server runs at most "
                       f"{state.client.max_inflight} at once (--max-inflight)", "n")
    speculative = state.client.info.speculative
    refused = speculative_refuses(options.grammar, options.logprobs)
    if speculative is not None and refused is not None:
        param = "logprobs" if refused == "logprobs" else grammar_param(options.grammar)
        raise APIError(f"{param} is not supported with speculative decoding ({speculative}): {SPECULATIVE_WHY}", param)


async def check_grammar(state: ServerState, request: Request, spec: GrammarSpec | None) -> None:
    """A grammar that does not parse is a 400; the scheduler process compiles it (grammar_queue.py).
    json_object has nothing to parse."""
    if spec is None or spec.kind == "json_object":
        return
    timeout_s = state.client.grammar_timeout_s
    check = asyncio.ensure_future(state.grammar_checker.check(spec, timeout_s))
    try:
        await unless_client_leaves(request, check)
    except ValueError as exc:
        raise APIError(str(exc), grammar_param(spec)) from None
    except asyncio.TimeoutError:
        raise APIError(f"the {spec.kind} was not checked within {timeout_s:g} s (the server's --grammar-timeout)",
                       grammar_param(spec)) from None
    except EOFError:
        raise APIError(f"the process checking the {spec.kind} exited before it answered", status=500,
                       type="server_error") from None
    except CheckerClosed:
        raise APIError("the server is shutting down", status=503, type="service_unavailable") from None


async def prepare_input(state: ServerState, request: Request, size: int, fn: Callable[[], T]) -> T:
    """fn() on the event loop when the input is short (a thread hand-off would cost more), else
    on the tokenizing thread."""
    return fn() if size <= INLINE_TOKENIZE_CHARS else await off_loop(state.tokenizing, request, fn)


async def off_loop(worker: WorkerThreads, request: Request, fn: Callable[[], T]) -> T:
    """fn() on `worker`, raced against the client leaving. What has not started then never does;
    what has runs to its end (a thread cannot be stopped), its result dropped."""
    return await unless_client_leaves(request, asyncio.wrap_future(worker.submit(fn)))


async def unless_client_leaves(request: Request, work: asyncio.Future[T]) -> T:
    """work's result, unless the client leaves first (ClientDisconnect: a 499, see client_disconnected);
    then work is cancelled."""
    gone = asyncio.ensure_future(client_gone(request))
    try:
        done, _ = await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if work in done:
        return work.result()
    work.cancel()
    raise ClientDisconnect()


def tokenize(state: ServerState, prompt: str | list[int], param: str) -> list[int]:
    """A prompt's token ids (a text refused before tokenizing when it has too many characters to fit)."""
    if isinstance(prompt, str):
        check_text(prompt, param)
        check_chars(state, len(prompt), param)
        prompt = state.tokenizer.encode(prompt)
    return check_ids(state, prompt, param)


def check_chars(state: ServerState, chars: int, param: str) -> None:
    """A bound that costs nothing: text longer than this cannot fit in the context, whatever its tokens."""
    if chars > state.max_seq_len * state.max_token_chars:
        raise APIError(f"the prompt has {chars} characters: more than the context's {state.max_seq_len} tokens "
                       f"can hold (a token is {state.max_token_chars} characters at most)", param,
                       code="context_length_exceeded")


def check_ids(state: ServerState, ids: list[int], param: str) -> list[int]:
    if not ids:
        raise APIError("the prompt is empty", param)
    if len(ids) >= state.max_seq_len:  # before the ids are looked at: there may be millions
        raise APIError(f"the prompt has {len(ids)} tokens; the context holds {state.max_seq_len} (prompt plus at "
                       f"least one new token)", param, code="context_length_exceeded")
    bad = sorted({i for i in ids if not 0 <= i < state.vocab_size})
    if bad:
        raise APIError(f"token ids {bad[:8]} are outside the vocabulary of {state.vocab_size}", param)
    return ids


def sampling_params(state: ServerState, prompt_len: int, options: Options, choice: int) -> SamplingParams:
    room = state.max_seq_len - prompt_len
    if options.max_tokens is not None and options.max_tokens > room:
        raise APIError(f"max_tokens is {options.max_tokens}, but the prompt has {prompt_len} tokens and the context "
                       f"holds {state.max_seq_len}: at most {room}", "max_tokens", code="context_length_exceeded")
    bad = sorted({i for i in options.stop_token_ids if i >= state.vocab_size})
    if bad:
        raise APIError(f"stop_token_ids {bad[:8]} are outside the vocabulary of {state.vocab_size}", "stop_token_ids")
    try:
        return SamplingParams(max_new_tokens=options.max_tokens or room, temperature=options.temperature,
                              top_k=options.top_k, top_p=options.top_p,
                              seed=None if options.seed is None else _wrap_seed(options.seed + choice),
                              ignore_eos=options.ignore_eos, stop_token_ids=options.stop_token_ids,
                              logprobs=options.logprobs)
    except (TypeError, ValueError) as exc:  # what the checks above let through, the engine's own checks catch
        raise APIError(str(exc)) from None


def _wrap_seed(seed: int) -> int:
    """Choice i draws with seed + i, kept in int64's range."""
    return (seed + (1 << 63)) % (1 << 64) - (1 << 63)


async def respond(state: ServerState, request: Request, prompts: list[list[int]], options: Options,
                  fmt: Format) -> Response:
    generations = [(ids, sampling_params(state, len(ids), options, choice))
                   for ids in prompts for choice in range(options.n)]
    prompt_tokens = sum(map(len, prompts))
    try:
        gen = Generation(state.client, state.tokenizer, generations, options.stop, options.grammar)
    except Overloaded as exc:
        raise APIError(str(exc), status=503, type="service_unavailable") from None
    except EngineUnavailable as exc:
        raise APIError(str(exc), status=503, type="service_unavailable") from None
    with_logprobs = options.logprobs is not None
    if options.stream:
        return EventStream(stream(gen, fmt, with_logprobs, prompt_tokens, options.include_usage), state.write_timeout_s)
    try:  # a client gone first: ClientDisconnect (a 499), its generations aborted by close()
        choices = await unless_client_leaves(request, asyncio.ensure_future(gen.collect()))
    except GenerationFailed as exc:
        raise APIError(str(exc), status=500, type="server_error") from None
    finally:
        gen.close()
    return JSONResponse(fmt.full(choices, with_logprobs, prompt_tokens))


async def client_gone(request: Request) -> None:
    """Returns when the client disconnects (the body is read already: only that message is left)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def stream(gen: Generation, fmt: Format, with_logprobs: bool, prompt_tokens: int,
                 include_usage: bool) -> AsyncIterator[str]:
    """Server-sent events. A client that disconnects or stalls ends this generator (EventStream),
    and the finally clause aborts its generations in the engine."""
    # With include_usage, OpenAI's every chunk before the last carries "usage": null.
    usage = {"usage": None} if include_usage else {}
    try:
        for chunk in fmt.first_chunks(len(gen.choices)):
            yield sse({**chunk, **usage})
        async for pieces in gen.pieces():  # one write for all: a socket write costs more than a chunk's JSON
            yield "".join(sse({**fmt.chunk(piece, with_logprobs), **usage}) for piece in pieces)
        if include_usage:
            yield sse(fmt.usage_chunk(prompt_tokens, gen.completion_tokens))
    except GenerationFailed as exc:
        yield sse(APIError(str(exc), status=500, type="server_error").body())
    finally:
        gen.close()
    yield "data: [DONE]\n\n"


SSE_JSON = json.JSONEncoder(ensure_ascii=False, allow_nan=False)  # shared: json.dumps builds one a call


def sse(obj: dict) -> str:
    return f"data: {SSE_JSON.encode(obj)}\n\n"

