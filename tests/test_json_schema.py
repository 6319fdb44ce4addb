"""How a JSON schema is read for generation (engine/core/json_schema.py): objects closed
unless the schema opens them, compact whitespace, bounded numbers; each default overridden
by the schema, the client's schema left untouched; checked on the schema and on what the
compiled grammar accepts."""

from __future__ import annotations

import copy
import json

import pytest

from pagoda.engine.core.grammar import GrammarCompiler
from pagoda.engine.core.json_schema import MAX_INTEGER_DIGITS, generation_schema
from pagoda.engine.sampling_params import StructuredOutputsParams

PERSON = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"}, "height": {"type": "number"},
    "tags": {"type": "array", "items": {"type": "object", "properties": {"k": {"type": "string"}}}},
    "extra": {"type": "object", "additionalProperties": True, "properties": {"a": {"type": "integer"}}},
    "any": {"type": "object"},
    "both": {"allOf": [{"type": "object", "properties": {"x": {"type": "integer"}}},
                       {"type": "object", "properties": {"y": {"type": "integer"}}}]},
    "percent": {"type": "number", "minimum": 0, "maximum": 100, "multipleOf": 0.5},
}, "required": ["name"]}


def test_the_schema_gets_closed_objects_bounded_numbers_and_compact_whitespace():
    original = copy.deepcopy(PERSON)
    schema = generation_schema(PERSON)
    assert PERSON == original  # the client's schema is not changed
    assert schema["additionalProperties"] is False
    assert schema["properties"]["tags"]["items"]["additionalProperties"] is False
    assert schema["properties"]["extra"]["additionalProperties"] is True  # opened by the schema
    assert "additionalProperties" not in schema["properties"]["any"]  # no properties: any object
    assert all("additionalProperties" not in part for part in schema["properties"]["both"]["allOf"])
    assert schema["properties"]["age"]["maximum"] == 10 ** MAX_INTEGER_DIGITS - 1
    assert schema["properties"]["height"]["multipleOf"] == 1e-6
    assert schema["properties"]["percent"] == PERSON["properties"]["percent"]  # its own bounds stand
    assert schema["x-guidance"]["whitespace_flexible"] is False
    own = generation_schema({"type": "object", "x-guidance": {"whitespace_flexible": True}})
    assert own["x-guidance"]["whitespace_flexible"] is True


@pytest.fixture(scope="module")
def compiler():
    from pagoda.engine.model_loader import convert_gguf, default_gguf_path, load_tokenizer

    tokenizer = load_tokenizer(convert_gguf(default_gguf_path()))
    return tokenizer, GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])


@pytest.mark.parametrize("text, accepted", [
    ('{"name": "Ada", "age": 36, "height": 1.65}', True),
    ('{"name": "Ada", "nickname": "A"}', False),  # an undeclared key
    ('{"name":"Ada"}', False),  # not the compact separators
    ('{\n  "name": "Ada"}', False),  # free whitespace
    ('{"name": "Ada", "age": 1234567890123456}', False),  # 16 digits
    ('{"name": "Ada", "height": 1.6500001}', False),  # 7 decimals
    ('{"name": "Ada", "height": 1e3}', False),  # an exponent
    ('{"name": "Ada", "extra": {"a": 1, "b": 2}}', True),  # opened by the schema
    ('{"name": "Ada", "any": {"whatever": [1, 2]}}', True),
    ('{"name": "Ada", "both": {"x": 1, "y": 2}}', True),
    ('{"name": "Ada", "tags": [{"k": "v"}, {"k": "w"}]}', True),
])
def test_what_the_grammar_accepts(compiler, text, accepted):
    tokenizer, grammars = compiler
    matcher = grammars.matchers(StructuredOutputsParams(json=PERSON), 1)[0]
    ok = matcher.consume_tokens(tokenizer.encode(text, add_special_tokens=False)) and matcher.is_accepting()
    assert ok == accepted
    if accepted:
        json.loads(text)
