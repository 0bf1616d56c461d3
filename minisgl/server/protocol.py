"""OpenAI's request bodies, checked field by field into typed requests, and its error body.

Anything wrong is an `APIError` (HTTP 400 unless said otherwise) naming the field, before
anything reaches the engine. Fields OpenAI defines that this server does not implement, and
SGLang's sampling, grammar and stop extras it does not implement, are refused when set to anything
but their default, never silently ignored; other fields are ignored, as SGLang's server ignores
fields it does not know (OpenAI's own answers them with a 400).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from ..checks import INT64_MAX, INT64_MIN, is_int, shortened
from ..sampling_params import FLOAT32_TINY
from .messages import GrammarSpec

MAX_N = 64  # choices per request
MAX_TOP_LOGPROBS = 20  # OpenAI's limit for chat (completions: 5; the larger one for both)
MAX_STOPS = 16
MAX_STOP_CHARS = 400  # per stop string: the text held back while it may be starting is this long at most
MAX_PROMPTS = 1024  # prompts in one /v1/completions batch
# A grammar's cost to compile grows faster than its size (benchmarks/history/, "Figures that
# were in code comments"): what one request may ask for. OpenAI's own limits for structured outputs
# are tighter (10 levels of objects, 1,000 enum values).
MAX_GRAMMAR_CHARS = 32768  # a JSON schema (as JSON), a regex or an EBNF grammar
MAX_SCHEMA_DEPTH = 64  # objects and arrays nested in a JSON schema
MAX_SCHEMA_ENUM_VALUES = 1000  # the values of every enum in a JSON schema, together


class APIError(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 type: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = message, param, status, type, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class Options:
    """The generation options both endpoints share."""

    max_tokens: int | None  # None: up to the context window
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    n: int
    logprobs: int | None  # top-k alternatives per token, when asked for
    ignore_eos: bool
    stream: bool
    include_usage: bool
    grammar: GrammarSpec | None


@dataclass(frozen=True)
class CompletionRequest:
    model: str
    prompts: list[str | list[int]]
    options: Options


@dataclass(frozen=True)
class ChatRequest:
    model: str
    messages: list[dict[str, str]]  # role, content (text parts joined)
    options: Options


def parse_json(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # invalid UTF-8 is a UnicodeDecodeError, a ValueError
        raise APIError(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise APIError(f"the request body must be a JSON object, got {_kind(body)}")
    return body


def parse_completion(body: dict) -> CompletionRequest:
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(is_int(t) for t in prompt)):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or _is_id_list(p) for p in prompt):
        prompts = list(prompt)
    else:
        raise APIError("prompt must be a string, a list of token ids, or a non-empty list of either", "prompt")
    if len(prompts) > MAX_PROMPTS:
        raise APIError(f"at most {MAX_PROMPTS} prompts per request, got {len(prompts)}", "prompt")
    if any(len(p) == 0 for p in prompts):
        raise APIError("a prompt is empty", "prompt")
    _refuse(body, echo=False, suffix=None)
    logprobs = _int(body, "logprobs", None, 0, MAX_TOP_LOGPROBS)
    return CompletionRequest(_model(body), prompts, _options(body, _int(body, "max_tokens", 16, 1, INT64_MAX), logprobs))


def parse_chat(body: dict) -> ChatRequest:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError("messages must be a non-empty list of {role, content} objects", "messages")
    parsed = [_message(m, i) for i, m in enumerate(messages)]
    _refuse(body, tools=None, functions=None, tool_choice=None)
    top = _int(body, "top_logprobs", None, 0, MAX_TOP_LOGPROBS)
    if _bool(body, "logprobs", False):
        logprobs = top or 0
    elif top is not None:
        raise APIError("top_logprobs needs logprobs: true", "top_logprobs")
    else:
        logprobs = None
    max_tokens = _int(body, "max_completion_tokens", None, 1, INT64_MAX)
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", None, 1, INT64_MAX)
    return ChatRequest(_model(body), parsed, _options(body, max_tokens, logprobs))


def _message(m: Any, i: int) -> dict[str, str]:
    param = f"messages[{i}]"
    if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "developer"):
        raise APIError("each message must be an object with role system, developer, user or assistant", param)
    content = m.get("content")
    if isinstance(content, list):  # content parts: only text ones
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            raise APIError("only text content parts ({type: text, text}) are supported", f"{param}.content")
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise APIError("content must be a string or a list of text parts", f"{param}.content")
    return {"role": m["role"], "content": content}


def _model(body: dict) -> str:
    model = body.get("model")
    if not isinstance(model, str):
        raise APIError("model must be a string (see /v1/models)", "model")
    return model


def _options(body: dict, max_tokens: int | None, logprobs: int | None) -> Options:
    stream = _bool(body, "stream", False)
    stream_options = body.get("stream_options")
    include_usage = False
    if stream_options is not None:
        if not stream or not isinstance(stream_options, dict):
            raise APIError("stream_options must be an object, and only with stream: true", "stream_options")
        include_usage = _bool(stream_options, "include_usage", False, "stream_options.include_usage")
    n = _int(body, "n", 1, 1, MAX_N)
    best_of = _int(body, "best_of", None, 1, MAX_N)
    if best_of is not None and best_of != n:
        raise APIError("best_of other than n is not supported", "best_of")
    _refuse(body, frequency_penalty=0, presence_penalty=0, logit_bias=None)
    _refuse(body, min_p=0, repetition_penalty=1, min_tokens=0, no_stop_trim=False, skip_special_tokens=True,  # SGLang's
            json_schema=None, stop_regex=None)  # SGLang's completions grammar and its stop regexes
    return Options(max_tokens=max_tokens, temperature=_float(body, "temperature", 1.0, 0.0, 2.0),
                   top_p=_float(body, "top_p", 1.0, FLOAT32_TINY, 1.0), top_k=_top_k(body),
                   seed=_int(body, "seed", None, INT64_MIN, INT64_MAX), stop=_stop(body),
                   stop_token_ids=_ids(body, "stop_token_ids"), n=n, logprobs=logprobs,
                   ignore_eos=_bool(body, "ignore_eos", False), stream=stream, include_usage=include_usage,
                   grammar=_grammar(body))


def _grammar(body: dict) -> GrammarSpec | None:
    found = []
    fmt = body.get("response_format")
    if fmt is not None:
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind == "json_schema":
            spec = fmt.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                raise APIError("response_format.json_schema.schema must be a JSON schema object",
                               "response_format.json_schema")
            found.append(GrammarSpec("json_schema", _bounded_schema(schema)))
        elif kind == "json_object":
            found.append(GrammarSpec("json_object"))
        elif kind != "text":
            raise APIError("response_format.type must be text, json_object or json_schema", "response_format")
    for kind in ("regex", "ebnf"):  # SGLang's extras
        text = body.get(kind)
        if text is not None:
            if not isinstance(text, str) or not text:
                raise APIError(f"{kind} must be a non-empty string", kind)
            if len(text) > MAX_GRAMMAR_CHARS:
                raise APIError(f"{kind} is {len(text)} characters; at most {MAX_GRAMMAR_CHARS}", kind)
            check_text(text, kind)
            found.append(GrammarSpec(kind, text))
    if len(found) > 1:
        raise APIError("at most one of response_format (json), regex and ebnf", "response_format")
    return found[0] if found else None


def grammar_param(spec: GrammarSpec) -> str:
    """The request field a grammar came from."""
    return "response_format" if spec.kind.startswith("json") else spec.kind


def _bounded_schema(schema: dict) -> str:
    """The schema as JSON, once it is within the limits on its size, nesting and enums."""
    param = "response_format"
    text = json.dumps(schema)
    if len(text) > MAX_GRAMMAR_CHARS:
        raise APIError(f"the JSON schema is {len(text)} characters as JSON; at most {MAX_GRAMMAR_CHARS}", param)
    enum_values = 0
    stack: list[tuple[Any, int]] = [(schema, 1)]  # (a value in the schema, how deep it is); no recursion
    while stack:
        value, depth = stack.pop()
        if depth > MAX_SCHEMA_DEPTH:
            raise APIError(f"the JSON schema nests more than {MAX_SCHEMA_DEPTH} levels of JSON objects and arrays "
                           f"(a property's schema is two levels below its object's)", param)
        if isinstance(value, dict):
            if isinstance(value.get("enum"), list):
                enum_values += len(value["enum"])
            for key in value:
                check_text(key, param)
            stack.extend((v, depth + 1) for v in value.values())
        elif isinstance(value, str):
            check_text(value, param)
        elif isinstance(value, list):
            stack.extend((v, depth + 1) for v in value)
    if enum_values > MAX_SCHEMA_ENUM_VALUES:
        raise APIError(f"the JSON schema's enums have {enum_values} values together; at most "
                       f"{MAX_SCHEMA_ENUM_VALUES}", param)
    return text


def _top_k(body: dict) -> int:
    top_k = _int(body, "top_k", -1, -1, (1 << 31) - 1)  # SGLang's extra; -1: off
    if top_k == 0:
        raise APIError("top_k must be -1 (off) or at least 1", "top_k")
    return top_k


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > MAX_STOPS:
        raise APIError(f"stop must be a non-empty string or a list of at most {MAX_STOPS} of them", "stop")
    for s in stops:
        if len(s) > MAX_STOP_CHARS:
            raise APIError(f"a stop string is {len(s)} characters; at most {MAX_STOP_CHARS}", "stop")
        check_text(s, "stop")
    return tuple(stops)


def _ids(body: dict, name: str) -> tuple[int, ...]:
    value = body.get(name)
    if value is None:
        return ()
    if not _is_id_list(value, allow_empty=True):
        raise APIError(f"{name} must be a list of token ids", name)
    return tuple(value)


def _refuse(body: dict, **defaults: Any) -> None:
    """Fields this server does not implement: only their default (or absence) is accepted."""
    for name, default in defaults.items():
        value = body.get(name, default)
        if value != default and value not in (None, {}, []):
            raise APIError(f"{name} is not supported by this server", name)


def _int(body: dict, name: str, default: int | None, low: int, high: int) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if not is_int(value):
        raise APIError(f"{name} must be an integer, got {_kind(value)}", name)
    if not low <= value <= high:
        raise APIError(f"{name} must be in [{low}, {high}], got {shortened(value)}", name)
    return int(value)


def _float(body: dict, name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise APIError(f"{name} must be a number, got {_kind(value)}", name)
    if not math.isfinite(value):  # Python's json reads NaN, Infinity and -Infinity
        raise APIError(f"{name} must be a finite number, got {json.dumps(value)}", name)
    if not low <= value <= high:
        raise APIError(f"{name} must be in [{low:g}, {high:g}], got {shortened(value)}", name)
    return float(value)


def _bool(body: dict, name: str, default: bool, param: str | None = None) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise APIError(f"{name} must be true or false, got {_kind(value)}", param or name)
    return value


def _is_id_list(value: Any, allow_empty: bool = False) -> bool:
    return (isinstance(value, list) and (allow_empty or bool(value))
            and all(is_int(t) and 0 <= t <= INT64_MAX for t in value))


def check_text(text: str, param: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:  # a lone surrogate ("\\ud800" in the JSON)
        raise APIError(f"{param} is not valid Unicode text ({exc.reason} at index {exc.start})", param) from None


def _kind(value: Any) -> str:
    return "null" if value is None else {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
                                         list: "an array", dict: "an object"}.get(type(value), type(value).__name__)
