"""Which JSON schemas the grammar backend would get wrong, refused before it sees them.

xgrammar 0.2.9 compiles some schemas to a grammar that lets through output the schema forbids (a
`uniqueItems` array with repeats, a `maxLength` string beside a `pattern`, ...): such output would
end with finish_reason "stop" and break the schema. Each case below was measured against xgrammar
(tests/test_xgrammar.py); what it enforces compiles. Refused with a ValueError that names the
keyword, as OpenAI's structured outputs refuse the keywords they do not support. `oneOf` is let
through, read as `anyOf` (the same for the discriminated unions clients send).
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import unquote

from ..checks import shortened

# In a schema, these keywords hold JSON data or annotations, not schemas: a {"$ref": ...} there is a
# value, not a reference ("example" and "discriminator" are OpenAPI's, which pydantic writes).
DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples", "example", "discriminator"})
# These hold a map of names to schemas: a property may be named "enum" or "not".
NAMED_SCHEMAS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})
# Compiled without being enforced, wherever they appear.
UNENFORCED_KEYWORDS = ("not", "contains", "if", "then", "else", "dependentRequired", "dependentSchemas",
                       "dependencies", "$dynamicRef", "$recursiveRef")
# Beside a reference, a combinator or a list of values, xgrammar drops every other constraint
# ({"type": "integer", "minimum": 0, "anyOf": [...]} lets -1 through), the type included (_type_implied).
ANNOTATIONS = frozenset({"type", "title", "description", "$comment", "deprecated", "readOnly", "writeOnly",
                         "$schema", "$id", "$anchor", "$defs", "definitions", *DATA_KEYWORDS})
WHOLE_SCHEMA_KEYWORDS = ("$ref", "allOf", "anyOf", "oneOf", "enum", "const")
# In a schema with no type (and none of the above), xgrammar drops these ({"minimum": 5} lets 4 through).
SCALAR_CONSTRAINTS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "minLength",
                      "maxLength", "pattern", "format")


def check_schema(schema_text: str) -> None:
    """Every schema in `schema_text`, and every one a reference reaches, is one the backend
    enforces, and every $ref points into the document (_check_ref)."""
    try:
        root = json.loads(schema_text)
    except (ValueError, RecursionError) as exc:  # text after the schema too: xgrammar would compile the first value alone
        raise ValueError(f"invalid json_schema: {type(exc).__name__}: {str(exc)[:200]}") from None
    stack, followed = [(root, True)], set()  # (a value, whether it is a schema or a map of names to schemas)
    while stack:  # no recursion: a deeply nested schema is not a RecursionError
        value, is_schema = stack.pop()
        if isinstance(value, dict) and is_schema:
            ref = value.get("$ref")
            _check_ref(ref)
            if isinstance(ref, str) and ref not in followed:  # what a reference reaches is a schema, wherever it lies
                followed.add(ref)
                stack.append((_resolve(root, ref), True))
            _check_enforced(value)
            stack.extend((v, key not in NAMED_SCHEMAS) for key, v in value.items() if key not in DATA_KEYWORDS)
        elif isinstance(value, dict):
            stack.extend((v, True) for v in value.values())
        elif isinstance(value, list):
            stack.extend((v, is_schema) for v in value)


def _check_ref(ref: Any) -> None:
    """A $ref (a string) must point into the schema itself: "#" or "#/...". xgrammar compiles any
    other (another file, a URL) to a schema that constrains nothing, and writes the reference, the
    caller's text, into the log."""
    if isinstance(ref, str) and not (ref == "#" or ref.startswith("#/")):  # else a property named $ref
        raise ValueError(f"a $ref in the JSON schema must point into the schema (\"#\" or \"#/...\"), "
                         f"got {shortened(repr(ref))}")


def _resolve(root: Any, ref: str) -> Any:
    """The value a local reference ("#", "#/a/0/b") points at; None where it points at nothing
    (xgrammar's own error then says so)."""
    node = root
    for token in ref[2:].split("/") if ref.startswith("#/") else ():
        token = unquote(token).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and token in node:
            node = node[token]
        elif isinstance(node, list) and token.isdigit() and int(token) < len(node):
            node = node[int(token)]
        else:
            return None
    return node


def _check_enforced(schema: dict) -> None:
    unenforced = _unenforced(schema)
    if unenforced:
        raise ValueError(f"the JSON schema keyword {unenforced[0]} is not enforced by the grammar backend "
                         f"(xgrammar, as of 0.2.9): an output could break it")
    required, listed = schema.get("required"), schema.get("properties", {})
    missing = [name for name in required if isinstance(name, str) and name not in listed] \
        if isinstance(required, list) and isinstance(listed, dict) else []
    if missing:
        raise ValueError(f"the JSON schema requires {missing[0]!r} but does not list it in properties: the grammar "
                         f"backend (xgrammar, as of 0.2.9) generates only the listed properties")


def _unenforced(schema: dict) -> list[str]:
    """The keywords of one schema (not its subschemas) that xgrammar would drop."""
    found = [key for key in UNENFORCED_KEYWORDS if key in schema]
    if schema.get("uniqueItems", False) is not False:
        found.append("uniqueItems")
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:  # one member is enforced
        found.append("allOf (with more than one schema)")
    if "multipleOf" in schema and not (schema.get("type") == "integer" and _is_whole(schema["multipleOf"])):
        found.append("multipleOf (other than a whole number, on type integer)")
    # No format matches "": a minLength of 1 beside one holds anyway (pydantic's AnyUrl writes it).
    lengths = [key for key in ("minLength", "maxLength") if key in schema and not
               (key == "minLength" and "pattern" not in schema and schema[key] in (0, 1))]
    if lengths and ("pattern" in schema or "format" in schema):
        found.append(f"{lengths[0]} (beside {'pattern' if 'pattern' in schema else 'format'})")
    if "format" in schema and "pattern" in schema:
        found.append("pattern (beside format)")
    whole = [key for key in WHOLE_SCHEMA_KEYWORDS if key in schema]
    if whole:
        dropped = sorted(key for key in schema if key not in ANNOTATIONS and key not in WHOLE_SCHEMA_KEYWORDS)
        if "type" in schema and not _type_implied(schema):
            dropped.insert(0, "type")
        found += [f"{dropped[0]} (beside {whole[0]})"] if dropped else []
    elif "type" not in schema:
        untyped = [key for key in SCALAR_CONSTRAINTS if key in schema]
        found += [f"{untyped[0]} (without a type)"] if untyped else []
    return found


def _type_implied(schema: dict) -> bool:
    """Beside enum or const, a type that every value has already (pydantic writes one) is kept by
    the values; beside a reference or a combinator, xgrammar drops it."""
    if any(key in schema for key in ("$ref", "allOf", "anyOf", "oneOf")):
        return False
    values = list(schema["enum"]) if isinstance(schema.get("enum"), list) else []
    values += [schema["const"]] if "const" in schema else []
    types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
    return all(any(_has_type(value, name) for name in types) for value in values)


def _has_type(value: Any, name: Any) -> bool:
    if isinstance(value, bool):  # a bool is an int in Python, not in JSON
        return name == "boolean"
    return {"string": isinstance(value, str), "integer": _is_whole(value), "number": isinstance(value, (int, float)),
            "null": value is None, "object": isinstance(value, dict), "array": isinstance(value, list)}.get(name, False)


def _is_whole(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and float(value).is_integer()
