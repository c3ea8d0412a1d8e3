"""Grammar masks in the sampler: whatever the logits, a row with a grammar only ever samples
tokens that keep its output inside the grammar, and ends it (xgrammar, the bundled model's
tokenizer; random logits stand in for a model that has never seen JSON)."""

import json

import pytest
import torch

from matrixinfer.config import DEFAULT_MODEL
from matrixinfer.engine.sampling_params import SamplingParams, StructuredOutputsParams
from matrixinfer.tokenizer import Tokenizer
from matrixinfer.worker.sampler import SamplingRow, sample
from matrixinfer.worker.structured_output import GrammarMasks, build_grammar

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "ok": {"type": "boolean"}},
          "required": ["name", "n", "ok"], "additionalProperties": False}


class Row:  # the fields of a ScheduledRequest the masks read
    def __init__(self, rid, params, eos_token_ids):
        self.request_id, self.params, self.output_token_ids, self.eos_token_ids = rid, params, [], eos_token_ids


@pytest.fixture(scope="module")
def tok():
    return Tokenizer(DEFAULT_MODEL)


def _draw(tok, specs, seed, max_tokens=80):
    """Sample rows of `specs` (None: no grammar) from random logits until each ends (eos)."""
    g = torch.Generator().manual_seed(seed)
    masks = GrammarMasks(DEFAULT_MODEL, tok.vocab_size)
    rows = [Row(f"r{i}", SamplingParams(temperature=1.0, structured_outputs=s), (tok.eos_token_id,))
            for i, s in enumerate(specs)]
    live = list(rows)
    for _ in range(max_tokens):
        logits = torch.randn(len(live), tok.vocab_size, generator=g) * 3
        out = sample(logits, [SamplingRow(r.params, [], r.output_token_ids) for r in live], masks.constrain(live))
        for r, t in zip(live, out.token_ids.tolist()):
            r.output_token_ids.append(t)
        live = [r for r in live if r.output_token_ids[-1] != tok.eos_token_id]
        if not live:
            break
    masks.finish([r.request_id for r in rows])
    assert not masks.matchers
    return [tok.decode(r.output_token_ids) for r in rows], live


def test_schema_rows_always_parse_and_validate(tok):
    """20 draws at temperature 1.0 under a schema: each ends and is a JSON object of the
    schema (strict JSON: with xgrammar's own class for maxLength strings this seed drew a raw
    control character); a row without a grammar in the same batch stays unconstrained."""
    spec = StructuredOutputsParams(json=json.dumps(SCHEMA))
    texts, unfinished = _draw(tok, [spec] * 20 + [None], seed=0)
    assert unfinished == [] or [r.request_id for r in unfinished] == ["r20"]
    for text in texts[:20]:
        obj = json.loads(text)
        assert set(obj) == {"name", "n", "ok"} and len(obj["name"]) <= 6 and 0 <= obj["n"] <= 99
        assert isinstance(obj["ok"], bool)
    with pytest.raises(json.JSONDecodeError):
        json.loads(texts[20])


def test_choice_regex_and_suffix(tok):
    """A choice is one of its strings; a regex matches; a suffix follows the structure."""
    import re

    specs = [StructuredOutputsParams(choice=("yes", "no")), StructuredOutputsParams(regex=r"[a-c]{2,4}-[0-9]"),
             StructuredOutputsParams(json='{"type": "object", "properties": {}, "additionalProperties": false}',
                                     suffix="\n```END")]
    for seed in range(3):
        texts, unfinished = _draw(tok, specs, seed=seed)
        assert not unfinished and texts[0] in ("yes", "no") and re.fullmatch(r"[a-c]{2,4}-[0-9]", texts[1])
        assert texts[2] == "{}\n```END"


def test_malformed_specs_raise():
    """A bad schema, regex or grammar fails when built (the API turns that into a 400)."""
    for spec in (StructuredOutputsParams(json='{"type": "objekt"}'), StructuredOutputsParams(regex="(ab"),
                 StructuredOutputsParams(grammar="root ::= ")):
        with pytest.raises(RuntimeError):
            build_grammar(spec)
    with pytest.raises(ValueError):
        StructuredOutputsParams(json="{}", regex="a")


def test_grammar_rows_never_take_the_argmax_shortcut():
    """A request with a grammar is not given the compiled step's greedy pick, multi-step
    decode or speculation: its sampling depends on more than the logits."""
    p = SamplingParams(temperature=0, structured_outputs=StructuredOutputsParams(json_object=True))
    assert not p.takes_argmax(5) and not p.logits_alone(5)


def test_accepted_tokens_are_read_before_the_output(tok):
    """A decode instance continuing a prefill instance's first token gets it in its prompt, and
    `accepted` with it: the grammar goes on from there (not from its start: that wrote "{{")."""
    first = tok.encode("y", add_special_tokens=False)
    spec = StructuredOutputsParams(choice=("yes", "no"), accepted=tuple(first))
    for seed in range(3):
        texts, unfinished = _draw(tok, [spec], seed=seed)
        assert not unfinished and "y" + texts[0] == "yes"
