"""The HTTP server against the official `openai` client: one real server process per loop (the
normal loop's only in the full tier), response_format / regex / ebnf through xgrammar included."""

from __future__ import annotations

import asyncio
import http.client
import json
import random
import re
import threading
import time
from urllib.parse import urlsplit

import jsonschema
import openai
import pytest

from minisgl import LLM, SamplingParams
from minisgl.demo.paths import demo_model_path
from minisgl.demo.tasks import demo_prompts
from minisgl.frontend.tokenizer import load_tokenizer
from minisgl.sampling_params import TokenLogprob
from minisgl.server.detokenizer import WINDOW, IncrementalDetokenizer, StopStrings, text_decoder
from minisgl.server.engine_client import EngineClient
from minisgl.server.generation import Generation, Piece
from minisgl.server.grammar_queue import GrammarQueue
from minisgl.server.messages import AbortRequest, EngineInfo, GenerateRequest, GrammarSpec, TokenDelta
from minisgl.server.metrics import Metrics
from minisgl.server.protocol import MAX_STOP_CHARS

from .server_process import PET_SCHEMA, metric, post_json, request, running_server

PROMPTS = [p for p, _ in demo_prompts(8, seed=3)]
SMALL_POOL = ("--kv-tokens", "4096")  # the tests audit the pool after every step: a small one audits fast


@pytest.fixture(scope="module")
def server():
    with running_server("--loop", "overlap", *SMALL_POOL) as url:
        yield url


@pytest.fixture(scope="module")
def normal_server():
    with running_server("--loop", "normal", *SMALL_POOL) as url:
        yield url


@pytest.fixture(scope="module")
def llm():
    with LLM(demo_model_path(), loop="normal") as engine:
        yield engine


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)


def streamed_text(stream) -> tuple[str, str | None]:
    text, finish = [], None
    for chunk in stream:
        for choice in chunk.choices:
            text.append(choice.text)
            finish = choice.finish_reason or finish
    return "".join(text), finish


@pytest.mark.parametrize("loop, prompts", [("overlap", PROMPTS[:3]), pytest.param("normal", PROMPTS, marks=pytest.mark.full)])
def test_streaming_equals_non_streaming_equals_in_process(request, llm, loop, prompts):
    url = request.getfixturevalue("server" if loop == "overlap" else "normal_server")
    c = client(url)
    params = [SamplingParams(max_new_tokens=24), SamplingParams(max_new_tokens=40, ignore_eos=True)]
    for sp in params:
        expected = llm.generate(prompts, sp)
        for prompt, out in zip(prompts, expected):
            kwargs = dict(model="demo", prompt=prompt, max_tokens=sp.max_new_tokens, temperature=0,
                          extra_body={"ignore_eos": sp.ignore_eos})
            whole = c.completions.create(**kwargs)
            text, finish = streamed_text(c.completions.create(stream=True, **kwargs))
            assert whole.choices[0].text == text == out.text
            assert whole.choices[0].finish_reason == finish == out.finish_reason
            assert whole.usage.completion_tokens == len(out.token_ids)
            assert whole.usage.prompt_tokens == len(out.prompt_token_ids)


def test_chat_streams_with_usage_and_ends_in_done(server, llm):
    c = client(server)
    prompt = "count 12 to 19:"
    expected = llm.generate([prompt], SamplingParams(max_new_tokens=64)).pop()
    whole = c.chat.completions.create(model="demo", messages=[{"role": "user", "content": prompt}], temperature=0)
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == expected.text
    chunks = list(c.chat.completions.create(model="demo", messages=[{"role": "user", "content": prompt}],
                                            temperature=0, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == expected.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(expected.token_ids)
    # the raw stream: server-sent events, the last one [DONE]; with include_usage, as OpenAI's, every
    # chunk before the usage chunk carries "usage": null
    body = {"model": "demo", "messages": [{"role": "user", "content": prompt}], "stream": True, "temperature": 0,
            "stream_options": {"include_usage": True}}
    status, raw = request(server, "POST", "/v1/chat/completions", json.dumps(body).encode())
    events = [e for e in raw.decode().split("\n\n") if e]
    assert status == 200 and all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    chunk_bodies = [json.loads(e[len("data: "):]) for e in events[:-1]]
    assert all("usage" in c and c["usage"] is None for c in chunk_bodies[:-1]) and chunk_bodies[-1]["usage"]


def test_logprobs_match_the_engine(server, llm):
    c = client(server)
    prompt = PROMPTS[0]
    expected = llm.generate([prompt], SamplingParams(max_new_tokens=12, ignore_eos=True, logprobs=3)).pop()
    out = c.completions.create(model="demo", prompt=prompt, max_tokens=12, temperature=0, logprobs=3,
                               extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert len(lp.token_logprobs) == 12 and all(len(top) <= 3 for top in lp.top_logprobs)
    # float32 on the CPU: alone or in a batch, the bits may differ a little (not the tokens)
    assert lp.token_logprobs == pytest.approx([e.logprob for e in expected.logprobs], abs=1e-4)
    assert "".join(lp.tokens) == expected.text
    # text_offset: where each token starts in the completion; a stream's chunks continue the count
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(12)]
    stream = c.completions.create(model="demo", prompt=prompt, max_tokens=12, temperature=0, logprobs=3, stream=True,
                                  extra_body={"ignore_eos": True})
    streamed = [chunk.choices[0].logprobs for chunk in stream if chunk.choices[0].logprobs.tokens]
    assert len(streamed) > 1 and sum((x.text_offset for x in streamed), []) == lp.text_offset
    # a special token (an EOS let through by ignore_eos) is listed, but adds nothing to the text
    out = c.completions.create(model="demo", prompt="count 1 to 400:", max_tokens=24, temperature=0, logprobs=0,
                               extra_body={"ignore_eos": True})
    text, lp = out.choices[0].text, out.choices[0].logprobs
    special = set(llm.tokenizer.all_special_tokens)
    assert special & set(lp.tokens), "the case needs a special token inside the completion"
    assert all(text[o:o + len(t)] == t for t, o in zip(lp.tokens, lp.text_offset) if t not in special)
    assert lp.text_offset[-1] + len(lp.tokens[-1]) * (lp.tokens[-1] not in special) == len(text)
    chat = c.chat.completions.create(model="demo", messages=[{"role": "user", "content": prompt}], temperature=0,
                                     max_tokens=12, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert [x.logprob for x in content] == pytest.approx([e.logprob for e in expected.logprobs], abs=1e-4)
    assert all(len(x.top_logprobs) == 2 and x.top_logprobs[0].logprob >= x.top_logprobs[1].logprob for x in content)


def test_n_choices_with_a_seed_are_reproducible(server):
    c = client(server)
    kwargs = dict(model="demo", prompt="add 1", max_tokens=16, temperature=1.5, seed=7, n=4,
                  extra_body={"ignore_eos": True})
    first, again = c.completions.create(**kwargs), c.completions.create(**kwargs)
    texts = [ch.text for ch in sorted(first.choices, key=lambda ch: ch.index)]
    assert [ch.index for ch in first.choices] == [0, 1, 2, 3]
    assert texts == [ch.text for ch in sorted(again.choices, key=lambda ch: ch.index)]
    assert len(set(texts)) > 1  # each choice draws with its own seed
    assert first.usage.completion_tokens == 4 * 16


def test_stop_strings_and_stop_ids(server, llm):
    c = client(server)
    prompt = "count 3 to 9:"
    full = llm.generate([prompt], SamplingParams(max_new_tokens=32)).pop()
    assert full.text == " 3 4 5 6 7 8 9"  # the demo model knows this one
    aborted = metric(server, "minisgl:aborted_requests_total")
    out = c.completions.create(model="demo", prompt=prompt, max_tokens=32, temperature=0, stop=[" 6", "zzz"])
    assert out.choices[0].text == " 3 4 5" and out.choices[0].finish_reason == "stop"
    text, finish = streamed_text(c.completions.create(model="demo", prompt=prompt, max_tokens=32, temperature=0,
                                                      stop=" 6", stream=True))
    assert (text, finish) == (" 3 4 5", "stop")
    at = next(i for i, t in enumerate(full.token_ids) if i > 0 and t not in full.token_ids[:i])
    before = llm.generate([prompt], SamplingParams(max_new_tokens=at)).pop().text  # the text up to the stop id
    kwargs = dict(model="demo", prompt=prompt, max_tokens=32, temperature=0,
                  extra_body={"stop_token_ids": [full.token_ids[at]]})
    out = c.completions.create(**kwargs)
    assert out.usage.completion_tokens == at + 1 and out.choices[0].finish_reason == "stop"
    assert before and out.choices[0].text == before  # the stop token's own text is left out, as SGLang does
    assert streamed_text(c.completions.create(stream=True, **kwargs)) == (before, "stop")
    assert metric(server, "minisgl:aborted_requests_total") == aborted  # a stop string's end is no abort


def test_a_client_that_disconnects_aborts_its_request_and_frees_its_kv(server):
    aborted = metric(server, "minisgl:aborted_requests_total")
    generated = metric(server, "minisgl:generation_tokens_total")
    body = {"model": "demo", "prompt": PROMPTS[1], "max_tokens": 400, "temperature": 0, "ignore_eos": True,
            "stream": True}
    conn = http.client.HTTPConnection(urlsplit(server).netloc, timeout=60)
    conn.request("POST", "/v1/completions", body=json.dumps(body))
    response = conn.getresponse()
    assert response.status == 200
    response.fp.readline()  # the first event is there: the request is running
    assert metric(server, "minisgl:token_usage") > 0
    conn.sock.close()
    conn.close()
    start = time.monotonic()
    while metric(server, "minisgl:token_usage") > 0 or metric(server, "minisgl:num_running_reqs") > 0:
        time.sleep(0.01)
    print(f"KV freed {time.monotonic() - start:.3f} s after the disconnect")
    assert metric(server, "minisgl:aborted_requests_total") == aborted + 1
    assert metric(server, "minisgl:generation_tokens_total") - generated < 400  # cut short, not finished


def test_64_concurrent_streams_get_their_exact_text(server, llm):
    prompts = [p for p, _ in demo_prompts(64, seed=11)]
    expected = [o.text for o in llm.generate(prompts, SamplingParams(max_new_tokens=32))]

    async def one(c: openai.AsyncOpenAI, prompt: str) -> str:
        stream = await c.completions.create(model="demo", prompt=prompt, max_tokens=32, temperature=0, stream=True)
        return "".join([chunk.choices[0].text async for chunk in stream])

    async def main() -> list[str]:
        async with openai.AsyncOpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0) as c:
            return await asyncio.gather(*(one(c, p) for p in prompts))

    assert asyncio.run(main()) == expected
    assert metric(server, "minisgl:token_usage") == 0


BAD_COMPLETIONS = [
    ({"model": "demo"}, "prompt"),
    ({"model": "demo", "prompt": 5}, "prompt"),
    ({"model": "demo", "prompt": ""}, "prompt"),
    ({"model": "demo", "prompt": []}, "prompt"),
    ({"model": "demo", "prompt": [1, -2]}, "prompt"),
    ({"model": "demo", "prompt": [1, 2, 10**9]}, "prompt"),
    ({"model": "demo", "prompt": [1, 2, 512]}, "prompt"),  # the demo vocabulary is 512
    ({"model": "demo", "prompt": "x" * 5000}, "prompt"),  # beyond the window
    ({"model": "demo", "prompt": "\ud800"}, "prompt"),
    ({"prompt": "hi"}, "model"),
    ({"model": 3, "prompt": "hi"}, "model"),
    ({"model": "demo", "prompt": "hi", "max_tokens": -1}, "max_tokens"),
    ({"model": "demo", "prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"model": "demo", "prompt": "hi", "max_tokens": 10**30}, "max_tokens"),
    ({"model": "demo", "prompt": "hi", "max_tokens": 511}, "max_tokens"),  # prompt + 511 > the window
    ({"model": "demo", "prompt": "hi", "max_tokens": "8"}, "max_tokens"),
    ({"model": "demo", "prompt": "hi", "max_tokens": 8.0}, "max_tokens"),
    ({"model": "demo", "prompt": "hi", "max_tokens": True}, "max_tokens"),
    ({"model": "demo", "prompt": "hi", "temperature": -1}, "temperature"),
    ({"model": "demo", "prompt": "hi", "temperature": "hot"}, "temperature"),
    ({"model": "demo", "prompt": "hi", "temperature": float("nan")}, "temperature"),
    ({"model": "demo", "prompt": "hi", "top_p": 0}, "top_p"),
    ({"model": "demo", "prompt": "hi", "top_p": 1e-300}, "top_p"),  # float32 rounds it to 0
    ({"model": "demo", "prompt": "hi", "top_p": 1.5}, "top_p"),
    ({"model": "demo", "prompt": "hi", "n": 0}, "n"),
    ({"model": "demo", "prompt": "hi", "n": 1000}, "n"),
    ({"model": "demo", "prompt": ["hi"] * 100, "n": 64}, "n"),  # more than --max-inflight: it can never run
    ({"model": "demo", "prompt": "hi", "seed": 2**64}, "seed"),
    ({"model": "demo", "prompt": "hi", "stop": 5}, "stop"),
    ({"model": "demo", "prompt": "hi", "stop": [""]}, "stop"),
    ({"model": "demo", "prompt": "hi", "stop": ["\udc80"]}, "stop"),
    ({"model": "demo", "prompt": "hi", "stop": ["y" * 401]}, "stop"),
    ({"model": "demo", "prompt": "hi", "stop_token_ids": [600]}, "stop_token_ids"),
    ({"model": "demo", "prompt": "hi", "stop_token_ids": "1"}, "stop_token_ids"),
    ({"model": "demo", "prompt": "hi", "logprobs": 100}, "logprobs"),
    ({"model": "demo", "prompt": "hi", "logprobs": -1}, "logprobs"),
    ({"model": "demo", "prompt": "hi", "ignore_eos": "yes"}, "ignore_eos"),
    ({"model": "demo", "prompt": "hi", "stream": 1}, "stream"),
    ({"model": "demo", "prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"model": "demo", "prompt": "hi", "echo": True}, "echo"),
    ({"model": "demo", "prompt": "hi", "presence_penalty": 1.0}, "presence_penalty"),
    ({"model": "demo", "prompt": "hi", "min_p": 0.5}, "min_p"),  # SGLang's sampling extras, not implemented
    ({"model": "demo", "prompt": "hi", "repetition_penalty": 1.2}, "repetition_penalty"),
    ({"model": "demo", "prompt": "hi", "no_stop_trim": True}, "no_stop_trim"),
    ({"model": "demo", "prompt": "hi", "json_schema": "{}"}, "json_schema"),
    ({"model": "demo", "prompt": "hi", "stop_regex": ["x+"]}, "stop_regex"),
    ({"model": "demo", "prompt": "hi", "response_format": {"type": "xml"}}, "response_format"),
    ({"model": "demo", "prompt": "hi", "regex": 7}, "regex"),
    ({"model": "demo", "prompt": "hi", "regex": "a\ud800"}, "regex"),
    ({"model": "demo", "prompt": "hi", "ebnf": 'root ::= "\udc80"'}, "ebnf"),
    ({"model": "demo", "prompt": "hi", "response_format": {"type": "json_schema", "json_schema": {
        "schema": {"type": "string", "enum": ["\ud800"]}}}}, "response_format"),
    ({"model": "demo", "prompt": "hi", "response_format": {"type": "json_schema", "json_schema": {
        "schema": {"properties": {"a": {"$ref": "other.json#/x"}}}}}}, "response_format"),
    ({"model": "demo", "prompt": "hi", "response_format": {"type": "json_schema", "json_schema": {
        "schema": {"$ref": "http://example.com/s.json"}}}}, "response_format"),
]
BAD_CHAT = [
    ({"model": "demo"}, "messages"),
    ({"model": "demo", "messages": []}, "messages"),
    ({"model": "demo", "messages": [{"role": "robot", "content": "hi"}]}, "messages[0]"),
    ({"model": "demo", "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"model": "demo", "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
    ({"model": "demo", "messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 99},
     "top_logprobs"),
    ({"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": -5},
     "max_completion_tokens"),
]


@pytest.mark.parametrize("path, cases", [("/v1/completions", BAD_COMPLETIONS), ("/v1/chat/completions", BAD_CHAT)])
def test_bad_requests_get_400_with_an_error_body_and_the_server_keeps_serving(server, path, cases):
    in_flight: list[tuple[str, str | None]] = []  # a stream that runs while the bad requests come
    stream = client(server).completions.create(model="demo", prompt="hi", max_tokens=200, stream=True,
                                               extra_body={"ignore_eos": True})
    reader = threading.Thread(target=lambda: in_flight.append(streamed_text(stream)))
    reader.start()
    for body, param in cases:
        status, error = post_json(server, path, body)
        assert status == 400, (body, error)
        assert set(error["error"]) == {"message", "type", "param", "code"} and error["error"]["param"] == param
    for raw in (b"{not json", b"[1, 2]", b"\xff\xfe{}", b"", b'{"model": "demo", "prompt": "a"' + b"]" * 3):
        status, error = request(server, "POST", path, raw)
        assert status == 400 and json.loads(error)["error"]["type"] == "invalid_request_error"
    status, out = post_json(server, "/v1/completions", {"model": "demo", "prompt": "add 12 5:", "temperature": 0})
    assert status == 200 and out["choices"][0]["text"] == " 17"
    reader.join(60)
    assert [finish for _, finish in in_flight] == ["length"]


def test_what_was_wrong_is_said(server):
    for value in ("NaN", "Infinity", "-Infinity"):  # Python's json reads them; OpenAI's clients can send them
        raw = b'{"model": "demo", "prompt": "hi", "temperature": %s}' % value.encode()
        status, error = request(server, "POST", "/v1/completions", raw)
        assert status == 400 and json.loads(error)["error"]["message"] == f"temperature must be a finite number, got {value}"
    status, error = post_json(server, "/v1/completions", {"model": "demo", "prompt": ["hi"] * 100, "n": 64})
    assert "6400 generations" in error["error"]["message"] and "--max-inflight" in error["error"]["message"]
    status, error = post_json(server, "/v1/completions", {"model": "demo", "prompt": "hi", "stop": ["y" * 300000]})
    assert error["error"]["message"] == "a stop string is 300000 characters; at most 400"
    status, error = post_json(server, "/v1/completions", {"model": "demo", "prompt": "hi", "seed": 10**4000})
    assert error["error"]["message"].endswith("... (4001 characters)") and len(error["error"]["message"]) < 200
    for kind, text in (("regex", "x\ud800"), ("ebnf", 'root ::= "\ud800"')):  # as the prompt's message says it
        status, error = post_json(server, "/v1/completions", {"model": "demo", "prompt": "hi", kind: text})
        assert error["error"]["message"].startswith(f"{kind} is not valid Unicode text (surrogates not allowed")
    status, error = post_json(server, "/v1/completions", {"model": "demo", "prompt": "hi", "response_format": {
        "type": "json_schema", "json_schema": {"schema": {"$ref": "s.json\nminisgl serve: exiting"}}}})
    assert error["error"]["message"].startswith("a $ref in the JSON schema must point into the schema"), error
    schema = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}  # xgrammar would not enforce it
    status, error = post_json(server, "/v1/completions", {"model": "demo", "prompt": "hi", "response_format": {
        "type": "json_schema", "json_schema": {"schema": schema}}})
    assert status == 400 and error["error"]["param"] == "response_format", error
    assert error["error"]["message"].startswith("the JSON schema keyword uniqueItems is not enforced"), error
    schema = {"type": "object", "properties": {"a": {"const": {"$ref": "http://x"}}}, "required": ["a"]}  # data
    status, out = post_json(server, "/v1/completions", {"model": "demo", "prompt": "hi", "max_tokens": 40,
                                                        "response_format": {"type": "json_schema",
                                                                            "json_schema": {"schema": schema}}})
    assert status == 200 and out["choices"][0]["finish_reason"] in ("stop", "length"), out


def test_a_prompt_too_long_to_fit_is_refused_before_it_is_tokenized(server):
    """The demo tokenizer takes seconds for megabytes (on the event loop, every client waited):
    more characters than the context's tokens can hold is a 400 at once."""
    huge = "count 3 to 9: " * 500_000  # 7 MB
    for path, body, param in (("/v1/completions", {"prompt": huge}, "prompt"),
                              ("/v1/chat/completions", {"messages": [{"role": "user", "content": huge}]}, "messages")):
        start = time.monotonic()
        status, error = post_json(server, path, {"model": "demo", **body})
        assert status == 400 and error["error"]["code"] == "context_length_exceeded", error
        assert error["error"]["param"] == param and "characters" in error["error"]["message"]
        assert time.monotonic() - start < 5.0
    # Longer than the event loop tokenizes, within the bound: the worker thread does it, same answers.
    status, error = post_json(server, "/v1/chat/completions", {"model": "demo", "messages": [
        {"role": "user", "content": "ab " * 1000}]})
    assert status == 400 and "2001 tokens" in error["error"]["message"], error
    prompts = ["count 3 to 9:"] * 160
    status, out = post_json(server, "/v1/completions", {"model": "demo", "prompt": prompts, "max_tokens": 2,
                                                        "temperature": 0})
    assert status == 200 and [c["text"] for c in out["choices"]] == [" 3"] * 160  # " 3" is two tokens


def test_a_long_batch_is_tokenized_off_the_event_loop(server):
    """1,024 prompts of 4,500 characters take the demo tokenizer most of a second: on the event
    loop, no other client got an answer meanwhile (a /health check included). The last prompt fits
    the character bound (512 tokens of 9 characters at most) but not the context, so the batch is
    refused once every prompt is tokenized."""
    prompts = [" requests" * 500] * 1023 + [" memory tokens" * 300]  # 500 tokens each; the last 600
    answer: list = []
    batch = threading.Thread(target=lambda: answer.append(post_json(server, "/v1/completions", {
        "model": "demo", "prompt": prompts})))
    batch.start()
    waits = []
    while batch.is_alive():
        start = time.monotonic()
        assert request(server, "GET", "/health")[0] == 200
        waits.append(time.monotonic() - start)
        time.sleep(0.05)
    [(status, error)] = answer
    assert status == 400 and error["error"]["param"] == "prompt" and "tokens" in error["error"]["message"], error
    assert len(waits) > 3 and max(waits) < 0.4, waits


def test_unknown_endpoints_and_methods_get_an_error_body(server):
    for method, path, code in (("GET", "/v1/nothing", 404), ("POST", "/v2/completions", 404),
                               ("GET", "/v1/completions", 405)):
        status, raw = request(server, method, path)
        assert status == code and set(json.loads(raw)["error"]) == {"message", "type", "param", "code"}


def test_models_health_and_metrics(server):
    models = client(server).models.list()
    assert [m.id for m in models.data] == ["demo"]
    assert client(server).models.retrieve("demo").id == "demo"
    with pytest.raises(openai.NotFoundError) as missing:
        client(server).models.retrieve("gpt-4")
    assert missing.value.body == {"message": "the model 'gpt-4' does not exist; this server serves 'demo'",
                                  "type": "invalid_request_error", "param": "model", "code": "model_not_found"}
    with pytest.raises(openai.NotFoundError, match="does not exist"):  # as OpenAI's API answers
        client(server).completions.create(model="gpt-4", prompt="hi", max_tokens=2)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client(server).chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "hi"}])
    assert request(server, "GET", "/health")[0] == 200
    client(server).completions.create(model="demo", prompt="hi", max_tokens=2)  # a first token to time
    text = request(server, "GET", "/metrics")[1].decode()
    for name in ("minisgl:num_running_reqs", "minisgl:num_queue_reqs", "minisgl:token_usage",
                 "minisgl:gen_throughput", "minisgl:time_to_first_token_seconds_bucket",
                 "minisgl:inter_token_latency_seconds_bucket"):
        assert name in text
    assert metric(server, "minisgl:time_to_first_token_seconds_count") > 0


@pytest.mark.parametrize("loop", ["overlap", pytest.param("normal", marks=pytest.mark.full)])
def test_json_schema_output_parses_and_validates(request, loop):
    c = client(request.getfixturevalue("server" if loop == "overlap" else "normal_server"))
    fmt = {"type": "json_schema", "json_schema": {"name": "pet", "schema": PET_SCHEMA}}
    for prompt in ("add 12 5:", "count 3 to 9:"):
        out = c.chat.completions.create(model="demo", messages=[{"role": "user", "content": prompt}],
                                        response_format=fmt, max_tokens=64, temperature=0)
        jsonschema.validate(json.loads(out.choices[0].message.content), PET_SCHEMA)
        stream = c.chat.completions.create(model="demo", messages=[{"role": "user", "content": prompt}],
                                           response_format=fmt, max_tokens=64, temperature=0, stream=True)
        assert "".join(ch.choices[0].delta.content or "" for ch in stream) == out.choices[0].message.content
    out = c.completions.create(model="demo", prompt="add 12 5:", max_tokens=80, temperature=0.7, seed=1,
                               extra_body={"response_format": {"type": "json_object"}})
    assert isinstance(json.loads(out.choices[0].text), dict)
    out = c.completions.create(model="demo", prompt="add 1", max_tokens=16, temperature=0,
                               extra_body={"regex": "(yes|no) [0-9]{1,3}"})
    assert re.fullmatch(r"(yes|no) [0-9]{1,3}", out.choices[0].text)
    out = c.completions.create(model="demo", prompt="add 1", max_tokens=16, temperature=0,
                               extra_body={"ebnf": 'root ::= "cat" | "dog dog"'})
    assert out.choices[0].text in ("cat", "dog dog")


def schema_nested(levels: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def test_a_grammar_beyond_the_limits_is_a_400_that_names_the_limit(server):
    """One schema nested 300 levels used to stall the HTTP process for 6 s and the scheduler for 8;
    an enum of 200,000 values wedged the scheduler for half an hour."""
    fmt = lambda schema: {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}  # noqa: E731
    cases = [({"response_format": fmt(schema_nested(300))}, "response_format", "more than 64 levels"),
             ({"response_format": fmt({"enum": list(range(1001))})}, "response_format", "at most 1000"),
             ({"response_format": fmt({"enum": [f"value_{i}" for i in range(200_000)]})}, "response_format",
              "at most 32768"),
             ({"regex": "a" * 40000}, "regex", "at most 32768"), ({"ebnf": 'root ::= "a"' + " " * 40000}, "ebnf",
                                                                   "at most 32768")]
    for extra, param, says in cases:
        start = time.monotonic()
        status, error = post_json(server, "/v1/completions", {"model": "demo", "prompt": "hi", **extra})
        assert status == 400 and error["error"]["param"] == param and says in error["error"]["message"], error
        assert time.monotonic() - start < 5.0
    out = client(server).completions.create(model="demo", prompt="hi", max_tokens=16, temperature=0, extra_body={
        "response_format": fmt(schema_nested(20))})  # 41 levels of JSON: within the limit
    assert out.choices[0].text.startswith('{"a": {"a": ')


def test_a_bad_grammar_is_a_400(server):
    for body, param in ((({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 5}}}}),
                         "response_format"),
                        ({"regex": "(a"}, "regex"), ({"ebnf": "root ::="}, "ebnf"),
                        ({"regex": "a", "ebnf": 'root ::= "a"'}, "response_format")):
        status, error = post_json(server, "/v1/completions", {"model": "demo", "prompt": "hi", **body})
        assert status == 400 and error["error"]["param"] == param, error


@pytest.mark.full  # a server of its own
def test_what_speculative_decoding_cannot_do_is_a_400_before_any_work():
    """Its verify step applies no grammar and computes no logprobs: such a request used to reach
    the engine and come back a 500."""
    chat = {"model": "demo", "messages": [{"role": "user", "content": "hi"}]}
    cases = [("/v1/completions", {"model": "demo", "prompt": "hi", "logprobs": 2}, "logprobs"),
             ("/v1/completions", {"model": "demo", "prompt": "hi", "regex": "[a-z]+"}, "regex"),
             ("/v1/chat/completions", {**chat, "logprobs": True}, "logprobs"),
             ("/v1/chat/completions", {**chat, "response_format": {"type": "json_object"}}, "response_format")]
    with running_server("--speculative-algorithm", "ngram", *SMALL_POOL) as url:
        for path, body, param in cases:
            status, error = post_json(url, path, body)
            assert status == 400 and error["error"]["param"] == param, error
            assert "speculative decoding (ngram)" in error["error"]["message"]
        assert metric(url, "minisgl:prompt_tokens_total") == 0  # nothing reached the engine
        out = client(url).completions.create(model="demo", prompt="add 12 5:", temperature=0)
        assert out.choices[0].text == " 17"


class QueueOnlyClient(EngineClient):
    """An EngineClient with no scheduler process: what it would send is kept, not sent."""

    def __init__(self) -> None:
        super().__init__(demo_model_path(), {}, Metrics("demo"), max_inflight=8)
        self.info = EngineInfo(eos_ids=(1,))  # what a started scheduler process says
        self.sent: list[object] = []

    def _send(self, msg: object) -> None:
        self.sent.append(msg)


def test_tokens_queued_for_a_stream_go_out_as_one_piece_with_every_logprob():
    """A stream behind the engine gets the deltas that have arrived as one piece per choice: the
    text, ids and per-token logprobs of all of them; a stop string still ends the generation at the
    delta that completes it (usage counts up to there; later deltas are dropped)."""
    tokenizer = load_tokenizer(demo_model_path())
    ids = tokenizer.encode("one two three four five six")
    stop = tokenizer.decode(ids[3:5], skip_special_tokens=True)  # completed by the fifth token

    async def run(stops: tuple[str, ...]) -> tuple[list[list[Piece]], Generation]:
        client = QueueOnlyClient()
        gen = Generation(client, tokenizer, [([1, 2], SamplingParams(max_new_tokens=len(ids)))], stops, None)
        rid = gen.sub.rids[0]
        for i, token in enumerate(ids):  # every step's delta is queued before the stream reads
            gen.sub.queue.put_nowait(TokenDelta(rid, [token], [TokenLogprob(token, -float(i), [])],
                                                "length" if i == len(ids) - 1 else None))
        return [batch async for batch in gen.pieces()], gen

    batches, gen = asyncio.run(run(()))
    assert len(batches) == 1 and len(batches[0]) == 1
    piece = batches[0][0]
    assert piece.text == tokenizer.decode(ids, skip_special_tokens=True) and piece.token_ids == ids
    assert [e.logprob for e in piece.logprobs] == [-float(i) for i in range(len(ids))]
    assert piece.finish_reason == "length" and gen.completion_tokens == len(ids)

    batches, gen = asyncio.run(run((stop,)))
    piece = batches[0][0]
    assert piece.text == tokenizer.decode(ids[:5], skip_special_tokens=True).split(stop)[0]
    assert piece.finish_reason == "stop" and gen.completion_tokens == 5 == len(piece.logprobs)
    assert isinstance(gen.client.sent[-1], AbortRequest)


def first_stop(text: str, stops: tuple[str, ...]) -> tuple[str, bool]:
    """What a client gets: the text up to the stop string that ends first (at one end, the longer)."""
    for end in range(1, len(text) + 1):
        ending = [s for s in stops if text[:end].endswith(s)]
        if ending:
            return text[:end - max(map(len, ending))], True
    return text, False


def test_stop_strings_match_wherever_the_text_is_cut():
    rng = random.Random(5)
    for _ in range(3000):
        alphabet = rng.choice(("ab", "abc"))
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        stops = tuple("".join(rng.choice(alphabet) for _ in range(rng.randint(1, 5))) for _ in range(rng.randint(1, 3)))
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 6))))
        matcher, out, stopped = StopStrings(stops), [], False
        for a, b in zip([0, *cuts], [*cuts, len(text)]):
            piece, stopped = matcher.feed(text[a:b])
            out.append(piece)
            if stopped:
                break
        if not stopped:
            out.append(matcher.flush())
        assert ("".join(out), stopped) == first_stop(text, stops), (text, stops, cuts)


def test_a_stop_string_costs_each_piece_its_length_not_the_stop_strings_square():
    """A piece that extends a long partial match: the held text is checked once per character
    (it used to be sliced and compared once per prefix length, 400 times per piece)."""
    stops = ("y" * (MAX_STOP_CHARS - 1) + "z",) * 4
    matcher = StopStrings(stops)
    start = time.perf_counter()
    for i in range(10_000):
        out, stopped = matcher.feed("y")
        assert not stopped and out == ("y" if i >= MAX_STOP_CHARS - 1 else "")
    assert time.perf_counter() - start < 1.0  # 0.03 s here; 3.4 s before


class BlockedCompiles:
    """A compile function that waits until told, and records what it was asked for."""

    def __init__(self) -> None:
        self.go = threading.Event()
        self.asked: list[str] = []

    def __call__(self, spec: GrammarSpec) -> str:
        self.asked.append(spec.text)
        self.go.wait()
        return f"compiled {spec.text}"


def generate(rid: int, grammar: str) -> GenerateRequest:
    return GenerateRequest(rid, [1, 2], SamplingParams(max_new_tokens=4), GrammarSpec("regex", grammar))


def test_the_grammar_queue_compiles_once_per_grammar_and_an_abort_cancels_a_compile_not_started():
    compiles = BlockedCompiles()
    grammars = GrammarQueue(compiles, timeout_s=60.0, workers=1)
    for rid, grammar in ((0, "a+"), (1, "a+"), (2, "b+"), (3, "c+")):  # a+ compiles, b+ and c+ wait behind it
        grammars.add(generate(rid, grammar))
    assert grammars.drop(2) and not grammars.drop(2)  # b+'s client went away before its compile started
    assert grammars.ready() == []
    compiles.go.set()
    deadline = time.monotonic() + 10
    ready: dict[int, object] = {}
    while len(ready) < 3 and time.monotonic() < deadline:
        ready.update((req.rid, grammar) for req, grammar in grammars.ready())
    assert ready == {0: "compiled a+", 1: "compiled a+", 3: "compiled c+"}
    assert compiles.asked == ["a+", "c+"] and grammars.waiting == {} and grammars.compiling == {}


def test_the_grammar_queue_refuses_a_compile_past_its_time_limit():
    compiles = BlockedCompiles()
    grammars = GrammarQueue(compiles, timeout_s=0.05, workers=1)
    grammars.add(generate(0, "a+"))
    time.sleep(0.1)
    [(req, why)] = grammars.ready()
    assert req.rid == 0 and why == "the grammar did not compile within 0.05 s"
    compiles.go.set()  # the thread finishes its compile; nobody waits for it


def test_the_grammar_queue_compiles_a_grammar_while_others_run_past_their_limit():
    """Two compiles that run on past their time limit (a thread cannot stop them) hold two of the
    three threads; the third compiles the next grammar. One thread used to hold every grammar
    behind such a compile, refused in turn."""
    blocked = BlockedCompiles()
    grammars = GrammarQueue(lambda spec: f"compiled {spec.text}" if spec.text == "c+" else blocked(spec),
                            timeout_s=0.2, workers=3)
    grammars.add(generate(0, "a+"))
    grammars.add(generate(1, "b+"))
    time.sleep(0.3)
    assert sorted(blocked.asked) == ["a+", "b+"]
    assert sorted((req.rid, why) for req, why in grammars.ready()) == [
        (0, "the grammar did not compile within 0.2 s"), (1, "the grammar did not compile within 0.2 s")]
    grammars.add(generate(2, "c+"))
    deadline = time.monotonic() + 10
    ready: list = []
    while not ready and time.monotonic() < deadline:
        ready = grammars.ready()
    assert [(req.rid, grammar) for req, grammar in ready] == [(2, "compiled c+")]
    blocked.go.set()


def metaspace_tokenizer():
    """A SentencePiece-style tokenizer (Llama 2's decoders): spaces as '▁' with the first one of a
    decode stripped, bytes for what the vocabulary lacks: a window without its context loses spaces."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tok.train_from_iterator(["ünïcödé text, 中文 and some words"] * 20, trainers.BpeTrainer(vocab_size=320,
                                                                                        special_tokens=specials))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


@pytest.mark.parametrize("make", [lambda: load_tokenizer(demo_model_path()), metaspace_tokenizer],
                         ids=["byte-level", "metaspace"])
def test_the_streamed_pieces_add_up_to_the_whole_decode(make):
    """Random ids (partial UTF-8 characters, special tokens, ids past the tokenizer's vocabulary,
    which a model with a larger embedding can sample) in pieces of random sizes: the detokenizer's
    pieces, then its flush, are exactly decode(all ids). Ids without text do not grow its window
    (each step decodes the window: a window that grew with them would cost a step O(tokens so far))."""
    tokenizer = make()
    decode = text_decoder(tokenizer)
    rng = random.Random(0)
    for trial in range(400):
        ids = [rng.randrange(len(tokenizer) + 64 * (trial % 2)) for _ in range(rng.randint(1, 120))]
        detokenizer, pieces, i = IncrementalDetokenizer(tokenizer), [], 0
        while i < len(ids):
            step = rng.choice([1, 1, 1, 2, 3, 24])
            pieces.append(detokenizer.add(ids[i:i + step]))
            i += step
        assert "".join(pieces) + detokenizer.flush() == tokenizer.decode(ids, skip_special_tokens=True)
        for skip in (True, False):  # the Rust backend alone, where transformers' decode adds nothing
            assert text_decoder(tokenizer, skip)(ids) == tokenizer.decode(ids, skip_special_tokens=skip)
    # what a model with a 151,936-row embedding samples from a 512-token tokenizer, between two words
    words = tokenizer.encode(" some words", add_special_tokens=False)
    ids = words + [len(tokenizer) + rng.randrange(151936) for _ in range(1000)] + words
    detokenizer = IncrementalDetokenizer(tokenizer)
    text = "".join(detokenizer.add([i]) for i in ids)
    assert len(detokenizer.window) <= WINDOW
    assert text + detokenizer.flush() == tokenizer.decode(ids, skip_special_tokens=True)
    assert decode([]) == ""


def test_chat_logprobs_bytes_rebuild_a_character_that_several_tokens_share():
    """Chat logprobs give each token's own bytes: a character split over byte tokens (each one's text
    alone is U+FFFD) is rebuilt by joining them, which is what OpenAI's `bytes` field is for."""
    from minisgl.server.responses import ChatFormat

    tokenizer = load_tokenizer(demo_model_path())
    fmt = ChatFormat("demo", tokenizer)
    for text in ("é€ ok", "日本\x1c", " plain words"):
        ids = tokenizer.encode(text, add_special_tokens=False)
        entries = [TokenLogprob(i, -0.5, [(i, -0.5)]) for i in ids]
        content = fmt.logprobs(entries)["content"]
        assert bytes(b for entry in content for b in entry["bytes"]) == text.encode("utf-8")
        assert [top["bytes"] for entry in content for top in entry["top_logprobs"]] == [e["bytes"] for e in content]
    assert any(e["token"] == "\ufffd" for e in fmt.logprobs([TokenLogprob(i, 0.0, []) for i in
                                                            tokenizer.encode("é", add_special_tokens=False)])["content"])
