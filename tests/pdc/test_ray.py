"""Placement on a Ray cluster: a local Ray cluster (started and stopped by the test) holds the
EMS processes and the prefill/decode instances as actors; the front end here serves through
them with the same results as the colocated engine, and survives killing an instance's actor."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from matrixinfer import LLM, SamplingParams
from matrixinfer.config import EngineConfig
from matrixinfer.serving.async_engine import GenerateRequest

pytestmark = pytest.mark.slow
ENGINE = dict(dtype="float32", block_size=4, max_num_batched_tokens=16, max_model_len=128)
PROMPT = list(range(20, 60))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def ray_cluster(tmp_path):
    ray_bin = shutil.which("ray", path=str(Path(sys.executable).parent))
    port = _free_port()
    start = [ray_bin, "start", "--head", f"--port={port}", "--num-cpus=2", "--include-dashboard=false",
             "--disable-usage-stats", "--node-ip-address=127.0.0.1"]
    subprocess.run(start, check=True, capture_output=True, timeout=180)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        import ray

        ray.shutdown()
        subprocess.run([ray_bin, "stop", "--force"], capture_output=True, timeout=120)


def _generate(client, rid):
    async def run():
        last = None
        params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        async for out in client.generate(GenerateRequest(rid, PROMPT, params)):
            last = out
        return last.outputs[0].token_ids

    return asyncio.run(run())


def test_pdc_roles_as_ray_actors(text_checkpoint, ray_cluster):
    from matrixinfer.pdc import start_pdc

    expected = LLM(model=text_checkpoint[0], **ENGINE).generate(
        [{"prompt_token_ids": PROMPT}], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
        use_tqdm=False)[0].outputs[0].token_ids
    base = EngineConfig.from_kwargs(str(text_checkpoint[0]), **ENGINE)
    client = start_pdc(base, 1, 1, ems_servers=1, ray_address=ray_cluster, model_name="tiny")
    try:
        for inst in client.instances:  # Ray's worker processes, not children of this one
            ppid = int(Path(f"/proc/{inst.pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
            assert ppid != os.getpid()
            assert Path(f"/proc/{inst.pid}/cmdline").read_bytes().startswith(b"ray::CoreActor")
        assert _generate(client, "a") == expected
        assert client.prefill[0].handed_off == 1 and client.scheduler_stats().external_cache_hits > 0
        client.decode[0].client.kill()  # the decode actor dies: the next request uses the restarted one
        deadline = time.monotonic() + 120
        while not (client.decode[0].alive and client.decode[0].restarts == 1):
            assert time.monotonic() < deadline, "the decode actor was not restarted"
            time.sleep(0.2)
        assert _generate(client, "b") == expected
    finally:
        client.shutdown()
