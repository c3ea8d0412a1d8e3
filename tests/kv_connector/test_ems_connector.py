"""The EMS connector: latent KV blocks saved by one engine process are loaded by another
that sees the same prefix, and a pool that fails costs recomputation, never a wrong answer.

Integration tests use real processes: an EMS controller and MP server (`python -m
matrixinfer.ems`, via LocalCluster) and two engine processes (A, then B).
"""

import json
import shutil
import subprocess
import sys
import tempfile

import pytest

from matrixinfer import LLM, SamplingParams
from matrixinfer.ems import LocalCluster

ENGINE_SCRIPT = """
import json, sys
from matrixinfer import LLM, SamplingParams
model, controller, prompt = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
llm = LLM(model=model, dtype="float32", block_size=4,
          kv_transfer_config={"connector": "ems", "ems_controller": controller})
out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                   use_tqdm=False)[0]
print(json.dumps({"tokens": out.outputs[0].token_ids, "cached": out.num_cached_tokens}))
"""

PROMPT = list(range(20, 46))  # 26 tokens: 6 full blocks of 4
SUFFIX = [77, 78, 79, 80, 81]


def run_engine_process(model, controller, prompt) -> dict:
    r = subprocess.run([sys.executable, "-c", ENGINE_SCRIPT, str(model), controller, json.dumps(prompt)],
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture
def ems_pool():
    root = tempfile.mkdtemp(prefix="ems-conn-")
    cluster = LocalCluster(n_servers=1, root=root, dram_bytes=16 << 20)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.close()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def reference(text_checkpoint):
    """Greedy tokens without any connector."""
    llm = LLM(model=text_checkpoint[0], dtype="float32", block_size=4, enable_prefix_caching=False)
    p = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    return {len(x): llm.generate([{"prompt_token_ids": x}], p, use_tqdm=False)[0].outputs[0].token_ids
            for x in (PROMPT, PROMPT + SUFFIX)}


@pytest.mark.slow
def test_second_engine_process_loads_the_prefix_from_ems(text_checkpoint, ems_pool, reference):
    """A computes P and saves its blocks; B (another process) gets P + suffix, reports P's full
    blocks (and A's generated ones) as cached, and answers exactly as without a connector."""
    model = text_checkpoint[0]
    a = run_engine_process(model, ems_pool.controller, PROMPT)
    assert a["cached"] == 0 and a["tokens"] == reference[len(PROMPT)]
    b = run_engine_process(model, ems_pool.controller, PROMPT + SUFFIX)
    assert b["cached"] >= 24  # P's six full blocks
    assert b["tokens"] == reference[len(PROMPT + SUFFIX)]


@pytest.mark.slow
def test_killed_ems_server_means_recompute_not_failure(text_checkpoint, ems_pool, reference):
    """Kill the MP server between A and B: B finds nothing, recomputes, answers correctly."""
    model = text_checkpoint[0]
    run_engine_process(model, ems_pool.controller, PROMPT)
    ems_pool.kill_server(0)
    b = run_engine_process(model, ems_pool.controller, PROMPT + SUFFIX)
    assert b["cached"] == 0
    assert b["tokens"] == reference[len(PROMPT + SUFFIX)]


class DictPool:
    """An in-memory stand-in for the EMS client (unit tests only; the tests above use the
    real pool). `lose_values` makes every get a miss although exists() says yes: the case of
    a page evicted or a server dying between lookup and load."""

    def __init__(self, store, lose_values=False):
        self.store, self.lose_values = store, lose_values

    def exists(self, keys):
        return [k in self.store for k in keys]

    def get_many(self, keys):
        return [None if self.lose_values else self.store.get(k) for k in keys]

    def put_many(self, items):
        for k, v in items:
            self.store[k] = bytes(v.contiguous().view(-1).view(__import__("torch").uint8).numpy())
        return [True] * len(items)


def test_failed_load_recomputes_the_prefix(text_checkpoint, monkeypatch, reference):
    """Pages the lookup promised but the load did not deliver are recomputed: same tokens,
    and the request does not count them as cached."""
    import matrixinfer.kv_connector.ems_connector as ems_connector

    store: dict = {}
    monkeypatch.setattr(ems_connector, "_client", lambda cfg: DictPool(store))
    kw = dict(dtype="float32", block_size=4, kv_transfer_config={"connector": "ems", "ems_controller": "unused:1"})
    p = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    LLM(model=text_checkpoint[0], **kw).generate([{"prompt_token_ids": PROMPT}], p, use_tqdm=False)
    assert store  # A saved its blocks

    good = LLM(model=text_checkpoint[0], enable_prefix_caching=False, **kw)
    out = good.generate([{"prompt_token_ids": PROMPT + SUFFIX}], p, use_tqdm=False)[0]
    assert out.num_cached_tokens >= 24 and out.outputs[0].token_ids == reference[len(PROMPT + SUFFIX)]

    monkeypatch.setattr(ems_connector, "_client", lambda cfg: DictPool(store, lose_values=True))
    lossy = LLM(model=text_checkpoint[0], enable_prefix_caching=False, **kw)
    out = lossy.generate([{"prompt_token_ids": PROMPT + SUFFIX}], p, use_tqdm=False)[0]
    assert out.num_cached_tokens == 0
    assert out.outputs[0].token_ids == reference[len(PROMPT + SUFFIX)]
    assert lossy.engine.stats.external_cache_hits == 0


@pytest.mark.slow
def test_expert_parallel_ranks_save_their_own_requests_blocks_and_load_from_the_pool(text_checkpoint, ems_pool,
                                                                                    reference):
    """EP=2 (attention data parallel): OTHER goes to rank 0 and PROMPT to rank 1, so PROMPT's
    blocks exist only in rank 1's cache; another single-process engine loads them and answers
    exactly; an EP engine loads the prefix from the pool too."""
    model, other = text_checkpoint[0], list(range(50, 76))
    kw = dict(dtype="float32", block_size=4, expert_parallel_size=2,
              kv_transfer_config={"connector": "ems", "ems_controller": ems_pool.controller})
    p = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with LLM(model=model, **kw) as ep:
        outs = ep.generate([{"prompt_token_ids": other}, {"prompt_token_ids": PROMPT}], p, use_tqdm=False)
    assert outs[1].outputs[0].token_ids == reference[len(PROMPT)]
    b = run_engine_process(model, ems_pool.controller, PROMPT + SUFFIX)  # rank 1's blocks, through the pool
    assert b["cached"] >= 24 and b["tokens"] == reference[len(PROMPT + SUFFIX)]
    with LLM(model=model, **kw) as ep:
        out = ep.generate([{"prompt_token_ids": PROMPT + SUFFIX}], p, use_tqdm=False)[0]
    assert out.num_cached_tokens >= 24 and out.outputs[0].token_ids == reference[len(PROMPT + SUFFIX)]


@pytest.mark.slow
def test_sp_tp_sp_prefill_saves_latents_another_engine_decodes_from(text_checkpoint, ems_pool, reference):
    """SP-TP-SP over 2 ranks (tokens cut over the ranks, heads split for attention) prefills
    PROMPT and saves its pages from rank 0; a single-process engine (the decode side's layout)
    loads them for PROMPT + SUFFIX and answers exactly; an SP-TP-SP engine loads them too."""
    model = text_checkpoint[0]
    kw = dict(dtype="float32", block_size=4, prefill_parallel="sp-tp-sp", prefill_parallel_size=2,
              kv_transfer_config={"connector": "ems", "ems_controller": ems_pool.controller})
    p = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with LLM(model=model, **kw) as sp:
        out = sp.generate([{"prompt_token_ids": PROMPT}], p, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == reference[len(PROMPT)]
    b = run_engine_process(model, ems_pool.controller, PROMPT + SUFFIX)
    assert b["cached"] >= 24 and b["tokens"] == reference[len(PROMPT + SUFFIX)]
    with LLM(model=model, **kw) as sp:
        out = sp.generate([{"prompt_token_ids": PROMPT + SUFFIX}], p, use_tqdm=False)[0]
    assert out.num_cached_tokens >= 24 and out.outputs[0].token_ids == reference[len(PROMPT + SUFFIX)]
