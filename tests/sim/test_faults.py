"""Failures in the PDC simulation against closed forms (sim/faults.py, sim/serving.py)."""

import pytest

from matrixinfer.sim.fault_study import Load, Study, run
from matrixinfer.sim.faults import (FaultEvent, FaultInjector, FaultKind, FaultSchedule, Layout, availability,
                                    load_schedule, parse_event, random_events)
from matrixinfer.sim.hardware import load_hardware
from matrixinfer.sim.modelspec import load_model
from matrixinfer.sim.serving import CostModelTimes, Request, ServingConfig, poisson_requests, simulate

# 1 prefill instance of 2 devices, 1 decode instance of 4, one device per package: npu:2..5 are decode's
SMALL = ServingConfig(prefill_instances=1, prefill_devices=2, decode_instances=1, decode_devices=4,
                      max_batch_per_device=8, mtp_drafts=0)
SMALL_LAYOUT = Layout(1, 2, 1, 4, per_package=1, per_node=8, links_per_device=1)
ROLES = {"prefill": 0.0, "decode": 0.0, "ems": 0.0}


def _injector(events, layout, detect_s, recover_s, **kinds):
    sch = FaultSchedule(npu=FaultKind(0.0, detect_s, recover_s), **kinds)
    return FaultInjector(events, layout, sch, ROLES)


def test_one_decode_failure_costs_throughput_times_downtime():
    """Saturated decode instance (32 sequences, 50 ms steps, instant prefill): one NPU fault at
    10.03 s, detected after 3 s, rebuilt 7 s later. Proves that the instance emits nothing for
    the whole 10 s (detection included): tokens delivered by 60 s fall by throughput x downtime
    = 32 / 0.05 x 10 = 6,400 within two steps' tokens (the interrupted step, the restart's step
    phase; each re-prefill also emits one token); that the recomputed tokens are the context
    in flight when the failure hit (prompt + output so far of the 32 requests, as the
    interrupted step gave it to the cost model: 32 x (100 + 1 + 200) within one step); and that
    no request is lost for good."""
    def delivered(faults, steps):
        reqs = [Request(i, 0.0, 100, 2000) for i in range(32)]
        res = simulate(reqs, SMALL, lambda b: 0.0, lambda n, kv: steps.append(n * kv) or 0.05, faults=faults)
        return next(s["output_tokens"] for s in res.utilisation if s["t"] == 60.0), reqs

    free, _ = delivered(None, [])
    inj = _injector([FaultEvent(10.03, "npu:3")], SMALL_LAYOUT, 3.0, 7.0)
    steps = []
    hit, reqs = delivered(inj, steps)
    assert abs((free - hit) - 32 / 0.05 * 10.0) <= 2 * 32
    in_flight = steps[int(10.03 / 0.05)]  # context of the step running at 10.03 s
    assert inj.stats.recomputed_decode_tokens == round(in_flight)
    assert abs(inj.stats.recomputed_decode_tokens - 32 * (100 + 1 + 200)) <= 32
    assert inj.stats.down_s["decode"] == pytest.approx(10.0)
    assert all(r.done is not None and r.generated == 2000 for r in reqs)


def test_no_faults_is_the_failure_free_simulation():
    """Cost-model PDC run (EMS sharded over 4 servers, chunked prefill): with a zero-rate
    schedule the fault-aware run gives every request the same first-token and finish times as
    a run without the injector. Proves the fault hooks change nothing until a fault happens."""
    hw, model = load_hardware("cloudmatrix384"), load_model("deepseek-r1")
    cfg = ServingConfig(prefill_instances=2, decode_instances=2, decode_devices=32, ems_capacity_tokens=20000,
                        ems_servers=4, prefill_chunk_tokens=8192, seed=3)
    times = CostModelTimes(hw, model, cfg)

    def go(faults):
        reqs = poisson_requests(30.0, 300, lambda r: r.randint(256, 4096), 64, seed=7, prefixes=20, prefix_len=512)
        res = simulate(reqs, cfg, times.prefill_time, times.decode_time, times.kv_bytes_per_token(), faults=faults)
        return [(r.first_token, r.done) for r in reqs], res.summary()

    layout = Layout.of(hw, cfg)
    sch = FaultSchedule(npu=FaultKind(0.0), link=FaultKind(0.0), node=FaultKind(0.0), ems=FaultKind(0.0))
    events = random_events(layout, sch)
    assert events == []
    assert go(FaultInjector(events, layout, sch, ROLES)) == go(None)


def test_availability_approaches_the_closed_form():
    """Decode instance of n = 5 NPUs, each failing at lambda = 0.01 /s, MTTR = 2 s detection +
    8 s rebuild, 100,000 s: measured up fraction vs 1 / (1 + n lambda MTTR) = 2/3 within 0.02.
    n lambda MTTR = 0.5 is large on purpose: a model that let faults during downtime extend it
    would give exp(-0.5) = 0.61 and fail."""
    n, lam, detect, rebuild, horizon = 5, 0.01, 2.0, 8.0, 100_000.0
    layout = Layout(1, 1, 1, n, per_package=1, per_node=8, links_per_device=1)
    sch = FaultSchedule(npu=FaultKind(1 / lam / 3600, detect, rebuild), horizon_s=horizon, seed=11)
    inj = FaultInjector(random_events(layout, sch), layout, sch, ROLES)
    cfg = ServingConfig(prefill_instances=1, prefill_devices=1, decode_instances=1, decode_devices=n, sample_dt=1000)
    simulate([], cfg, lambda b: 0.0, lambda k, kv: 0.0, faults=inj, horizon_s=horizon)
    up = 1 - inj.stats.down_s["decode"] / horizon
    assert up == pytest.approx(availability(n, lam, detect + rebuild), abs=0.02)
    assert inj.stats.absorbed > 0  # faults did land on the instance while it was down


def test_smaller_decode_instances_lose_fewer_tokens_than_ep320():
    """Same prefill pool, load and per-NPU fault rate (the same NPUs fail at the same times:
    components are numbered over the same 512 devices), cost model on CloudMatrix384, 4
    sequences per die: 5 x EP64 recomputes under half the tokens of 1 x EP320 and loses a fifth
    of the decode device-seconds. Proves the blast radius of a fault is one instance."""
    hw, model = load_hardware("cloudmatrix384"), load_model("deepseek-r1")
    study = Study(Load(rate=40.0, prompt=512, output=256, prefixes=0, prefix_len=0, seed=2), warmup_s=20.0)
    sch = FaultSchedule(npu=FaultKind(1.5), seed=5)
    out = {}
    for n, d in ((1, 320), (5, 64)):
        cfg = ServingConfig(decode_instances=n, decode_devices=d, max_batch_per_device=4)
        out[n] = run(hw, model, cfg, sch, study, 120.0, 30.0)
    big, small = out[1], out[5]
    assert big["instance_failures"]["decode"] == small["instance_failures"]["decode"] >= 2
    assert small["recomputed"]["decode"] < 0.5 * big["recomputed"]["decode"]
    assert small["instance_s_down"]["decode"] * 64 < 0.3 * big["instance_s_down"]["decode"] * 320
    assert small["slo"]["both"] >= big["slo"]["both"]


def test_a_fault_takes_every_instance_on_its_devices():
    """Node 0 of 16 devices holds prefill instances 0 and 1 (8 devices each) and, of 3 nodes,
    EMS servers 0 and 3; node 2 straddles both decode instances (12 devices each, from device
    16); a package (2 devices) or a link (7 per device) takes its device's instance."""
    lay = Layout(2, 8, 2, 12, per_package=2, per_node=16, links_per_device=7, ems_servers=4)
    assert lay.hit("node", 0) == ([0, 1], [], [0, 3])
    assert lay.hit("node", 1) == ([], [0, 1], [1])
    assert lay.hit("npu", 7) == ([1], [], [])
    assert lay.hit("npu", 8) == ([], [0], [])
    assert lay.hit("link", 7 * 16) == ([], [0], [])
    assert lay.hit("ems", 3) == ([], [], [3])
    with pytest.raises(ValueError, match="not in this deployment"):
        lay.hit("npu", 20)


def test_schedule_from_yaml_and_flags(tmp_path):
    """A YAML schedule overrides rates and adds explicit events; a bad key or event is named."""
    p = tmp_path / "f.yaml"
    p.write_text("horizon_s: 50\nnpu: {mtbf_h: 2, recover_s: 9}\nevents:\n  - {t: 4, component: 'ems:1'}\n")
    sch = load_schedule(p, FaultSchedule(events=(parse_event("3:npu:0"),)))
    assert (sch.horizon_s, sch.npu.mtbf_h, sch.npu.recover_s, sch.npu.detect_s) == (50.0, 2.0, 9.0, 3.0)
    assert [e.component for e in sch.events] == ["npu:0", "ems:1"]
    p.write_text("npu: {mtbf: 2}\n")
    with pytest.raises(ValueError, match="mtbf"):
        load_schedule(p)
    with pytest.raises(ValueError, match="T:KIND:INDEX"):
        parse_event("3:gpu")


def test_ems_server_loss_costs_its_shard():
    """Four EMS servers: after one fails, lookups of the prefixes it held miss and count as
    fault misses until they are put again elsewhere (once the view drops the server)."""
    from matrixinfer.sim.serving import EMSPool

    pool = EMSPool(4000, servers=4)
    reqs = [Request(i, 0, 200, 1, f"p{i}", 100) for i in range(12)]
    for r in reqs:
        pool.insert(r)
    k = pool.home("p0")
    theirs = [r for r in reqs if pool.home(r.prefix_id) == k]
    pool.fail_server(k)
    assert all(pool.lookup(r) == 0 for r in theirs)
    assert pool.fault_miss_tokens == 100 * len(theirs)
    others = [r for r in reqs if r not in theirs]
    assert all(pool.lookup(r) == 100 for r in others)
    pool.detect_server(k)
    pool.insert(theirs[0])
    assert pool.home("p0") != k and pool.lookup(theirs[0]) == 100
