"""Owns the model and its paged latent KV cache on one device; turns a scheduled batch into
tensors, runs one forward step and returns next-token logits for sequences that sample."""

from __future__ import annotations

import torch

from matrixinfer.engine.sequence import Sequence
from matrixinfer.model.context import ForwardContext, forward_context
from matrixinfer.model.deepseek import DeepseekForCausalLM


class ModelRunner:
    def __init__(self, model: DeepseekForCausalLM, num_blocks: int, block_size: int, device: torch.device):
        self.model, self.device, self.block_size = model, device, block_size
        cfg = model.config
        dtype = model.lm_head.weight.dtype  # the model dtype (the router alone stays float32)
        layers = model.attention_layers()
        # One tensor for all layers: [layers, blocks, block_size, kv_lora_rank + rope]
        self.kv_cache = torch.zeros(len(layers), num_blocks, block_size, cfg.kv_cache_dim, dtype=dtype, device=device)
        for i, attn in enumerate(layers):
            attn.kv_cache = self.kv_cache[i]

    @staticmethod
    def cache_bytes_per_block(model: DeepseekForCausalLM, block_size: int, dtype: torch.dtype) -> int:
        n_layers = len(model.attention_layers())
        return n_layers * block_size * model.config.kv_cache_dim * torch.finfo(dtype).bits // 8

    def _prepare(self, seqs: list[Sequence], num_tokens: list[int]):
        input_ids, positions, slots, query_lens, context_lens = [], [], [], [], []
        for seq, n in zip(seqs, num_tokens):
            start = seq.num_computed_tokens
            tokens = seq.all_token_ids[start:start + n]
            input_ids += tokens
            positions += range(start, start + n)
            for pos in range(start, start + n):
                slots.append(seq.block_table[pos // self.block_size] * self.block_size + pos % self.block_size)
            query_lens.append(n)
            context_lens.append(start + n)
        # the scheduler puts one-token queries first: they take the batched absorbed path
        num_decode = next((i for i, n in enumerate(query_lens) if n != 1), len(query_lens))
        max_blocks = max(len(s.block_table) for s in seqs)
        tables = [s.block_table + [0] * (max_blocks - len(s.block_table)) for s in seqs]
        dev = self.device
        ctx = ForwardContext(
            query_lens=query_lens,
            context_lens=context_lens,
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            block_tables=torch.tensor(tables, dtype=torch.long, device=dev),
            num_decode_seqs=num_decode,
            context_lens_tensor=torch.tensor(context_lens, dtype=torch.long, device=dev),
        )
        ids = torch.tensor(input_ids, dtype=torch.long, device=dev)
        pos = torch.tensor(positions, dtype=torch.long, device=dev)
        return ids, pos, ctx

    @torch.inference_mode()
    def run(self, seqs: list[Sequence], num_tokens: list[int], sample_mask: list[bool]) -> torch.Tensor | None:
        """One forward step. Returns logits [num sampling seqs, vocab] for seqs with sample_mask."""
        ids, pos, ctx = self._prepare(seqs, num_tokens)
        with forward_context(ctx):
            hidden = self.model(ids, pos)
        last = torch.tensor(num_tokens, device=self.device).cumsum(0) - 1
        last = last[torch.tensor(sample_mask, device=self.device)]
        if last.numel() == 0:
            return None
        return self.model.compute_logits(hidden[last])
