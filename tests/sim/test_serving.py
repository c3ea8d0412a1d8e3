"""The SimPy PDC simulation against queueing theory and the cost model."""

import random

import pytest

from matrixinfer.sim.decode import DecodeConfig, decode_step
from matrixinfer.sim.hardware import load_hardware
from matrixinfer.sim.modelspec import load_model
from matrixinfer.sim.serving import (CostModelTimes, EMSPool, Request, ServingConfig, load_trace,
                                     poisson_requests, simulate)

ONE_SERVER = ServingConfig(prefill_instances=1, decode_instances=0, prefill_max_requests=1)


def test_mm1_mean_sojourn():
    """M/M/1 with lambda 0.5, mu 1 (seeded, 20,000 customers): mean time in system 1/(mu - lambda) = 2 within 5 %."""
    reqs = poisson_requests(0.5, 20000, 1, 1, seed=1)
    rng = random.Random(2)
    simulate(reqs, ONE_SERVER, lambda batch: rng.expovariate(1.0), lambda n, kv: 0.0)
    mean = sum(r.ttft for r in reqs) / len(reqs)
    assert mean == pytest.approx(2.0, rel=0.05)


def test_md1_mean_sojourn():
    """M/D/1 with lambda 0.8, service 1 (seeded): Pollaczek-Khinchine W = 1 + rho/(2(1-rho)) = 3 within 7 %."""
    reqs = poisson_requests(0.8, 20000, 1, 1, seed=3)
    simulate(reqs, ONE_SERVER, lambda batch: 1.0, lambda n, kv: 0.0)
    mean = sum(r.ttft for r in reqs) / len(reqs)
    assert mean == pytest.approx(3.0, rel=0.07)


def test_single_request_tpot_is_the_step_time():
    """One request, MTP off: every decode step emits one token, so TPOT = the cost model's step time."""
    hw, model = load_hardware("cloudmatrix384"), load_model("deepseek-r1")
    cfg = ServingConfig(prefill_instances=1, decode_instances=1, decode_devices=320, mtp_drafts=0)
    times = CostModelTimes(hw, model, cfg)
    req = Request(0, 0.0, 1024, 65)
    simulate([req], cfg, times.prefill_time, times.decode_time)
    steps = [decode_step(hw, model, DecodeConfig(1, kv, ep=320, mtp_drafts=0)).step_ms
             for kv in range(1024 + 1, 1024 + 65)]
    expected = sum(times.decode_time(1, 1024 + g) for g in range(1, 65)) / 64
    assert req.tpot == pytest.approx(expected, rel=1e-9)
    assert req.tpot * 1e3 == pytest.approx(sum(steps) / len(steps), rel=0.02)


def test_mtp_shortens_tpot_in_the_simulation():
    """Same load, MTP 1 draft at 70 %: mean TPOT falls by roughly the 1.7 tokens per step."""
    hw, model = load_hardware("cloudmatrix384"), load_model("deepseek-r1")
    out = {}
    for k in (0, 1):
        cfg = ServingConfig(prefill_instances=1, decode_instances=1, mtp_drafts=k, seed=4)
        t = CostModelTimes(hw, model, cfg)
        reqs = poisson_requests(5.0, 60, 512, 128, seed=5)
        out[k] = simulate(reqs, cfg, t.prefill_time, t.decode_time).summary()["tpot_mean_ms"]
    assert out[0] / out[1] == pytest.approx(1.7, rel=0.15)


def test_all_requests_finish_and_ttft_positive():
    """A loaded PDC run finishes every request; TTFT > 0 and utilisation samples stay in [0, 1]."""
    hw, model = load_hardware("cloudmatrix384"), load_model("deepseek-r1")
    cfg = ServingConfig(prefill_instances=2, decode_instances=1, decode_devices=32, ems_capacity_tokens=10**6)
    t = CostModelTimes(hw, model, cfg)
    reqs = poisson_requests(20.0, 300, lambda r: r.randint(256, 2048), 64, seed=6, prefixes=10, prefix_len=256)
    res = simulate(reqs, cfg, t.prefill_time, t.decode_time, t.kv_bytes_per_token())
    s = res.summary()
    assert s["finished"] == 300
    assert min(r.ttft for r in reqs) > 0
    assert all(0 <= u["decode_batch_fill"] <= 1 and 0 <= u["prefill_busy"] <= 1 for u in res.utilisation)
    assert res.ems_hit_rate > 0.5  # 10 prefixes, 300 requests: almost all hit after the first of each


def test_ems_pool_is_lru():
    """Capacity for two prefixes: touching p0 keeps it, inserting p2 evicts p1."""
    pool = EMSPool(200)
    reqs = [Request(i, 0, 200, 1, f"p{i}", 100) for i in range(3)]
    pool.insert(reqs[0])
    pool.insert(reqs[1])
    assert pool.lookup(reqs[0]) == 100
    pool.insert(reqs[2])
    assert pool.lookup(reqs[1]) == 0 and pool.lookup(reqs[0]) == 100 and pool.lookup(reqs[2]) == 100


def test_trace_file(tmp_path):
    """A CSV trace is read in arrival order; a bad row names its line."""
    p = tmp_path / "t.csv"
    p.write_text("arrival,prompt_len,output_len,prefix_id,prefix_len\n2.0,100,10,a,50\n1.0,200,20,,\n")
    reqs = load_trace(p)
    assert [r.arrival for r in reqs] == [1.0, 2.0] and reqs[1].prefix_id == "a" and reqs[0].prefix_id is None
    p.write_text("arrival,prompt_len,output_len\n1.0,x,3\n")
    with pytest.raises(ValueError, match="row 2"):
        load_trace(p)


def test_chunked_prefill_splits_a_long_prompt_into_steps():
    """Chunks of 100 tokens, 1 s per step: a 250-token prompt has its first token after 3 steps;
    a 50-token prompt behind it rides in the third step's spare budget (TTFT 3 s, not 4)."""
    cfg = ServingConfig(prefill_instances=1, decode_instances=1, prefill_chunk_tokens=100)
    steps = []

    def prefill(pieces):
        steps.append([(c.req.rid, c.prompt_len, c.prefix_done) for c in pieces])
        return 1.0

    reqs = [Request(0, 0.0, 250, 1), Request(1, 0.0, 50, 1)]
    simulate(reqs, cfg, prefill, lambda n, kv: 1.0)
    assert steps == [[(0, 100, 0)], [(0, 100, 100)], [(0, 50, 200), (1, 50, 0)]]
    assert (reqs[0].ttft, reqs[1].ttft) == (3.0, 3.0)


def test_chunk_is_costed_with_its_prefix_in_hbm():
    """A chunk after a prefilled prefix costs more than the same tokens alone (it attends over
    the prefix) and less than the whole prompt."""
    hw, model = load_hardware("cloudmatrix384"), load_model("deepseek-r1")
    cfg = ServingConfig(prefill_instances=1, decode_instances=1)
    t = CostModelTimes(hw, model, cfg)
    from matrixinfer.sim.serving import Chunk

    req = Request(0, 0.0, 65536 * 2, 1)
    chunk = t.prefill_time([Chunk(req, 65536, 65536)])
    alone = t.prefill_time([Request(1, 0.0, 65536, 1)])
    whole = t.prefill_time([req])
    assert alone < chunk < whole
