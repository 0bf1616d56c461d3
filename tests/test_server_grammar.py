"""response_format and SGLang's regex / ebnf through the server, in both loops (xgrammar; the normal
loop in the full tier, tests/test_xgrammar.py has both in process)."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from .server_process import post_json, running_server

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["animal", "n"],
          "properties": {"animal": {"enum": ["cat", "dog", "owl"]}, "n": {"type": "integer", "minimum": 0,
                                                                            "maximum": 99}}}


@pytest.fixture(scope="module", params=["overlap", pytest.param("normal", marks=pytest.mark.full)])
def server(request):
    with running_server("--loop", request.param, "--kv-tokens", "4096") as url:
        yield url


def test_json_schema_output_parses_and_validates(server):
    c = openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0)
    fmt = {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA}}
    for prompt in ("add 12 5:", "count 3 to 9:"):
        out = c.chat.completions.create(model="demo", messages=[{"role": "user", "content": prompt}],
                                        response_format=fmt, max_tokens=64, temperature=0)
        jsonschema.validate(json.loads(out.choices[0].message.content), SCHEMA)
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


def test_a_bad_grammar_is_a_400(server):
    for body, param in ((({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 5}}}}),
                         "response_format"),
                        ({"regex": "(a"}, "regex"), ({"ebnf": "root ::="}, "ebnf"),
                        ({"regex": "a", "ebnf": 'root ::= "a"'}, "response_format")):
        status, error = post_json(server, "/v1/completions", {"model": "demo", "prompt": "hi", **body})
        assert status == 400 and error["error"]["param"] == param, error
