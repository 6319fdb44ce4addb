"""The JSON a schema lets the model write: what Pagoda adds to a schema before it becomes a
grammar, so that an answer is compact and ends.

A JSON schema bounds what is valid, not what a sampler can run into: an object without
``additionalProperties`` accepts any key, a number any count of digits, and the JSON
grammar any whitespace between tokens. A small model under such a grammar invents keys, pads
with newlines or writes digits until ``max_tokens`` cuts the answer (and ``parse()`` fails
with a length error). So, as vLLM's default grammar engine (xgrammar) does in its strict
mode, Pagoda reads a schema for generation with these defaults, each of which the schema
can override:

- an object that declares ``properties`` is closed: no undeclared keys unless the schema
  sets ``additionalProperties`` (or ``patternProperties`` / ``unevaluatedProperties``); an
  object with no ``properties`` (``{"type": "object"}``) stays open to any key;
- whitespace is compact, as ``json.dumps`` writes it: ``", "`` between items, ``": "``
  after keys, no newlines (the schema's own ``x-guidance`` options win);
- an integer has at most :data:`MAX_INTEGER_DIGITS` digits and a number at most as many
  before the point and :data:`MAX_FRACTION_DIGITS` after it, no exponent, unless the schema
  gives its own ``minimum`` / ``maximum`` / ``multipleOf``.

Every output valid under these defaults is valid under the schema as the client wrote it.
"""

from __future__ import annotations

import copy
from typing import Any

#: Digits an unbounded integer (or a number's integer part) may have.
MAX_INTEGER_DIGITS = 15
#: Digits after a number's point when the schema sets no multipleOf.
MAX_FRACTION_DIGITS = 6

#: llguidance's options for compact JSON (the schema's own "x-guidance" keys win).
COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

# Keywords whose value is a subschema, a list of subschemas or a map of subschemas.
_ONE = ("additionalProperties", "items", "not", "if", "then", "else", "contains", "unevaluatedItems",
        "propertyNames", "unevaluatedProperties", "additionalItems")
_LIST = ("anyOf", "oneOf", "prefixItems")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def generation_schema(schema: dict[str, Any] | bool) -> dict[str, Any]:
    """A copy of ``schema`` with the defaults above; the original is left as it was."""
    result: dict[str, Any] = {} if schema is True else copy.deepcopy(schema)
    if schema is False:
        return schema  # NOTE: nothing is valid; the grammar engine says so
    _bound(result, close=True)
    result["x-guidance"] = {**COMPACT, **(result.get("x-guidance") or {})}
    return result


def _bound(schema: Any, close: bool) -> None:
    """Adds the defaults to one subschema and every subschema in it, in place."""
    if not isinstance(schema, dict):
        return
    types = schema.get("type")
    types = set(types) if isinstance(types, list) else {types}
    if "const" not in schema and "enum" not in schema:
        if close and "properties" in schema and types & {"object", None} and not any(
                key in schema for key in ("additionalProperties", "patternProperties", "unevaluatedProperties")):
            schema["additionalProperties"] = False
        if types & {"integer", "number"}:
            limit = 10 ** MAX_INTEGER_DIGITS - 1
            if "minimum" not in schema and "exclusiveMinimum" not in schema:
                schema["minimum"] = -limit
            if "maximum" not in schema and "exclusiveMaximum" not in schema:
                schema["maximum"] = limit
            if "number" in types and "multipleOf" not in schema:
                schema["multipleOf"] = 10 ** -MAX_FRACTION_DIGITS
    for key in _ONE:
        _bound(schema.get(key), close=True)
    for key in _LIST:
        for sub in schema.get(key) or ():
            _bound(sub, close=True)
    # NOTE: allOf's parts are one object's pieces: closing each would refuse the others' keys.
    for sub in schema.get("allOf") or ():
        _bound(sub, close=False)
    items = schema.get("items")
    if isinstance(items, list):
        for sub in items:
            _bound(sub, close=True)
    for key in _MAP:
        members = schema.get(key)
        if isinstance(members, dict):
            for sub in members.values():
                _bound(sub, close=True)
