"""`matrixinfer serve` on SIGTERM, as a real process: a stream in flight runs to its end, a
request arriving meanwhile gets 503 with Retry-After, the engine is shut down and the
process exits 0. Every process is killed at the end, whatever happened."""

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from matrixinfer.bench.serve_bench import _free_port


def _serve(tmp_path, *extra):
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "matrixinfer.cli", "serve", "--port", str(port), "--keys-db",
                             str(tmp_path / "serving.db"), "--dtype", "float32", *extra],
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, proc.stderr.read()
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.2)


@pytest.fixture
def serve(tmp_path):
    procs = []

    def start(*extra):
        proc, url = _serve(tmp_path, *extra)
        procs.append(proc)
        return proc, url

    yield start
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(30)


def _stream(url, max_tokens):
    return httpx.stream("POST", url + "/v1/completions", timeout=120,
                        json={"prompt": "def main():\n", "max_tokens": max_tokens, "n": 4, "ignore_eos": True,
                              "stream": True, "temperature": 0})


def test_sigterm_finishes_the_stream_refuses_new_requests_and_exits_0(serve):
    proc, url = serve("--shutdown-timeout", "60")
    with _stream(url, 400) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: {"))
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        late = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=10)
        assert late.status_code == 503 and int(late.headers["Retry-After"]) >= 1
        assert late.json()["error"]["code"] == "server_shutting_down"
        assert httpx.get(url + "/health", timeout=10).status_code == 503
        assert proc.poll() is None  # still draining the stream
        rest = [line[6:] for line in lines if line.startswith("data: ")]
    assert rest[-1] == "[DONE]"
    finishes = [c["finish_reason"] for e in rest[:-1] for c in json.loads(e)["choices"] if c["finish_reason"]]
    assert finishes == ["length"] * 4
    assert proc.wait(30) == 0


def test_shutdown_timeout_cuts_a_long_stream_and_still_exits_0(serve):
    """A stream that outlives --shutdown-timeout is cut (the client sees the connection end)
    and the server still exits 0 soon after the timeout."""
    proc, url = serve("--shutdown-timeout", "0.5")
    with _stream(url, 1000) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: {"))
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            rest = list(lines)
        except httpx.HTTPError:
            rest = []
    assert "data: [DONE]" not in rest
    assert proc.wait(30) == 0 and time.monotonic() - t0 < 15
