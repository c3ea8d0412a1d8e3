"""Token masks for structured outputs (SamplingParams.structured_outputs), with xgrammar.

One grammar matcher per request, on the rank that samples. A request's matcher is advanced by
its output tokens so far (the scheduler sends them with every step that samples it), so it
follows whatever produced them: this rank's earlier steps, or the prefill instance that
sampled the first token before a decode instance took the request over. Rows with a grammar
take the sampler path (SamplingParams.takes_argmax is false for them), never the compiled
step's in-graph greedy pick or a multi-step run, and are not speculated.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from matrixinfer.engine.sampling_params import StructuredOutputsParams


def _ebnf_literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)  # xgrammar's EBNF strings take JSON's escapes


# xgrammar 0.2.9 writes the characters of a string with minLength / maxLength as this class,
# which lets raw control characters (U+0000-U+001F) in, and JSON forbids them: the class its
# other strings use replaces it
_LOOSE_STRING_CHAR, _JSON_STRING_CHAR = r'[^\"\\\r\n]', r'[^\0-\x1f\"\\]'


def _json(schema: str):
    import xgrammar as xgr

    g = xgr.Grammar.from_json_schema(schema, any_whitespace=False)
    text = str(g)
    if _LOOSE_STRING_CHAR not in text:
        return g
    return xgr.Grammar.from_ebnf(text.replace(_LOOSE_STRING_CHAR, _JSON_STRING_CHAR))


def build_grammar(spec: StructuredOutputsParams):
    """The xgrammar Grammar of `spec` (raises on a malformed schema, regex or grammar). JSON is
    compact (no free whitespace: a model cannot pad it forever)."""
    import xgrammar as xgr

    if spec.json is not None:
        g = _json(spec.json)
    elif spec.json_object:
        g = _json('{"type": "object"}')
    elif spec.regex is not None:
        g = xgr.Grammar.from_regex(spec.regex)
    elif spec.choice is not None:
        g = xgr.Grammar.from_ebnf("root ::= " + " | ".join(_ebnf_literal(c) for c in spec.choice))
    elif spec.alternatives is not None:
        g = xgr.Grammar.union(*[xgr.Grammar.concat(xgr.Grammar.from_ebnf("root ::= " + _ebnf_literal(prefix)),
                                                   _json(schema))
                                for prefix, schema in spec.alternatives])
    else:
        g = xgr.Grammar.from_ebnf(spec.grammar)
    if spec.suffix:
        g = xgr.Grammar.concat(g, xgr.Grammar.from_ebnf("root ::= " + _ebnf_literal(spec.suffix)))
    return g


class GrammarMasks:
    """Matchers of the requests with a grammar and the masks of their next tokens."""

    def __init__(self, model_dir: str | Path, vocab_size: int):
        self.model_dir, self.vocab_size = model_dir, vocab_size
        self._compiler = None  # built on the first grammar (importing xgrammar costs seconds)
        self.matchers: dict[str, tuple[object, int]] = {}  # request id -> (matcher, tokens accepted)

    def _compile(self, spec: StructuredOutputsParams):
        import xgrammar as xgr

        if self._compiler is None:  # the vocabulary as xgrammar reads it (from tokenizer.json alone)
            from transformers import PreTrainedTokenizerFast

            from matrixinfer.tokenizer import Tokenizer

            tok = PreTrainedTokenizerFast(tokenizer_file=str(Path(self.model_dir) / "tokenizer.json"))
            eos = Tokenizer(self.model_dir).eos_token_id  # a default only: matchers end on their request's ids
            info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=self.vocab_size,
                                                      stop_token_ids=None if eos is None else [eos])
            self._compiler = xgr.GrammarCompiler(info)
        return self._compiler.compile_grammar(build_grammar(spec))

    def _matcher(self, r):
        """r's matcher, advanced over its output so far. Its end is the request's own
        end-of-sequence ids (the tokens that finish it in the engine)."""
        import xgrammar as xgr

        spec, output = r.params.structured_outputs, r.output_token_ids or []
        matcher, done = self.matchers.get(r.request_id) or (
            xgr.GrammarMatcher(self._compile(spec), override_stop_tokens=list(r.eos_token_ids) or None), 0)
        output = [*spec.accepted, *output]
        for t in output[done:]:
            if not matcher.is_terminated():
                matcher.accept_token(t)  # False only for tokens sampled without this mask: skipped
        self.matchers[r.request_id] = (matcher, len(output))
        return matcher

    def constrain(self, reqs) -> "callable | None":
        """For the rows of `reqs` (ScheduledRequests that sample) with a grammar: a function
        that sets the logits of their forbidden tokens to -inf in place; None without any."""
        rows = [(i, r) for i, r in enumerate(reqs) if r.params.structured_outputs is not None]
        if not rows:
            return None
        import xgrammar as xgr

        live = []
        for i, r in rows:
            m = self._matcher(r)
            if not m.is_terminated():  # past the end (ignore_eos) the text is free
                live.append((i, m))
        if not live:
            return None
        bitmask = xgr.allocate_token_bitmask(len(reqs), self.vocab_size)
        for i, m in live:
            m.fill_next_token_bitmask(bitmask, i)

        def apply(logits: torch.Tensor) -> None:
            xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=[i for i, _ in live])
        return apply

    def finish(self, request_ids) -> None:
        for rid in request_ids:
            self.matchers.pop(rid, None)
