"""Model cache: one copy in the pool, one read of the slow source, for several loaders."""

import os
import threading
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from matrixinfer.ems.model_cache import CHUNK, ModelCache, ThrottledSource, load_direct


@pytest.fixture
def checkpoint(tmp_path):
    d = tmp_path / "ckpt"
    d.mkdir()
    g = torch.Generator().manual_seed(0)
    save_file({"a.weight": torch.randn(1024, 1536, generator=g), "b.bias": torch.randn(7, generator=g).to(torch.bfloat16)}, str(d / "model-00001.safetensors"))
    save_file({"c.weight": torch.randint(-128, 127, (3 << 20,), dtype=torch.int8, generator=g)}, str(d / "model-00002.safetensors"))
    (d / "config.json").write_text('{"hidden_size": 1536}')
    return str(d)


@pytest.mark.pool(n_servers=2, dram_bytes=32 << 20)
def test_three_concurrent_loaders_read_the_source_once_and_share_one_copy(fresh_pool, client_factory, checkpoint):
    """Three instances load at once: the source is read exactly once in total, the pool holds
    exactly one copy, and every instance gets tensors equal to the checkpoint."""
    source = ThrottledSource(checkpoint, bytes_per_s=100e6)
    total = sum(source.files().values())
    results = [None] * 3

    def instance(i):
        mc = ModelCache(client_factory(fresh_pool, "models"), source)
        results[i] = mc.load()
        mc.close()

    threads = [threading.Thread(target=instance, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert source.bytes_read == total
    assert sum(r[1].bytes_from_source for r in results) == total
    stats = client_factory(fresh_pool, "models").stats()
    assert sum(s["ns_ssd_bytes"].get("models", 0) for s in stats.values()) == total
    want = {**load_file(os.path.join(checkpoint, "model-00001.safetensors")), **load_file(os.path.join(checkpoint, "model-00002.safetensors"))}
    for tensors, _ in results:
        assert tensors.keys() == want.keys()
        assert all(torch.equal(tensors[k], want[k]) for k in want)


@pytest.mark.pool(n_servers=1, dram_bytes=32 << 20)
def test_a_warm_pool_serves_later_instances_without_the_source(fresh_pool, client_factory, checkpoint):
    """Once loaded, a new instance reads nothing from the source and beats the throttled read."""
    source = ThrottledSource(checkpoint, bytes_per_s=20e6)
    ModelCache(client_factory(fresh_pool, "m"), source).load()
    before = source.bytes_read
    t0 = time.perf_counter()
    _, report = ModelCache(client_factory(fresh_pool, "m"), source).load()
    assert source.bytes_read == before and report.bytes_from_pool == report.bytes_total
    assert time.perf_counter() - t0 < report.bytes_total / 20e6


def test_throttled_source_caps_bandwidth(checkpoint):
    """Reading the checkpoint at 40 MB/s takes at least size / 40 MB/s (it is a real cap)."""
    source = ThrottledSource(checkpoint, bytes_per_s=40e6)
    _, report = load_direct(source)
    assert report.seconds >= 0.9 * report.bytes_total / 40e6
    assert report.bytes_total > CHUNK  # several chunks, read in parallel under one cap


@pytest.mark.pool(n_servers=1, dram_bytes=32 << 20)
def test_model_load_cli_fills_the_pool_once(fresh_pool, checkpoint):
    """`matrixinfer ems model-load` run twice: the first reads the checkpoint from the source,
    the second reads nothing from it."""
    import json
    import subprocess
    import sys

    def run():
        p = subprocess.run([sys.executable, "-m", "matrixinfer.ems", "model-load", "--controller", fresh_pool.controller,
                            "--model", checkpoint, "--bandwidth-mbps", "200"], capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stderr
        return json.loads(p.stdout.strip().splitlines()[-1])

    first, second = run(), run()
    assert first["bytes_from_source"] == first["bytes_total"] > 0
    assert second["bytes_from_source"] == 0 and second["bytes_from_pool"] == second["bytes_total"]
