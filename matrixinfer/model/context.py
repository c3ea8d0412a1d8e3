"""Batch metadata for one paged forward step, set by the engine before the model runs.

Deep layers (attention) read it instead of having it threaded through every call, as in
nano-vllm. `None` means the dense (training / reference) path: a [B, T] batch attending
causally within itself, with no cache.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from matrixinfer.parallel.sequence import SequenceShards


@dataclass
class ForwardContext:
    # Tokens are flattened: the first `num_decode_seqs` sequences are decode rows (one token
    # each, or 1 + drafts when speculating), served by the weight-absorbed MLA path; the rest
    # are prefill chunks.
    query_lens: list[int]
    context_lens: list[int]  # tokens in cache for each sequence after this step
    slot_mapping: torch.Tensor  # [num_tokens] flat cache slot of each new token
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int64
    num_decode_seqs: int
    context_lens_tensor: torch.Tensor | None = None  # [num_seqs] on device
    # All sequences decode one token: attention reads only the tensors above (the captured /
    # compiled decode step relies on it; query_lens and context_lens may be empty then).
    decode_only: bool = False
    # SP-TP-SP (parallel/sequence.py): the model runs on this rank's slice of the tokens above;
    # attention gathers all of them for its heads and scatters the result back.
    sp: "SequenceShards | None" = None
    # Speculative verification: decode sequences carry up to Q = decode_query_len queries each
    # (the last token and its drafts). The absorbed path pads them to [S, Q]: decode_pad_index
    # [S*Q] picks each padded query's token (padding repeats a real one), decode_unpad_index
    # [decode tokens] each token's padded place (both None when every row has Q tokens),
    # decode_lens [S, Q] the keys each query sees.
    decode_query_len: int = 1
    decode_pad_index: torch.Tensor | None = None
    decode_unpad_index: torch.Tensor | None = None
    decode_lens: torch.Tensor | None = None
    # Every sequence is a whole prompt with nothing cached before it (no decode rows, no prefix
    # hit, a prompt's first chunk): [S + 1] the offsets of each sequence's tokens. Attention then attends
    # within the step's tokens (MLAttention._attend_fresh), the path a compiled prefill traces.
    prompt_cu_seqlens: torch.Tensor | None = None

    @property
    def num_decode_tokens(self) -> int:
        if self.decode_query_len == 1:
            return self.num_decode_seqs
        return sum(self.query_lens[: self.num_decode_seqs])


_CONTEXT: ForwardContext | None = None


def get_context() -> ForwardContext | None:
    return _CONTEXT


@contextmanager
def forward_context(ctx: ForwardContext | None):
    global _CONTEXT
    prev, _CONTEXT = _CONTEXT, ctx
    try:
        yield ctx
    finally:
        _CONTEXT = prev
