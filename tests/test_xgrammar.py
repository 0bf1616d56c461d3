"""The xgrammar backend in process: JSON schemas, regexes and EBNF behind the delayed sampling,
in both loops, beside the teaching FSM in one batch."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from minisgl import LLM, SamplingParams
from minisgl.demo.paths import demo_model_path
from minisgl.features.grammar import Grammar
from minisgl.features.xgrammar_backend import BitmaskMask, GrammarCompiler, check_grammar

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["animal", "ok", "n"],
          "properties": {"animal": {"enum": ["cat", "dog", "owl"]}, "ok": {"type": "boolean"},
                         "n": {"type": "integer", "minimum": 0, "maximum": 99}}}
PROMPTS = ["add 12 5:", "count 3 to 9:", "reverse cat dog:", "repeat fox 2:"]


def run(loop: str) -> tuple[list, list]:
    with LLM(demo_model_path(), loop=loop) as llm:
        compiler = GrammarCompiler(llm.tokenizer, llm.engine.model.vocab_size, llm.eos_ids)
        schema = compiler.compile("json_schema", json.dumps(SCHEMA))
        digits = Grammar.sequence_of([[llm.tokenizer.convert_tokens_to_ids("Ġ")]] + [list(range(13, 23))] * 2,
                                     end=sorted(llm.eos_ids))
        params = [SamplingParams(max_new_tokens=80, grammar=schema),
                  SamplingParams(max_new_tokens=80, grammar=schema, temperature=1.0, seed=5),
                  SamplingParams(max_new_tokens=20, grammar=compiler.compile("regex", r"(yes|no) [0-9]{1,3}")),
                  SamplingParams(max_new_tokens=20, grammar=compiler.compile("ebnf", 'root ::= "cat" | "dog dog"')),
                  SamplingParams(max_new_tokens=80, grammar=compiler.compile("json_object"), temperature=0.7, seed=1),
                  SamplingParams(max_new_tokens=8, grammar=digits),  # the teaching FSM in the same batch
                  SamplingParams(max_new_tokens=8)]  # and an unconstrained row
        outs = llm.generate([PROMPTS[i % len(PROMPTS)] for i in range(len(params))], params)
        llm.check_invariants()
        return outs, llm.stats.delayed_samples, digits


@pytest.fixture(scope="module")
def outputs():
    return {loop: run(loop) for loop in ("normal", "overlap")}


@pytest.mark.parametrize("loop", ["normal", "overlap"])
def test_every_output_follows_its_grammar(outputs, loop):
    outs, delayed, digits = outputs[loop]
    for out in outs[:2]:
        jsonschema.validate(json.loads(out.text), SCHEMA)
        assert out.finish_reason == "stop"
    assert re.fullmatch(r"(yes|no) [0-9]{1,3}", outs[2].text)
    assert outs[3].text in ("cat", "dog dog")
    assert isinstance(json.loads(outs[4].text), dict)
    assert digits.accepts_prefix(outs[5].token_ids) and len(outs[5].token_ids) >= 2
    assert delayed > 0  # the masks waited for the previous batch's commit


def test_both_loops_give_the_same_tokens(outputs):
    assert [o.token_ids for o in outputs["normal"][0]] == [o.token_ids for o in outputs["overlap"][0]]


def test_the_bitmask_goes_to_the_logits_device_and_keeps_the_raw_logits():
    bitmask = torch.zeros(2, 1, dtype=torch.int32)  # row 1: nothing allowed but what is set below
    bitmask[1, 0] = 1 << 3
    from minisgl.features.grammar import TokenMask

    mask = BitmaskMask(TokenMask((None, None)), bitmask, rows=(1,))
    logits = torch.zeros(2, 32)
    masked = mask.apply(logits, torch.tensor)
    assert torch.equal(logits, torch.zeros(2, 32))  # the raw logits still give the logprobs
    assert masked[0].isfinite().all() and masked[1].isfinite().nonzero().flatten().tolist() == [3]


@pytest.mark.parametrize("kind, text", [("json_schema", '{"type": 5}'), ("json_schema", "{"),
                                        ("regex", "(a"), ("ebnf", "root ::= ")])
def test_a_bad_grammar_is_one_value_error(kind, text):
    with pytest.raises(ValueError, match=f"invalid {kind}: "):
        check_grammar(kind, text)


@pytest.mark.parametrize("ref", ["http://example.com/a.json", "other.json#/a", "/etc/passwd"])
def test_a_ref_out_of_the_schema_is_refused_before_xgrammar_sees_it(ref, capfd):
    """xgrammar compiles a $ref to another file or a URL to a schema that constrains nothing, and
    logs the reference: the in-process compile refuses it as the server does, and nothing is logged."""
    from minisgl.frontend.tokenizer import load_tokenizer

    compiler = GrammarCompiler(load_tokenizer(demo_model_path()), 512, [1])
    for schema in ({"type": "object", "properties": {"a": {"$ref": ref}, "$ref": {"type": "string"}}},
                   {"type": "object", "properties": {"enum": {"$ref": ref}}},  # a property named as a keyword
                   {"anyOf": [{"type": "integer"}, {"items": {"$ref": ref}}]}):
        for compile_it in (check_grammar, compiler.compile):
            with pytest.raises(ValueError, match="a \\$ref in the JSON schema must point into the schema"):
                compile_it("json_schema", json.dumps(schema))
    assert ref not in "".join(capfd.readouterr())
    # A reference into the schema compiles; so does a {"$ref": ...} that is JSON data, not a schema.
    for schema in ({"$defs": {"n": {"type": "integer"}}, "type": "object", "properties": {"a": {"$ref": "#/$defs/n"}}},
                   {"const": {"$ref": ref}}, {"enum": [{"$ref": ref}, 1]},
                   {"type": "integer", "default": {"$ref": ref}, "examples": [{"$ref": ref}]}):
        check_grammar("json_schema", json.dumps(schema))
        compiler.compile("json_schema", json.dumps(schema))


# (schema, an output that breaks it, the keyword the refusal names)
UNENFORCED = [({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "[1, 1]", "uniqueItems"),
              ({"allOf": [{"type": "integer", "minimum": 5}, {"maximum": 6}]}, "1", "allOf"),
              ({"type": "integer", "not": {"const": 1}}, "1", "not"),
              ({"type": "array", "contains": {"const": 5}}, "[]", "contains"),
              ({"if": {"type": "integer"}, "then": {"minimum": 5}}, "1", "if"),
              ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "dependentRequired": {"a": ["b"]}}, '{"a": 1}', "dependentRequired"),
              ({"type": "object", "properties": {}, "required": ["zz"]}, "{}", "'zz'"),
              ({"type": "array", "items": {"type": "integer"}, "uniqueItems": 1}, "[1, 1]", "uniqueItems"),
              ({"$schema": "http://json-schema.org/draft-07/schema#", "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "dependencies": {"a": ["b"]}},
               '{"a": 1}', "dependencies"),
              ({"type": "number", "multipleOf": 0.5}, "0.3", "multipleOf"),
              ({"type": "string", "pattern": "^a+$", "maxLength": 3}, '"aaaa"', "maxLength (beside pattern)"),
              ({"type": "string", "format": "uuid", "maxLength": 3}, '"123e4567-e89b-12d3-a456-426614174000"',
               "maxLength (beside format)"),
              ({"allOf": [{"type": "integer"}], "maximum": 3}, "5", "maximum (beside allOf)"),
              ({"type": "integer", "minimum": 0, "anyOf": [{"maximum": 3}, {"minimum": 10}]}, "5",
               "(beside anyOf)"),
              ({"$defs": {"s": {"type": "string"}}, "$ref": "#/$defs/s", "maxLength": 2}, '"abc"',
               "maxLength (beside $ref)"),
              ({"enum": ["ab", "cd"], "pattern": "^a"}, '"cd"', "pattern (beside enum)"),
              # a reference into data: what it reaches is a schema all the same
              ({"type": "object", "properties": {"a": {"$ref": "#/$defs/x/default"}}, "required": ["a"],
                "$defs": {"x": {"default": {"type": "integer", "not": {"const": 1}}}}}, '{"a": 1}', "not"),
              ({"type": "string", "enum": ["a", 1]}, "1", "type (beside enum)"),
              ({"type": "string", "anyOf": [{"type": "integer"}, {"type": "string"}]}, "1", "type (beside anyOf)"),
              ({"$defs": {"A": {"type": "integer"}}, "type": "string", "$ref": "#/$defs/A"}, "1", "type (beside $ref)"),
              ({"type": "number", "multipleOf": 2}, "3", "multipleOf"),
              ({"minimum": 5}, "4", "minimum (without a type)"),
              ({"type": "object", "properties": {"a": {"maximum": 3}}, "required": ["a"]}, '{"a": 4}',
               "maximum (without a type)")]


@pytest.mark.parametrize("schema, breaking, keyword", UNENFORCED)
def test_a_keyword_xgrammar_does_not_enforce_is_refused(schema, breaking, keyword):
    """xgrammar compiles these schemas to grammars that accept an output breaking them (it would
    end with finish_reason "stop"): the compile refuses them and names the keyword. Should a new
    xgrammar enforce one, the first assertion fails and its refusal can go."""
    import xgrammar as xgr
    from minisgl.frontend.tokenizer import load_tokenizer

    compiler = GrammarCompiler(load_tokenizer(demo_model_path()), 512, [1])
    unchecked = xgr.GrammarMatcher(compiler.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False))
    assert unchecked.accept_string(breaking) and unchecked.accept_token(1)  # xgrammar lets it end there
    validator = jsonschema.validators.validator_for(schema)(schema)  # no metaschema check: uniqueItems 1 is one
    assert list(validator.iter_errors(json.loads(breaking)))  # and it breaks the schema
    for compile_it in (check_grammar, compiler.compile):
        with pytest.raises(ValueError, match=re.escape(keyword)):
            compile_it("json_schema", json.dumps(schema))


def test_the_keywords_xgrammar_enforces_compile():
    from minisgl.frontend.tokenizer import load_tokenizer

    compiler = GrammarCompiler(load_tokenizer(demo_model_path()), 512, [1])
    for schema in ({"allOf": [{"type": "integer", "minimum": 5}]}, {"type": "array", "uniqueItems": False},
                   {"oneOf": [{"type": "integer"}, {"type": "string"}]}, {"type": "string", "pattern": "^a+$"},
                   {"type": "object", "properties": {"not": {"type": "integer"}}, "required": ["not"]},
                   {"enum": [{"contains": 1}]},
                   # as pydantic writes them: an enum, an Optional field, a root model, a discriminated union
                   {"enum": ["a", "b"], "title": "Color", "type": "string"},
                   {"anyOf": [{"type": "integer"}, {"type": "null"}], "default": None, "title": "X"},
                   {"$ref": "#/$defs/X", "$defs": {"X": {"type": "integer", "minimum": 1}}},
                   {"oneOf": [{"$ref": "#/$defs/C"}, {"$ref": "#/$defs/E"}],
                    "discriminator": {"propertyName": "op", "mapping": {"contains": "#/$defs/C", "eq": "#/$defs/E"}},
                    "$defs": {"C": {"type": "object", "properties": {"op": {"const": "contains"}}, "required": ["op"]},
                              "E": {"type": "object", "properties": {"op": {"const": "eq"}}, "required": ["op"]}}},
                   {"type": "object", "properties": {"name": {"type": "string"}},
                    "example": {"name": "x", "required": ["email"]}},
                   {"format": "uri", "minLength": 1, "type": "string"},  # pydantic's AnyUrl: no format matches ""
                   {"type": "integer", "multipleOf": 3}, {"const": True, "type": "boolean"},
                   {"enum": [1, 2.0, None], "type": ["integer", "null"]}):
        compiler.compile("json_schema", json.dumps(schema))
    with pytest.raises(ValueError, match="invalid json_schema"):  # xgrammar would compile the first value alone
        check_grammar("json_schema", '{"type": "integer", "not": {"const": 1}} trailing')
    with pytest.raises(ValueError, match="invalid json_schema"):
        check_grammar("json_schema", '{"items": ' * 5000 + "{}" + "}" * 5000)


def test_the_compilers_cache_stays_within_its_limit():
    """Distinct grammars, one after another (a server's clients): xgrammar's cache stays near the
    limit given (it may pass it by about the newest grammar). Without a limit it kept every one:
    these 40 many times this limit, and a server grew by gigabytes."""
    from minisgl.frontend.tokenizer import load_tokenizer

    limit = 64 << 10
    compiler = GrammarCompiler(load_tokenizer(demo_model_path()), 512, [1], cache_limit_bytes=limit)
    for i in range(40):
        schema = {"type": "object", "properties": {f"k{i}_{j}": {"type": "integer"} for j in range(8)}}
        compiler.compile("json_schema", json.dumps(schema))
    assert 0 < compiler.compiler.get_cache_size_bytes() <= 2 * limit


def test_a_bounded_json_string_never_takes_a_raw_control_character():
    """xgrammar 0.2.9 compiles a string with maxLength to a class that admits raw control characters
    (its issue #800), which strict JSON parsers refuse. Inside such a string the batch's mask allows
    none of the tokens that hold one (the demo tokenizer has 35, its bytes 0x00-0x1f), and still
    allows the rest of the string's characters; a regex, which may ask for them, is left alone."""
    from minisgl.features.grammar import TokenMask
    from minisgl.frontend.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(demo_model_path())
    compiler = GrammarCompiler(tokenizer, 512, [1])
    control = [i for i in range(512) if re.search("[\x00-\x1f]", tokenizer.decode([i]))]
    letter = tokenizer.convert_tokens_to_ids("b")
    assert len(control) >= 30 and letter not in control

    def allowed_in(kind: str, text: str, prefix: str) -> set[int]:
        grammar = compiler.compile(kind, text)
        state = grammar.initial_state()
        assert state.matcher.accept_string(prefix)
        mask = grammar.batch_mask(TokenMask((None,)), [grammar], [state])
        row = mask.bitmask[0]
        return {i for i in range(512) if (int(row[i // 32]) >> (i % 32)) & 1}

    schema = json.dumps({"type": "object", "properties": {"name": {"type": "string", "maxLength": 10}}})
    inside = allowed_in("json_schema", schema, '{"name": "a')
    assert letter in inside and not inside & set(control)
    assert not allowed_in("json_object", "", '{"a": "') & set(control)
    assert len(allowed_in("regex", "[\x01-\x1f]+", "") & set(control)) >= 30


def test_a_json_string_takes_whole_utf8_characters_only():
    """xgrammar takes the bytes of a UTF-16 surrogate (ED A0 80, not UTF-8) as one character of a JSON
    string: three U+FFFD in the text, past a maxLength. Each request's state follows where its text
    stands in a UTF-8 character, and the mask allows only the bytes that may come next there."""
    from minisgl.features.grammar import TokenMask
    from minisgl.features.json_text import INVALID, utf8_step
    from minisgl.frontend.tokenizer import load_tokenizer
    from minisgl.server.detokenizer import token_bytes

    assert [utf8_step(0, b) for b in (0x41, 0xC3, 0xE0, 0xED, 0xF4, 0xC0, 0x80, 0xF5)] == [0, 1, 4, 5, 7] + [INVALID] * 3
    assert (utf8_step(5, 0x9F), utf8_step(5, 0xA0), utf8_step(4, 0x9F), utf8_step(7, 0x90)) == (1, INVALID, INVALID, INVALID)
    tokenizer = load_tokenizer(demo_model_path())
    of_byte = {raw[0]: i for i, raw in ((i, token_bytes(tokenizer)(i)) for i in range(512)) if len(raw) == 1}
    compiler = GrammarCompiler(tokenizer, 512, [1])
    for schema in ({"type": "string", "maxLength": 1}, {"type": "string"}):
        grammar = compiler.compile("json_schema", json.dumps({"type": "object", "properties": {"s": schema}}))
        state = grammar.initial_state()
        assert state.matcher.accept_string('{"s": "')
        state = grammar.advance(state, of_byte[0xED])  # a three-byte character's first byte
        row = grammar.batch_mask(TokenMask((None,)), [grammar], [state]).bitmask[0]
        allowed = {b for b, i in of_byte.items() if (int(row[i // 32]) >> (i % 32)) & 1}
        assert allowed == set(range(0x80, 0xA0)), sorted(allowed)  # not A0-BF: a surrogate
        assert grammar.advance(grammar.advance(state, of_byte[0x9F]), of_byte[0xBF]).utf8 == 0  # U+D7FF, whole
