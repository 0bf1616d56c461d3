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

from ..checks import check_schema_ref

# In a schema, these keywords hold JSON data or annotations, not schemas: a {"$ref": ...} there is a
# value, not a reference ("example" and "discriminator" are OpenAPI's, which pydantic writes).
DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples", "example", "discriminator"})
# These hold a map of names to schemas: a property may be named "enum" or "not".
NAMED_SCHEMAS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})
# Compiled without being enforced, wherever they appear.
UNENFORCED_KEYWORDS = ("not", "contains", "if", "then", "else", "dependentRequired", "dependentSchemas",
                       "dependencies", "$dynamicRef", "$recursiveRef")
# Beside a reference, a combinator or a list of values, xgrammar enforces only the type: any other
# constraint there is dropped ({"type": "integer", "minimum": 0, "anyOf": [...]} lets -1 through).
ANNOTATIONS = frozenset({"type", "title", "description", "$comment", "deprecated", "readOnly", "writeOnly",
                         "$schema", "$id", "$anchor", "$defs", "definitions", *DATA_KEYWORDS})
WHOLE_SCHEMA_KEYWORDS = ("$ref", "allOf", "anyOf", "oneOf", "enum", "const")


def check_schema(schema_text: str) -> None:
    """Every schema in `schema_text`, and every one a reference reaches, is one the backend
    enforces, and every $ref points into the document (checks.check_schema_ref)."""
    try:
        root = json.loads(schema_text)
    except (ValueError, RecursionError) as exc:  # text after the schema too: xgrammar would compile the first value alone
        raise ValueError(f"invalid json_schema: {type(exc).__name__}: {str(exc)[:200]}") from None
    stack, followed = [(root, True)], set()  # (a value, whether it is a schema or a map of names to schemas)
    while stack:  # no recursion: a deeply nested schema is not a RecursionError
        value, is_schema = stack.pop()
        if isinstance(value, dict) and is_schema:
            ref = value.get("$ref")
            check_schema_ref(ref)
            if isinstance(ref, str) and ref not in followed:  # what a reference reaches is a schema, wherever it lies
                followed.add(ref)
                stack.append((_resolve(root, ref), True))
            _check_enforced(value)
            stack.extend((v, key not in NAMED_SCHEMAS) for key, v in value.items() if key not in DATA_KEYWORDS)
        elif isinstance(value, dict):
            stack.extend((v, True) for v in value.values())
        elif isinstance(value, list):
            stack.extend((v, is_schema) for v in value)


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
    unenforced = [key for key in UNENFORCED_KEYWORDS if key in schema]
    if schema.get("uniqueItems", False) is not False:
        unenforced.append("uniqueItems")
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:  # one member is enforced
        unenforced.append("allOf (with more than one schema)")
    multiple_of = schema.get("multipleOf")
    if isinstance(multiple_of, (int, float)) and not float(multiple_of).is_integer():
        unenforced.append("multipleOf (not an integer)")
    lengths = [key for key in ("minLength", "maxLength") if key in schema]
    if lengths and ("pattern" in schema or "format" in schema):
        unenforced.append(f"{lengths[0]} (beside {'pattern' if 'pattern' in schema else 'format'})")
    if "format" in schema and "pattern" in schema:
        unenforced.append("pattern (beside format)")
    whole = [key for key in WHOLE_SCHEMA_KEYWORDS if key in schema]
    dropped = sorted(key for key in schema if key not in ANNOTATIONS and key not in WHOLE_SCHEMA_KEYWORDS)
    if whole and dropped:
        unenforced.append(f"{dropped[0]} (beside {whole[0]})")
    if unenforced:
        raise ValueError(f"the JSON schema keyword {unenforced[0]} is not enforced by the grammar backend "
                         f"(xgrammar, as of 0.2.9): an output could break it")
    required, listed = schema.get("required"), schema.get("properties", {})
    missing = [name for name in required if isinstance(name, str) and name not in listed] \
        if isinstance(required, list) and isinstance(listed, dict) else []
    if missing:
        raise ValueError(f"the JSON schema requires {missing[0]!r} but does not list it in properties: the grammar "
                         f"backend (xgrammar, as of 0.2.9) generates only the listed properties")
