"""kvrun.engine.grammar: JSON-schema grammars on the tiny model's byte-level vocabulary (259
tokens): each sequence's state its own, a schema that cannot be served and a missing library
each one line."""
import pytest
import torch

llguidance = pytest.importorskip("llguidance")

import kvrun  # noqa: E402
from kvrun.engine import grammar as grammar_mod  # noqa: E402

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


def test_states_of_one_grammar_are_independent(tiny):
    g = tiny.grammars.json_schema(PERSON)
    a, b = g.start(), g.start()
    fresh = a.allowed()
    assert fresh.shape == (tiny.cfg.vocab_size,) and fresh[tiny.tokenizer.encode("{")[0]]
    for t in tiny.tokenizer.encode('{"name": "Al'):
        assert a.allowed()[t]
        a.accept(t)
    assert not torch.equal(a.allowed(), fresh)
    assert torch.equal(b.allowed(), fresh) and torch.equal(g.start().allowed(), fresh)
    with pytest.raises(kvrun.KvrunError, match="rejected"):
        b.accept(tiny.tokenizer.encode("x")[0])            # not how a JSON object starts


@pytest.mark.parametrize("schema,why", [
    ({"type": "foo"}, "Invalid type"), ({"not": {"type": "string"}}, "not"),
    ({"type": "string", "pattern": "(("}, "regex"),
    ({"type": "integer", "minimum": 5, "maximum": 1}, "Unsatisfiable"),
    ({"$ref": "#/$defs/missing"}, "missing"), ({"type": "string", "format": "weird"}, "format"),
    ({"properties": []}, "properties"), ([1], "object"), ("{not json", "not valid JSON"),
    # $ref cycles compiled, then failed at the first token (a 500 dumping the parser state)
    ({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
     "cycle"), ({"$ref": "#"}, "cycle")])
def test_bad_schema_is_one_line_error(tiny, schema, why):
    with pytest.raises(kvrun.KvrunError, match="schema") as e:
        tiny.generate("a", 4, json_schema=schema)
    assert why in str(e.value) and "\n" not in str(e.value) and "<state>" not in str(e.value)


def test_without_the_library_is_one_line_error(tiny, monkeypatch):
    monkeypatch.setattr(grammar_mod, "llguidance", None)
    with pytest.raises(kvrun.KvrunError, match=r"llguidance.*kvrun\[server\]"):
        tiny.generate("a", 4, json_schema={"type": "object"})
    assert tiny.generate("a", 4) is not None            # unconstrained generation still runs
