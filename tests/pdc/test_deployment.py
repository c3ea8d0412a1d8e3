"""`matrixinfer serve --deployment deploy/cloudmatrix.yaml`, as a user runs it: the paper's
deployment scaled to one machine (an SP-TP-SP + EP prefill instance, an EP3 decode instance with
INT8 dispatch, a redundant expert under EPLB and two microbatches, W8A8 weights, two EMS
servers) launched from the one file, serving the OpenAI API. Each role runs the layout of its
own section (the start-up lines say which), and greedy completions equal the single-process
engine's on the same W8A8 checkpoint. Every process of the stack is killed at the end."""

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from matrixinfer import LLM, SamplingParams
from matrixinfer.bench.serve_bench import _free_port
from matrixinfer.deployment import load_deployment

pytestmark = pytest.mark.slow
DEPLOYMENT = Path(__file__).resolve().parents[2] / "deploy" / "cloudmatrix.yaml"
PROMPTS = ["def parse(line):\n    return line.split(',')\n\n\ndef main", "import os\nimport sys\n", "class A:"]


def _kill_tree(proc: subprocess.Popen) -> None:
    try:
        procs = psutil.Process(proc.pid).children(recursive=True) + [psutil.Process(proc.pid)]
    except psutil.NoSuchProcess:
        procs = []
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=30)


def test_the_paper_deployment_file_serves_each_role_its_layout_and_one_process_tokens(tmp_path):
    port, log = _free_port(), tmp_path / "serve.log"
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "matrixinfer.cli", "serve", "--deployment", str(DEPLOYMENT),
                                 "--port", str(port), "--keys-db", str(tmp_path / "serving.db"),
                                 "--served-model-name", "tiny", "--max-num-seqs", "8",
                                 "--max-num-batched-tokens", "256"],
                                stderr=err, stdout=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the stack did not start: " + log.read_text()[-3000:]
            time.sleep(0.5)
        texts = []
        for prompt in PROMPTS:
            r = httpx.post(url + "/v1/completions", timeout=300, json={
                "model": "tiny", "prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200, r.text
            texts.append(r.json()["choices"][0]["text"])
        started = log.read_text()
        assert "matrixinfer: prefill: SP-TP-SP prefill over 2 ranks (MoE EP2)" in started, started
        assert ("matrixinfer: decode: EP3; dispatch int8, 1 redundant expert(s), EPLB every 200 steps, "
                "2 microbatches; w8a8 weights") in started, started
    finally:
        _kill_tree(proc)
    # the oracle: one process, eager (the reference every parallel path is checked against)
    reference = LLM(model=load_deployment(DEPLOYMENT).model, quantization="w8a8", enforce_eager=True)
    p = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    assert texts == [o.outputs[0].text for o in reference.generate(PROMPTS, p, use_tqdm=False)]
