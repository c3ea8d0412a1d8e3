"""One completions request, several engine requests: a batch of prompts (`prompt` as a list)
and `best_of` generate more than one sequence group; the API sees them as one output.

Choices are numbered as OpenAI does: prompt i's choices are i*n .. i*n+n-1. `best_of`
keeps, per prompt, the n choices with the highest cumulative log probability.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

from matrixinfer.frontend.outputs import RequestOutput


def merge_outputs(request_id: str, outs: list[RequestOutput]) -> RequestOutput:
    """The latest outputs of each prompt's request as one output (usage counts all prompts)."""
    choices = [replace(c, index=i * len(o.outputs) + c.index) for i, o in enumerate(outs) for c in o.outputs]
    firsts = [o.metrics["first_token_time"] for o in outs if o.metrics.get("first_token_time") is not None]
    return RequestOutput(request_id, None, [t for o in outs for t in o.prompt_token_ids], choices,
                         all(o.finished for o in outs), sum(o.num_cached_tokens for o in outs),
                         metrics={"first_token_time": min(firsts)} if firsts else {})


async def merged(request_id: str, streams: list):
    """Merged outputs of several engine streams, a new one whenever any of them advances.
    Errors of a stream's first output (the engine refusing it) come out of the first
    `anext`; closing this closes (aborts) every stream."""
    lasts, pending = [], {}
    try:
        for s in streams:
            lasts.append(await anext(s))
        yield merge_outputs(request_id, lasts)
        pending = {asyncio.ensure_future(anext(s)): i for i, s in enumerate(streams) if not lasts[i].finished}
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                i = pending.pop(task)
                lasts[i] = task.result()
                if not lasts[i].finished:
                    pending[asyncio.ensure_future(anext(streams[i]))] = i
            yield merge_outputs(request_id, lasts)
    finally:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)  # a generator mid-anext cannot be closed
        for s in streams:
            await s.aclose()


def best_of(out: RequestOutput, generated: int, n: int) -> RequestOutput:
    """Per prompt, of its `generated` choices the n with the highest cumulative logprob."""
    choices = []
    for start in range(0, len(out.outputs), generated):
        group = sorted(out.outputs[start:start + generated], key=lambda c: c.cumulative_logprob or 0.0, reverse=True)
        choices += [replace(c, index=len(choices) + j) for j, c in enumerate(group[:n])]
    return replace(out, outputs=choices)
