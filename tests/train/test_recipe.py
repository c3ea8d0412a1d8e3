"""The training recipe: deterministic given the seed, lowers the loss, balances experts by
the aux-loss-free bias update; the held-out split is fixed and disjoint from training."""

import torch

from matrixinfer.model.moe import Router
from matrixinfer.train import corpus, tiny

SMALL = dict(hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
             num_attention_heads=2, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
             v_head_dim=8, max_position_embeddings=64)


def small_run(seed: int, steps: int = 8):
    cfg = tiny.hf_config(64, **SMALL)
    model = tiny.build_model(cfg, seed)
    stream = (torch.arange(4000) * 7 % 61) + 3  # a periodic sequence: learnable in a few steps
    tc = tiny.TrainConfig(seed=seed, steps=steps, batch_size=4, seq_len=32, lr=1e-2, warmup_steps=2,
                          eval_every=1000, threads=1)
    log = tiny.train(model, stream, tc, progress=False)
    return model, log


def test_training_is_deterministic_given_the_seed_and_lowers_the_loss():
    m1, log1 = small_run(seed=3)
    m2, log2 = small_run(seed=3)
    assert [e["loss"] for e in log1] == [e["loss"] for e in log2]
    assert [e["mtp_loss"] for e in log1] == [e["mtp_loss"] for e in log2]
    for (n, a), b in zip(m1.state_dict().items(), m2.state_dict().values()):
        assert torch.equal(a, b), n
    assert log1[-1]["loss"] < log1[0]["loss"] - 0.5
    assert log1[-1]["mtp_loss"] < log1[0]["mtp_loss"] - 0.5


def test_a_different_seed_gives_a_different_run():
    _, log1 = small_run(seed=3, steps=2)
    _, log2 = small_run(seed=4, steps=2)
    assert log1[0]["loss"] != log2[0]["loss"]


def test_every_parameter_is_initialized():
    model = tiny.build_model(tiny.hf_config(64, **SMALL), seed=0)
    for name, p in model.named_parameters():
        assert torch.isfinite(p).all(), name
        assert p.abs().max() < 1.5, name  # no leftovers of torch.empty
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            assert torch.equal(b, torch.zeros_like(b)), name


def test_bias_update_raises_underloaded_and_lowers_overloaded_experts():
    bias = torch.zeros(4)
    tiny.update_bias(bias, torch.tensor([10, 0, 5, 5]), speed=0.01)
    assert torch.allclose(bias, torch.tensor([-0.01, 0.01, 0.0, 0.0]))


def test_bias_updates_even_out_a_skewed_router():
    cfg = tiny.hf_config(64, **SMALL)
    model = tiny.build_model(cfg, seed=0)
    router = next(m for m in model.modules() if isinstance(m, Router))
    with torch.no_grad():
        router.weight[0] += 0.5  # expert 0 wins for most tokens
    x = torch.randn(512, cfg["hidden_size"], generator=torch.Generator().manual_seed(0))
    load = lambda: torch.bincount(router(x)[1].flatten(), minlength=router.n_experts).float()  # noqa: E731
    before = load()
    for _ in range(200):
        tiny.update_bias(router.e_score_correction_bias, load(), speed=0.01)
    after = load()
    assert after.max() / after.mean() < before.max() / before.mean()
    assert router.e_score_correction_bias[0] < 0


def test_heldout_files_are_a_fixed_list_disjoint_from_training():
    held = corpus.read_heldout_list()
    assert len(held) >= 20 and len(set(held)) == len(held)
    train, held_present = corpus.split()
    assert set(train).isdisjoint(held_present)
    assert len(held_present) >= 0.9 * len(held)  # the list names files of this stdlib


def test_corpus_excludes_tests_idle_and_third_party_code():
    files = corpus.corpus_files()
    assert "os.py" in files and "json/decoder.py" in files
    for f in files:
        parts = f.split("/")
        assert not {"test", "tests", "idlelib", "site-packages"} & set(parts), f


def test_cli_has_train_tiny_and_eval_tiny_with_the_shipped_defaults():
    import argparse

    from matrixinfer.train import cli

    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers(dest="command"), None)
    args = parser.parse_args(["train-tiny", "--steps", "3"])
    assert args.steps == 3 and args.seq_len == tiny.TrainConfig().seq_len and args.out == str(tiny.DEFAULT_OUT)
    assert parser.parse_args(["eval-tiny"]).model == str(tiny.DEFAULT_OUT)
