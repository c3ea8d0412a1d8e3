"""One engine config, built from LLM(...) keywords, CLI flags or a deployment file."""

import subprocess
import sys

import pytest

from matrixinfer.config import DEFAULT_MODEL, EngineConfig
from matrixinfer.deployment import load_deployment


def test_expert_parallel_flags_build_an_ep_config_with_prefix_caching():
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("--model", default="m")
    EngineConfig.add_cli_args(p)
    cfg = EngineConfig.from_cli(p.parse_args(["-ep", "2", "-tp", "2", "--dispatch-dtype", "int8", "--microbatches", "2",
                                              "--num-redundant-experts", "2", "--eplb-interval", "50"]))
    par = cfg.parallel
    assert (par.world_size, par.dispatch_dtype, par.microbatches, par.num_redundant_experts, par.eplb_interval) == (
        4, "int8", 2, 2, 50)
    assert cfg.cache.enable_prefix_caching  # a hit is placed on the rank holding its blocks (worker/data_parallel.py)


def test_keywords_land_in_their_sections():
    cfg = EngineConfig.from_kwargs("m", max_num_batched_tokens=512, block_size=8, tensor_parallel_size=2,
                                   kv_transfer_config={"connector": "ems", "ems_controller": "h:1"})
    assert cfg.scheduler.max_num_batched_tokens == 512 and cfg.cache.block_size == 8
    assert cfg.parallel.world_size == 2 and cfg.parallel.executor_kind() == "mp"
    assert cfg.kv_transfer.ems_controller == "h:1"


def test_which_steps_compile():
    """Both steps compile by default; compile_decode=False (a PDC prefill instance) keeps the
    prefill graphs; eager, speculation and expert parallelism compile neither."""
    def on(**kw) -> tuple[bool, bool]:
        cfg = EngineConfig.from_kwargs("m", **kw)
        return cfg.compiles_decode, cfg.compiles_prefill

    assert on(enforce_eager=False) == (True, True)
    assert on(enforce_eager=False, compile_decode=False) == (False, True)
    assert on(enforce_eager=False, compile_prefill=False) == (True, False)
    assert on(enforce_eager=True) == on(enforce_eager=False, expert_parallel_size=2) == (False, False)
    assert on(enforce_eager=False, speculative_config={"method": "mtp", "num_speculative_tokens": 1}) == (False, False)


@pytest.mark.parametrize("kwargs, message", [
    ({"max_batch": 3}, "unknown engine argument"),
    ({"kv_transfer_config": {"connector": "redis"}}, "unknown kv connector"),
    ({"kv_transfer_config": {"connector": "ems"}}, "ems_controller"),
    ({"tensor_parallel_size": 2, "distributed_executor_backend": "uni"}, "in-process executor runs one rank"),
    ({"expert_parallel_size": 2, "dispatch_dtype": "fp8"}, "unknown dispatch_dtype"),
    ({"microbatches": 2}, "need expert_parallel_size > 1"),
    ({"expert_parallel_size": 2, "microbatches": 3}, "1 or 2"),
    ({"num_redundant_experts": 2}, "need expert_parallel_size > 1"),
    ({"expert_parallel_size": 2, "shared_expert_placement": "dedicated", "shared_expert_ranks": 2},
     "shared_expert_ranks < expert_parallel_size"),
])
def test_bad_engine_arguments_are_clear_errors(kwargs, message):
    with pytest.raises((TypeError, ValueError), match=message):
        EngineConfig.from_kwargs("m", **kwargs)


def _write(tmp_path, text):
    path = tmp_path / "deployment.yaml"
    path.write_text(text)
    return path


def test_a_colocated_deployment_file_is_an_engine_config(tmp_path):
    path = _write(tmp_path, f"model: {DEFAULT_MODEL}\ndtype: float32\ncolocated: true\n"
                            "decode:\n  tensor_parallel_size: 2\n")
    roles = EngineConfig.for_roles(load_deployment(path), max_num_seqs=8)
    cfg = roles["decode"]
    assert list(roles) == ["decode"] and cfg.model == DEFAULT_MODEL and cfg.dtype == "float32"
    assert cfg.parallel.tensor_parallel_size == 2 and cfg.scheduler.max_num_seqs == 8


PAPER_LIKE = f"""model: {DEFAULT_MODEL}
colocated: false
prefill:
  instances: 1
  expert_parallel_size: 2
  prefill_parallel: sp-tp-sp
decode:
  instances: 1
  expert_parallel_size: 3
  dispatch_dtype: int8
  num_redundant_experts: 1
  eplb_interval: 200
  microbatches: 2
ems:
  servers: 2
"""


def test_each_pdc_role_runs_the_layout_of_its_own_section(tmp_path):
    """The paper's prefill and decode differ (SP-TP-SP + EP vs wide EP with INT8 dispatch and
    EPLB): each role's engine configuration comes from its section, and its layout line says so."""
    roles = EngineConfig.for_roles(load_deployment(_write(tmp_path, PAPER_LIKE)), max_num_seqs=8)
    pre, dec = roles["prefill"].parallel, roles["decode"].parallel
    assert pre.sequence_parallel and pre.prefill_parallel_size == 2 and pre.expert_parallel_size == 1
    assert (dec.expert_parallel_size, dec.dispatch_dtype, dec.num_redundant_experts, dec.eplb_interval,
            dec.microbatches) == (3, "int8", 1, 200, 2)
    assert roles["decode"].scheduler.max_num_seqs == roles["prefill"].scheduler.max_num_seqs == 8  # the flags fill in
    assert "SP-TP-SP prefill over 2 ranks" in roles["prefill"].layout()
    line = roles["decode"].layout()
    assert "EP3" in line and "dispatch int8" in line and "EPLB every 200 steps" in line and "2 microbatches" in line


@pytest.mark.parametrize("key, value", [
    ("tensor_parallel_size", 2), ("expert_parallel_size", 2), ("dispatch_dtype", "int8"),
    ("speculative_num_tokens", 1), ("num_redundant_experts", 1), ("eplb_interval", 10), ("microbatches", 2),
    ("shared_expert_placement", "dedicated")])
def test_every_decode_key_of_the_file_changes_what_the_instance_runs(tmp_path, key, value):
    """No key is read and then ignored: setting it (on an EP decode role where it needs one)
    changes the decode engine configuration."""
    layout_keys = ("tensor_parallel_size", "expert_parallel_size", "speculative_num_tokens")
    base = {} if key in layout_keys else {"expert_parallel_size": 2}

    def decode(section):
        body = "".join(f"  {k}: {v}\n" for k, v in section.items())
        path = _write(tmp_path, f"model: {DEFAULT_MODEL}\ncolocated: false\nprefill:\n  instances: 1\n"
                                f"decode:\n  instances: 1\n{body}")
        return EngineConfig.for_roles(load_deployment(path))["decode"]

    assert decode({**base, key: value}) != decode(base)


def test_serve_refuses_what_it_cannot_serve_with_a_clear_message(tmp_path):
    path = _write(tmp_path, f"model: {DEFAULT_MODEL}\ncolocated: false\nprefill:\n  instances: 2\n"
                            "decode:\n  instances: 1\n  expert_parallel_size: 2\n  dispatch_dtype: fp8\n")
    r = subprocess.run([sys.executable, "-m", "matrixinfer.cli", "serve", "--deployment", str(path)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "deployment role decode: decode.dispatch_dtype fp8" in r.stderr
