"""SP-TP-SP prefill across real processes (gloo): the step's tokens cut over the ranks for MLA
stages 1 and 3 and the MoE (experts partitioned, issue 11's dispatch/combine in float32), the
heads split for stage 2. The logits at every position and the whole latent KV cache equal the
single-process model's (float32, 1e-4 relative) on the oracle configs and the bundled model,
for mixed prompt lengths that do not divide by the rank count, a prompt shorter than the rank
count alone, a chunk continuing after its cached prefix, and decode steps after the prefill."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from matrixinfer.config import ModelConfig
from matrixinfer.engine.scheduler import ScheduledRequest
from matrixinfer.model.loader import load_model
from matrixinfer.parallel import expert_partition, get_sp_group
from matrixinfer.parallel.ep_comm import EPDispatcher, set_dispatcher
from matrixinfer.parallel.sequence import shard_sizes
from matrixinfer.parallel.spawn import run_ranks
from matrixinfer.worker.model_runner import ModelRunner
from matrixinfer.worker.sequence_parallel import SequenceParallelRunner
from tests.hf_fixtures import make_checkpoint

BUNDLED = Path(__file__).resolve().parents[2] / "models" / "matrixinfer-tiny-moe"
BLOCK, NUM_BLOCKS, TIMEOUT_S = 4, 40, 180
LENGTHS = (5, 17, 1, 9, 3)  # 35 tokens: divides by neither 2 nor 4


def schedule(vocab: int) -> list[tuple[list[ScheduledRequest], int]]:
    """(requests, num_decode) per step: a mixed prefill of five prompts (the second only its
    first 11 tokens); then every prompt decodes one token while the second prefills its last 6
    after its cached prefix; then a one-token prompt alone; then a decode-only step of all."""
    g = torch.Generator().manual_seed(5)
    toks = [torch.randint(2, vocab, (n + 3,), generator=g).tolist() for n in LENGTHS + (1,)]
    tables = [list(range(6 * i, 6 * i + 6)) for i in range(len(toks))]

    def req(i, start, n):
        return ScheduledRequest(f"r{i}", toks[i][start:start + n], start, tables[i], sample=False)

    first = [req(i, 0, 11 if i == 1 else n) for i, n in enumerate(LENGTHS)]
    second = [req(i, n, 1) for i, n in enumerate(LENGTHS) if i != 1] + [req(1, 11, 6)]
    third = [req(5, 0, 1)]
    fourth = [req(i, n + 1, 1) for i, n in enumerate(LENGTHS) if i != 1] + [req(1, 17, 1), req(5, 1, 1)]
    return [(first, 0), (second, 4), (third, 0), (fourth, 6)]


@torch.no_grad()
def steps(model, runner) -> dict:
    out = {f"logits{k}": model.compute_logits(runner.run(reqs, nd)).numpy()
           for k, (reqs, nd) in enumerate(schedule(model.config.vocab_size))}
    out["kv_cache"] = runner.kv_cache.numpy().copy()
    return out


def single_process(path: Path) -> dict:
    model = load_model(path, dtype="float32")
    return steps(model, ModelRunner(model, NUM_BLOCKS, BLOCK, torch.device("cpu")))


def _rank_main(rank: int, world: int, paths: list[str], microbatches: int) -> dict:
    group = get_sp_group()
    assert (group.rank, group.size) == (rank, world)
    out = {}
    for p in paths:
        cfg = ModelConfig.from_pretrained(p)
        model = load_model(p, dtype="float32", expert_ids=expert_partition(cfg.n_routed_experts, world)[rank])
        owner = [r for r, ids in enumerate(expert_partition(cfg.n_routed_experts, world)) for _ in ids]
        dispatcher = EPDispatcher(group, owner, cfg.num_experts_per_tok, cfg.hidden_size, 64, "float32",
                                  torch.float32)
        set_dispatcher(dispatcher)
        runner = SequenceParallelRunner(model, NUM_BLOCKS, BLOCK, torch.device("cpu"), group, dispatcher,
                                        microbatches)
        assert model.model.layers[0].self_attn.n_heads == cfg.num_attention_heads // world
        out[p] = steps(model, runner)
        out[p]["bytes"] = runner.stats.bytes_sent
    return out


def rel_err(a, b) -> float:
    a, b = torch.as_tensor(a), torch.as_tensor(b)
    return ((a - b).norm() / b.norm()).item()


def check(paths: list[Path], world: int, microbatches: int = 1) -> None:
    torch.set_num_threads(1)
    ranks = run_ranks(_rank_main, world, [str(p) for p in paths], microbatches, sp=world, timeout=TIMEOUT_S)
    for path in paths:
        ref = single_process(path)
        for rank in range(world):
            got = ranks[rank][str(path)]
            assert got["bytes"] > 0
            for key in ref:
                err = rel_err(got[key], ref[key])
                assert err < 1e-4, f"{path.name} rank {rank} {key}: relative error {err:.2e}"


def oracle_and_bundled(tmp_path: Path) -> list[Path]:
    """The bundled model and the four oracle configs: V3 with q LoRA + YaRN + noaux_tc; V3 with
    q_proj from the hidden state and 2 shared experts; V2 greedy (6 experts); V2 group-limited + YaRN."""
    paths = [BUNDLED]
    for variant in ("v3-qlora-yarn", "v3-noqlora", "v2-greedy", "v2-group-limited-yarn"):
        make_checkpoint(tmp_path / variant, variant)
        paths.append(tmp_path / variant)
    return paths


def test_shards_are_contiguous_and_even():
    assert shard_sizes(35, 4) == [9, 9, 9, 8]
    assert shard_sizes(1, 4) == [1, 0, 0, 0]
    assert shard_sizes(6, 2) == [3, 3]


@pytest.mark.slow
def test_two_ranks_equal_one_process_on_oracle_configs_and_the_bundled_model(tmp_path):
    check(oracle_and_bundled(tmp_path), 2)


@pytest.mark.slow
def test_two_microbatches_equal_one_process(tmp_path):
    make_checkpoint(tmp_path / "v3-qlora-yarn", "v3-qlora-yarn")
    check([tmp_path / "v3-qlora-yarn"], 2, microbatches=2)


@pytest.mark.slow
def test_four_ranks_equal_one_process_on_oracle_configs_and_the_bundled_model(tmp_path):
    check(oracle_and_bundled(tmp_path), 4)


ENGINE_KW = dict(dtype="float32", block_size=4, max_num_batched_tokens=24)


def _engine_identical(path, size: int, **kw) -> None:
    """An LLM with prefill_parallel sp-tp-sp (chunked prefill, mixed steps, its decode in the
    same layout continuing from the latents the sequence-parallel prefill wrote, a prefix-cache
    hit) answers greedily token for token what one process answers; its ranks exit with it."""
    from matrixinfer import LLM
    from tests import ranks

    single = LLM(model=path, **ENGINE_KW)
    prompts = ranks.prompts(single.engine.model_config.vocab_size)
    before = ranks.children()
    with LLM(model=path, prefill_parallel="sp-tp-sp", prefill_parallel_size=size, **ENGINE_KW, **kw) as llm:
        assert len(ranks.children() - before) == size
        assert ranks.tokens(llm, prompts) == ranks.tokens(single, prompts)
        assert ranks.tokens(llm, prompts[:1]) == ranks.tokens(single, prompts[:1])  # cached prefix, one request
    assert not (ranks.children() - before)


@pytest.mark.slow
def test_llm_with_sp_tp_sp_prefill_is_token_identical_to_one_process():
    _engine_identical(BUNDLED, 2)


@pytest.mark.slow
def test_sp_tp_sp_with_eplb_rebalancing_every_step_is_token_identical():
    """The SP group's experts under EPLB: two redundant experts, rebalanced every step."""
    _engine_identical(BUNDLED, 2, num_redundant_experts=2, eplb_interval=1, eplb_window=4)


@pytest.mark.slow
def test_llm_with_sp_tp_sp_and_two_microbatches_is_token_identical(tmp_path):
    make_checkpoint(tmp_path / "v3-qlora-yarn", "v3-qlora-yarn")
    _engine_identical(tmp_path / "v3-qlora-yarn", 2, microbatches=2)


def test_prefill_parallel_sets_the_instance_layout():
    from matrixinfer.config import EngineConfig

    sp = EngineConfig.from_kwargs("m", prefill_parallel="sp-tp-sp", prefill_parallel_size=4).parallel
    assert (sp.sequence_parallel, sp.world_size, sp.tensor_parallel_size, sp.expert_parallel_size) == (True, 4, 1, 1)
    tp = EngineConfig.from_kwargs("m", prefill_parallel="tp", prefill_parallel_size=2).parallel
    assert (tp.sequence_parallel, tp.world_size, tp.tensor_parallel_size) == (False, 2, 2)
    dp = EngineConfig.from_kwargs("m", prefill_parallel="dp", prefill_parallel_size=2)
    assert (dp.parallel.expert_parallel_size, dp.cache.enable_prefix_caching) == (2, True)  # hits placed by writer rank
    with pytest.raises(ValueError):
        EngineConfig.from_kwargs("m", prefill_parallel="sp-tp-sp", prefill_parallel_size=2, tensor_parallel_size=2)
    with pytest.raises(ValueError):
        EngineConfig.from_kwargs("m", prefill_parallel_size=2)


def test_prefill_parallel_flags_of_serve_and_generate():
    import argparse

    from matrixinfer.config import EngineConfig

    p = argparse.ArgumentParser()
    p.add_argument("--model", default="m")
    EngineConfig.add_cli_args(p)
    cfg = EngineConfig.from_cli(p.parse_args(["--prefill-parallel", "sp-tp-sp", "--prefill-parallel-size", "2",
                                              "--microbatches", "2"]))
    assert (cfg.parallel.sequence_parallel, cfg.parallel.world_size, cfg.parallel.microbatches) == (True, 2, 2)
