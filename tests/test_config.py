"""One engine config, built from LLM(...) keywords, CLI flags or a deployment file."""

import subprocess
import sys

import pytest

from matrixinfer.config import DEFAULT_MODEL, EngineConfig
from matrixinfer.deployment import load_deployment


def test_keywords_land_in_their_sections():
    cfg = EngineConfig.from_kwargs("m", max_num_batched_tokens=512, block_size=8, tensor_parallel_size=2,
                                   kv_transfer_config={"connector": "ems", "ems_controller": "h:1"})
    assert cfg.scheduler.max_num_batched_tokens == 512 and cfg.cache.block_size == 8
    assert cfg.parallel.world_size == 2 and cfg.parallel.executor_kind() == "mp"
    assert cfg.kv_transfer.ems_controller == "h:1"


@pytest.mark.parametrize("kwargs, message", [
    ({"max_batch": 3}, "unknown engine argument"),
    ({"kv_transfer_config": {"connector": "redis"}}, "unknown kv connector"),
    ({"kv_transfer_config": {"connector": "ems"}}, "ems_controller"),
    ({"tensor_parallel_size": 2, "distributed_executor_backend": "uni"}, "in-process executor runs one rank"),
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
    cfg = EngineConfig.from_deployment(load_deployment(path), max_num_seqs=8)
    assert cfg.model == DEFAULT_MODEL and cfg.dtype == "float32"
    assert cfg.parallel.tensor_parallel_size == 2 and cfg.scheduler.max_num_seqs == 8


def test_a_pdc_deployment_gives_every_instance_one_config(tmp_path):
    path = _write(tmp_path, f"model: {DEFAULT_MODEL}\ncolocated: false\nprefill:\n  instances: 2\n"
                            "decode:\n  instances: 1\n")
    cfg = EngineConfig.from_deployment(load_deployment(path))
    assert cfg.parallel.world_size == 1


def test_serve_refuses_what_it_cannot_serve_with_a_clear_message(tmp_path):
    path = _write(tmp_path, f"model: {DEFAULT_MODEL}\ncolocated: false\nprefill:\n  instances: 2\n"
                            "  prefill_parallel: sp-tp-sp\ndecode:\n  instances: 1\n")
    r = subprocess.run([sys.executable, "-m", "matrixinfer.cli", "serve", "--deployment", str(path)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "only dp is served yet" in r.stderr
