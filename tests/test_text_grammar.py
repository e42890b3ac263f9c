"""Constrained decoding: every reply under a JSON schema or a grammar parses and validates, even from the shipped
tiny model (whose free output is noise); a schema that cannot be enforced is refused in one line; the mask changes
which token is picked, never the model's logits.

The schemas (fixtures/json_schemas.py) bound every string, array, object and
number, so that any path through them ends well inside the 256-token budget; a reply the budget cuts short ends with
``finish_reason`` "length" and is not valid JSON (tested below).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import jsonschema
import numpy as np
import pytest

import colibri_aio
from colibri_aio import SyncEngine
from colibri_aio.errors import UserError
from colibri_aio.text.grammar import GrammarConstraint, GrammarError, Grammars, lark_json
from colibri_aio.text.sampling import log_softmax
from colibri_aio.text.tokenizer import Tokenizer
from support import FIXTURES

sys.path.insert(0, str(FIXTURES))
from json_schemas import SCHEMAS, TOOL_CALL, TOOL_CLOSE, TOOL_OPEN, obj, tool_call_lark  # noqa: E402

MODEL = Path(colibri_aio.__file__).parent / "models" / "colibri-tiny-q8_0.gguf"   # the shipped model
PROMPT = "Reply with JSON:"
BUDGET = 256
SEEDS = (1, 2, 3)


@pytest.fixture(scope="module")
def engine():
    with SyncEngine.open(MODEL, io="pread") as opened:
        yield opened


@pytest.fixture(scope="module")
def grammars(engine) -> Grammars:
    return Grammars(engine.engine.tokenizer)


def reply(engine, constraint: GrammarConstraint, **options) -> tuple[str, str, list]:
    """(text, finish_reason, pieces) of one constrained generation."""
    pieces = list(engine.generate(PROMPT, max_tokens=options.pop("max_tokens", BUDGET), constraint=constraint,
                                  **options))
    return "".join(p.text for p in pieces), pieces[-1].finish_reason, pieces


def test_twenty_schemas() -> None:
    assert len(SCHEMAS) == 20
    for schema in SCHEMAS.values():
        jsonschema.Draft202012Validator.check_schema(schema)


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_every_reply_validates(engine, grammars: Grammars, name: str) -> None:
    schema = SCHEMAS[name]
    for options in ({"temperature": 0.0}, *({"temperature": 1.0, "seed": s} for s in SEEDS)):
        constraint = grammars.json_schema(schema)
        text, finish, _ = reply(engine, constraint, **options)
        assert finish == "stop", (name, options, text)
        assert constraint.done
        jsonschema.validate(json.loads(text), schema)


def test_the_noise_the_mask_holds_back(engine) -> None:
    """The same model unconstrained writes nothing any of the schemas accepts (else the tests above would prove
    nothing)."""
    text = "".join(p.text for p in engine.generate(PROMPT, max_tokens=32))
    assert not any(validates(text, schema) for schema in SCHEMAS.values()), text


def validates(text: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def test_json_object_is_an_object(engine, grammars: Grammars) -> None:
    """``json_object`` bounds nothing, so the tiny model's noise could fill any budget with one long string: a
    logit bias on the closing quote (a user's option, applied before the mask) lets it end; the mask alone makes
    whatever it writes an object."""
    quote = engine.engine.tokenizer.encode('"')[0]
    for seed in SEEDS:
        constraint = grammars.json_schema(None)
        text, finish, _ = reply(engine, constraint, temperature=1.0, seed=seed, logit_bias={quote: 6.0})
        assert finish == "stop", text
        assert isinstance(json.loads(text), dict)


def test_a_budget_too_small_ends_with_length_and_no_json(engine, grammars: Grammars) -> None:
    text, finish, pieces = reply(engine, grammars.json_schema(SCHEMAS["nested"]), max_tokens=5)
    assert finish == "length" and len(pieces) == 5
    assert text.startswith("{")
    with pytest.raises(ValueError):
        json.loads(text)


def test_lark_tool_call_with_a_special_token(engine, grammars: Grammars) -> None:
    """A forced tool call: a special token, a fixed name, arguments under a schema (llguidance's %json)."""
    args = SCHEMAS["flat"]
    grammar = f'start: <|im_start|> "get_weather " args\nargs: {lark_json(args)}'
    for options in ({"temperature": 0.0}, {"temperature": 1.0, "seed": 7}):
        constraint = grammars.lark(grammar)
        text, finish, pieces = reply(engine, constraint, special=True, **options)
        assert finish == "stop" and constraint.done
        assert pieces[0].token == 1 and text.startswith("<|im_start|>get_weather ")
        jsonschema.validate(json.loads(text.removeprefix("<|im_start|>get_weather ")), args)


def test_forced_tool_call_of_three_tools(engine, grammars: Grammars) -> None:
    """The benchmark's tool-call grammar: text markers around one of three tools' calls."""
    for options in ({"temperature": 0.0}, *({"temperature": 1.0, "seed": s} for s in SEEDS)):
        constraint = grammars.lark(tool_call_lark(lark_json(TOOL_CALL)))
        text, finish, _ = reply(engine, constraint, **options)
        assert finish == "stop" and text.startswith(TOOL_OPEN) and text.endswith(TOOL_CLOSE), text
        jsonschema.validate(json.loads(text[len(TOOL_OPEN):-len(TOOL_CLOSE)]), TOOL_CALL)


def test_logits_are_the_models(engine, grammars: Grammars) -> None:
    """The chosen tokens' logprobs and alternatives under a constraint are those of the unconstrained model on the
    same ids (teacher-forced), bit for bit: the mask changes the pick, not the logits."""
    pieces = list(engine.generate(PROMPT, max_tokens=BUDGET, temperature=1.0, seed=11, logprobs=3,
                                  constraint=grammars.json_schema(SCHEMAS["tool_like"])))
    ids = engine.engine.prompt_ids(PROMPT)
    tokens = [p.token for p in pieces]
    rows = engine.logits(ids + tokens[:-1])[len(ids) - 1:]
    for piece, row, token in zip(pieces, rows, tokens, strict=True):
        dist = log_softmax(row)
        assert piece.logprob == float(dist[token])
        assert piece.top_logprobs[0] == (int(np.argmax(dist)), float(dist.max()))
    # The constraint did steer: the unconstrained model would not pick these tokens.
    assert any(int(np.argmax(row)) != token for row, token in zip(rows, tokens))


def test_the_mask_itself(grammars: Grammars) -> None:
    """Before anything: only '{' (and tokens starting with it) for an object; after the closing brace exactly the
    end-of-generation tokens; the logits given are not changed in place."""
    tokenizer = grammars.tokenizer
    constraint = grammars.json_schema(SCHEMAS["const"])
    logits = np.zeros(tokenizer.vocab_size, dtype=np.float32)
    masked = constraint.mask(logits)
    allowed = np.flatnonzero(np.isfinite(masked))
    assert len(allowed) >= 1 and all(tokenizer.token_bytes(int(i)).startswith(b"{") for i in allowed)
    assert np.all(logits == 0)
    for token in tokenizer.encode('{"version": 2, "kind": "event"}'):
        assert not constraint.done
        constraint.accept(token)
    assert constraint.done
    assert set(np.flatnonzero(np.isfinite(constraint.mask(logits)))) == set(tokenizer.eog_ids)


def test_a_wider_logit_row_masks_the_padding(grammars: Grammars) -> None:
    """A model whose output rows outnumber its tokenizer's tokens: the extra rows are never allowed."""
    n = grammars.tokenizer.vocab_size
    masked = grammars.json_schema(None).mask(np.zeros(n + 64))
    assert np.all(np.isneginf(masked[n:])) and np.isfinite(masked[:n]).any()


def test_a_token_the_mask_forbids_is_refused(grammars: Grammars) -> None:
    constraint = grammars.json_schema(SCHEMAS["booleans"])
    with pytest.raises(RuntimeError, match="not allowed"):
        constraint.accept(grammars.tokenizer.encode("x")[0])


@pytest.mark.parametrize("schema, words", [
    ({"type": "string", "format": "no-such-format"}, "Unknown format"),
    (obj({"s": {"type": "string", "pattern": "(a"}}), "unclosed group"),
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}, "missing"),
    ({"type": "integer", "minimum": 5, "maximum": 1}, "minimum (5) is greater than maximum (1)"),
    ({"type": "string", "pattern": "(?=a)b"}, "look-around"),
])
def test_a_schema_that_cannot_compile_is_one_clear_line(grammars: Grammars, schema: dict, words: str) -> None:
    with pytest.raises(GrammarError, match="JSON schema cannot be compiled") as caught:
        grammars.json_schema(schema)
    message = str(caught.value)
    assert isinstance(caught.value, UserError) and "\n" not in message and words in message


def test_strict_refuses_what_it_cannot_enforce_and_lenient_ignores_it(grammars: Grammars) -> None:
    """``uniqueItems`` has no grammar: strict refuses the schema naming the keyword; not strict, the schema compiles
    without it (so a repeated item may come out)."""
    schema = obj({"xs": {"type": "array", "items": {"enum": [1, 2]}, "maxItems": 3, "uniqueItems": True}})
    with pytest.raises(GrammarError, match="uniqueItems"):
        grammars.json_schema(schema, strict=True)
    lenient = grammars.json_schema(schema, strict=False)
    for token in grammars.tokenizer.encode('{"xs": [1, 1]}'):
        lenient.accept(token)
    assert lenient.done


def test_a_grammar_that_cannot_compile(grammars: Grammars) -> None:
    with pytest.raises(GrammarError, match="grammar cannot be compiled"):
        grammars.lark('start: "a" missing_rule')
    with pytest.raises(GrammarError, match="must be an object"):
        grammars.json_schema(["not", "a", "schema"])  # type: ignore[arg-type]


def test_a_tokenizer_without_an_end_cannot_take_grammars(engine) -> None:
    spec = engine.engine.tokenizer.spec
    from dataclasses import replace
    tokens = [t if t not in ("<|endoftext|>", "<|im_end|>") else f"<|gone_{i}|>" for i, t in enumerate(spec.tokens)]
    bare = Tokenizer(replace(spec, tokens=tokens, eos_id=None, eot_id=None, eom_id=None, bos_id=None, pad_id=None))
    with pytest.raises(GrammarError, match="no end-of-generation token"):
        Grammars(bare)
