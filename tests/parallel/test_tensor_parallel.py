"""Tensor parallelism across two real processes (gloo): each rank loads its shard of the same
checkpoint, and the logits equal the single-process model's within 1e-4 relative in float32,
on the dense path, through the paged latent cache (prefill chunks, absorbed decode, a mixed
batch) and through the MTP module."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from matrixinfer.model.context import ForwardContext, forward_context
from matrixinfer.model.loader import load_model
from matrixinfer.parallel import get_tp_rank, get_tp_size, tp_all_gather, tp_all_reduce
from matrixinfer.parallel.spawn import run_ranks
from tests.hf_fixtures import make_checkpoint

BUNDLED = Path(__file__).resolve().parents[2] / "models" / "matrixinfer-tiny-moe"
TIMEOUT_S = 120
BLOCK = 4


def paged_steps(model) -> list[torch.Tensor]:
    """Two sequences through a small latent cache: A prefills 8 tokens; then A decodes while B
    prefills a first chunk; then A decodes while B prefills the rest after its cached prefix;
    then both decode. Returns each step's last-token logits."""
    g = torch.Generator().manual_seed(7)
    vocab = model.config.vocab_size
    tokens = [torch.randint(2, vocab, (12,), generator=g).tolist() for _ in range(2)]
    tables = [[0, 1, 2, 3], [4, 5, 6, 7]]
    for attn in model.attention_layers():
        attn.kv_cache = torch.zeros(8, BLOCK, model.config.kv_cache_dim)
    schedule = [[(0, 0, 8)], [(0, 8, 1), (1, 0, 5)], [(0, 9, 1), (1, 5, 4)], [(0, 10, 1), (1, 9, 1)]]
    out = []
    for batch in schedule:  # (sequence, first position, tokens): one-token rows first
        ids, pos, slots = [], [], []
        for s, start, n in batch:
            ids += tokens[s][start:start + n]
            pos += range(start, start + n)
            slots += [tables[s][p // BLOCK] * BLOCK + p % BLOCK for p in range(start, start + n)]
        context_lens = [start + n for _, start, n in batch]
        ctx = ForwardContext(
            query_lens=[n for _, _, n in batch], context_lens=context_lens,
            slot_mapping=torch.tensor(slots), block_tables=torch.tensor([tables[s] for s, _, _ in batch]),
            num_decode_seqs=next((i for i, (_, _, n) in enumerate(batch) if n != 1), len(batch)),
            context_lens_tensor=torch.tensor(context_lens),
        )
        with forward_context(ctx):
            hidden = model(torch.tensor(ids), torch.tensor(pos))
        last = torch.tensor([n for _, _, n in batch]).cumsum(0) - 1
        out.append(model.compute_logits(hidden[last]))
    return out


@torch.no_grad()
def all_logits(path: Path) -> dict[str, torch.Tensor]:
    model = load_model(path, dtype="float32")
    ids = torch.randint(2, model.config.vocab_size, (2, 13), generator=torch.Generator().manual_seed(3))
    pos = torch.arange(13).expand(2, 13)
    hidden = model(ids, pos)
    out = {"dense": model.compute_logits(hidden), "paged": torch.cat(paged_steps(model))}
    if len(model.model.mtp):
        out["mtp"] = model.compute_logits(model.mtp_forward(hidden[:, :-1], ids[:, 1:], pos[:, 1:]))
    return out


def _rank_main(rank: int, world: int, paths: list[str]) -> dict:
    assert (get_tp_rank(), get_tp_size()) == (rank, world)
    assert tp_all_reduce(torch.tensor([rank + 1.0])).item() == sum(range(1, world + 1))
    assert tp_all_gather(torch.tensor([[rank]]), dim=1).tolist() == [list(range(world))]
    return {p: {k: v.numpy() for k, v in all_logits(Path(p)).items()} for p in paths}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.slow
def test_two_ranks_give_the_single_process_logits(tmp_path):
    paths = [BUNDLED]
    for variant in ("v3-qlora-yarn", "v3-noqlora"):  # q_lora + YaRN; q_proj column-parallel, 2 shared experts
        make_checkpoint(tmp_path / variant, variant)
        paths.append(tmp_path / variant)
    torch.set_num_threads(1)
    ranks = run_ranks(_rank_main, 2, [str(p) for p in paths], timeout=TIMEOUT_S)
    for path in paths:
        ref = all_logits(path)
        for rank in (0, 1):
            got = ranks[rank][str(path)]
            assert got.keys() == ref.keys()
            for kind in ref:
                err = rel_err(torch.from_numpy(got[kind]), ref[kind])
                assert err < 1e-4, f"{path.name} rank {rank} {kind}: relative error {err:.2e}"
