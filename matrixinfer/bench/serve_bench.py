"""`matrixinfer bench serve`: online load against the token service.

Requests arrive as a Poisson process at each offered rate; each one streams (SSE) so that
time to first token (TTFT) and time per output token (TPOT) are measured as a client sees
them. Prompts are token ids of a fixed length and outputs a fixed length (ignore_eos), so
rates are comparable. Multi-turn mode runs conversations instead: each turn resends the
whole history plus a new user message (chat endpoint), which is what the prefix cache is
for; the report then splits first turns from follow-up turns.

Against --url, or a server it starts itself (`matrixinfer serve` in a subprocess).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import aiohttp
import httpx
import numpy as np
from tqdm import tqdm

from matrixinfer.bench.peers import Peers, vllm_server_command
from matrixinfer.bench.report import bench_dir, markdown_table, save_json, write_section
from matrixinfer.config import DEFAULT_MODEL

WORDS = ("alpha beta gamma delta prefill decode expert router cache page block token latent "
         "attention matrix supernode memory pool namespace tenant stream").split()


@dataclass
class Result:
    ok: bool
    start: float
    ttft: float | None = None
    second: float | None = None  # arrival of the second visible piece of text (after start)
    e2e: float | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    turn: int = 0
    error: str = ""

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    @property
    def first_gap(self) -> float | None:
        """First inter-token gap as the client sees it (in PDC it spans the KV hand-off)."""
        return None if self.second is None else self.second - self.ttft


@dataclass
class Workload:
    url: str
    model: str
    input_len: int
    output_len: int
    headers: dict = field(default_factory=dict)
    token_pool: list[int] = field(default_factory=list)
    tokens_per_word: float = 1.0  # of the generated text, to size multi-turn messages


def load_client(max_connections: int = 1024) -> aiohttp.ClientSession:
    """The load generator's HTTP client: aiohttp, as vLLM's `bench serve` uses. It shares the
    machine with the server under test: with httpx's client, 32 requests of 128 + 128 tokens at
    once cost the load generator 0.43-0.49 CPU-s and the server measured 11.2-12.4 ms TPOT p50;
    with aiohttp 0.14-0.21 CPU-s and 7.1-9.3 ms (the bundled model, 2 cores)."""
    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600),
                                 connector=aiohttp.TCPConnector(limit=max_connections))


async def stream_request(client: aiohttp.ClientSession, w: Workload, path: str, body: dict, turn: int = 0,
                         on_text=None, headers: dict | None = None) -> Result:
    """Send one streaming request; time its first and second tokens and its end; read usage
    from the final chunk. `headers` replace the workload's (another tenant's key)."""
    body = {**body, "model": w.model, "stream": True, "stream_options": {"include_usage": True},
            "max_tokens": w.output_len, "ignore_eos": True, "temperature": 0}
    t0 = time.perf_counter()
    r = Result(ok=False, start=t0, turn=turn)
    text = []
    try:
        async with client.post(w.url + path, json=body, headers=w.headers if headers is None else headers) as resp:
            if resp.status != 200:
                r.error = f"HTTP {resp.status}: {(await resp.read())[:200]!r}"
                return r
            async for raw in resp.content:  # one line at a time
                line = raw.decode().rstrip("\r\n")
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    u = chunk["usage"]
                    r.prompt_tokens, r.output_tokens = u["prompt_tokens"], u["completion_tokens"]
                    # vLLM's server leaves the details out (null) unless asked to report them
                    r.cached_tokens = (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                for c in chunk.get("choices", []):
                    piece = c.get("text") if "text" in c else (c.get("delta") or {}).get("content")
                    if piece:
                        if r.ttft is None:
                            r.ttft = time.perf_counter() - t0
                        elif r.second is None:
                            r.second = time.perf_counter() - t0
                        text.append(piece)
        r.e2e = time.perf_counter() - t0
        if r.ttft is None:  # all tokens decoded to nothing visible: count the end as first token
            r.ttft = r.e2e
        r.ok = r.output_tokens > 0
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError, KeyError) as e:
        r.error = f"{type(e).__name__}: {e}"
    if on_text is not None:
        on_text("".join(text))
    return r


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def poisson_arrivals(rng: random.Random, rate: float, n: int) -> list[float]:
    """Start times (s after the first) of n requests arriving as a Poisson process."""
    return [float(t) for t in np.cumsum([rng.expovariate(rate) for _ in range(n)])]


async def run_prompts(w: Workload, arrivals: list[float], prompts: list[list[int]], bar,
                      headers: list[dict] | None = None) -> list[Result]:
    """Send prompts[i] (token ids, completions endpoint) at arrivals[i], with headers[i] if given."""
    async def one(i: int) -> Result:
        await asyncio.sleep(arrivals[i])
        r = await stream_request(client, w, "/v1/completions", {"prompt": prompts[i]},
                                 headers=None if headers is None else headers[i])
        bar.update(1)
        return r

    async with load_client() as client:
        return await asyncio.gather(*(one(i) for i in range(len(prompts))))


async def run_single_turn(w: Workload, rate: float, num_requests: int, rng: random.Random, bar) -> list[Result]:
    arrivals = poisson_arrivals(rng, rate, num_requests)
    prompts = [rng.choices(w.token_pool, k=w.input_len) for _ in range(num_requests)]  # no shared prefixes
    return await run_prompts(w, arrivals, prompts, bar)


async def run_multi_turn(w: Workload, rate: float, conversations: int, turns: int, rng: random.Random,
                         bar) -> list[Result]:
    """Conversations arrive at `rate`; each sends its turns back to back, with the history."""
    words_per_turn = max(1, round(w.input_len / w.tokens_per_word))

    async def conversation(delay: float, seed: int) -> list[Result]:
        await asyncio.sleep(delay)
        crng, messages, results = random.Random(seed), [], []
        for turn in range(turns):
            messages.append({"role": "user", "content": _words(crng, words_per_turn)})
            reply = []
            r = await stream_request(client, w, "/v1/chat/completions", {"messages": list(messages)}, turn,
                                     on_text=reply.append)
            results.append(r)
            bar.update(1)
            if not r.ok:
                break
            messages.append({"role": "assistant", "content": reply[0]})
        return results

    arrivals = poisson_arrivals(rng, rate, conversations)
    async with load_client() as client:
        per_conv = await asyncio.gather(*(conversation(a, rng.randrange(2**31)) for a in arrivals))
    return [r for conv in per_conv for r in conv]


async def _warm_up(w: Workload) -> None:
    """One request before measuring, so first-call costs stay out of the numbers."""
    async with load_client() as client:
        r = await stream_request(client, w, "/v1/completions", {"prompt": w.token_pool[:w.input_len]})
    if not r.ok:
        raise RuntimeError(f"warm-up request failed: {r.error}")


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def summarize(results: list[Result], rate: float, duration: float) -> dict:
    ok = [r for r in results if r.ok]
    ttft, tpot, e2e = [r.ttft for r in ok], [r.tpot for r in ok if r.tpot is not None], [r.e2e for r in ok]
    out_tokens, in_tokens = sum(r.output_tokens for r in ok), sum(r.prompt_tokens for r in ok)
    s = {
        "offered_rate": rate, "requests": len(results), "completed": len(ok), "failed": len(results) - len(ok),
        "duration_s": duration, "throughput_req_s": len(ok) / duration, "output_tok_s": out_tokens / duration,
        "total_tok_s": (in_tokens + out_tokens) / duration, "prompt_tokens": in_tokens, "output_tokens": out_tokens,
        "cached_fraction": sum(r.cached_tokens for r in ok) / max(1, in_tokens),
        "errors": sorted({r.error for r in results if r.error})[:5],
    }
    gaps = [r.first_gap for r in ok if r.first_gap is not None]
    for name, vals in (("ttft", ttft), ("tpot", tpot), ("e2e", e2e), ("first_gap", gaps)):
        for q in (50, 99):
            s[f"{name}_p{q}_s"] = _pct(vals, q)
    first, later = [r for r in ok if r.turn == 0], [r for r in ok if r.turn > 0]
    if first and later:
        for name, group in (("first_turn", first), ("later_turns", later)):
            prompt = sum(r.prompt_tokens for r in group)
            s[f"ttft_{name}_p50_s"] = _pct([r.ttft for r in group], 50)
            s[f"prompt_tokens_{name}_mean"] = prompt / len(group)
            s[f"cached_fraction_{name}"] = sum(r.cached_tokens for r in group) / max(1, prompt)
    return s


# -- the server under test ----------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str, extra: list[str], keys_db: str | Path | None = None
                 ) -> tuple[subprocess.Popen, str, tempfile.TemporaryDirectory]:
    """`matrixinfer serve` in a subprocess (its own session, importing this same matrixinfer
    tree) on a free port; returns once /health answers. `keys_db`: a keys database made by
    the caller (default: an empty one, so no authentication). Stop it with stop_server()."""
    port, tmp = _free_port(), tempfile.TemporaryDirectory(prefix="mi-bench-serve-")
    cmd = [sys.executable, "-m", "matrixinfer.cli", "serve", "--model", model, "--port", str(port),
           "--keys-db", str(keys_db or Path(tmp.name) / "serving.db"), *extra]
    tree = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [tree, os.environ.get("PYTHONPATH")]))}
    return launch_server(cmd, env, port, tmp)


def launch_server(cmd: list[str], env: dict, port: int, tmp: tempfile.TemporaryDirectory
                  ) -> tuple[subprocess.Popen, str, tempfile.TemporaryDirectory]:
    """Start a server process (its own session; its log in tmp) and wait for /health on port."""
    log = Path(tmp.name) / "serve.log"  # a file, not a pipe nobody reads while the server runs
    with open(log, "w") as err:
        proc = subprocess.Popen(cmd, stdout=err, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited: {log.read_text()[-2000:]}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    return proc, url, tmp
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError("server did not come up in 600 s")
    except BaseException:
        stop_server(proc, tmp)
        raise


def stop_server(proc: subprocess.Popen, tmp: tempfile.TemporaryDirectory | None = None, timeout: float = 60) -> None:
    """SIGTERM (the server drains and stops its engine processes), then SIGKILL to whatever of
    its process group is left."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # stragglers: engine cores, EMS servers
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
    if tmp is not None:
        tmp.cleanup()


def _workload(args, url: str) -> Workload:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    models = httpx.get(url + "/v1/models", headers=headers, timeout=30).json()["data"][0]
    rng = random.Random(args.seed)
    n_words = 4 * args.input_len + 64
    text = _words(rng, n_words)
    pool = httpx.post(url + "/tokenize", json={"prompt": text, "add_special_tokens": False}, headers=headers,
                      timeout=30).json()["tokens"]
    if args.input_len + args.output_len > models["max_model_len"]:
        raise SystemExit(f"input {args.input_len} + output {args.output_len} tokens exceed the model's context "
                         f"({models['max_model_len']})")
    return Workload(url, models["id"], args.input_len, args.output_len, headers, pool, len(pool) / n_words)


def _rate_label(rate: float) -> str:
    return "all at once" if rate == float("inf") else f"{rate:g}"


def _plot(series: list[tuple[str, list[dict]]], path: Path, title: str) -> None:
    """Output tokens/s, TTFT and TPOT (p50 solid, p99 dashed) against the offered rate, one
    colour per server; the rates are categories, so "all at once" has a place."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = [r["offered_rate"] for r in series[0][1]]
    xs = range(len(rates))
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for (name, rows), color in zip(series, ("tab:blue", "tab:orange", "tab:green")):
        axes[0].plot(xs, [r["output_tok_s"] for r in rows], "o-", color=color, label=name)
        for ax, metric in ((axes[1], "ttft"), (axes[2], "tpot")):
            for q, style in ((50, "o-"), (99, "s--")):
                ax.plot(xs, [1e3 * (r[f"{metric}_p{q}_s"] or float("nan")) for r in rows], style, color=color,
                        label=f"{name} p{q}")
    unit = "conversations/s" if "multi-turn" in title else "requests/s"
    for ax, label in zip(axes, ("output tokens/s", "TTFT (ms)", "TPOT (ms)")):
        ax.set_xticks(list(xs), [_rate_label(r) for r in rates])
        ax.set_xlabel(f"offered load ({unit})")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(args) -> int:
    vllm_python = args.vllm_python or (args.peers and Peers.from_dir(args.peers).vllm_python)
    if vllm_python and (args.url is not None or args.multi_turn):
        raise SystemExit("--vllm-python / --peers: single-turn, beside a server the benchmark starts (not --url)")
    proc = tmp = None
    url = args.url
    if url is None:
        extra = ["--max-num-seqs", str(args.max_num_seqs)] + (["--dtype", args.dtype] if args.dtype else [])
        extra += [] if args.pdc else ["--colocated"]  # the published numbers are the colocated engine's
        extra += ["--enforce-eager"] if args.enforce_eager else []
        print(f"starting `matrixinfer serve --model {args.model} {' '.join(extra)}` ...", file=sys.stderr)
        proc, url, tmp = start_server(args.model, extra)
    url = url.rstrip("/")
    mode = f"multi-turn ({args.turns} turns)" if args.multi_turn else "single-turn"
    try:
        w = _workload(args, url)
        rows = run_rates(w, args, proc.pid if proc is not None else None)  # its own session: sid = pid
    finally:
        if proc is not None:
            stop_server(proc, tmp)
    report = {"model": w.model, "url": args.url or "started by the benchmark", "mode": mode,
              "input_len": args.input_len, "output_len": args.output_len, "seed": args.seed,
              "cpu_count": os.cpu_count(), "results": rows}
    if vllm_python:
        report["peers"] = [run_vllm_server(Peers(vllm_python=vllm_python), args, w)]
    if args.offline_reference and not args.multi_turn:
        report["offline"] = offline_reference(args)
        print(json.dumps(report["offline"]), file=sys.stderr)
    if args.json:
        print(json.dumps(report))
    if not args.no_write:
        name = args.name + ("-multiturn" if args.multi_turn else "")
        save_json(name, report)
        plot = bench_dir() / f"{name}.png"
        _plot(_series(report), plot, f"{w.model}: {mode}, {args.input_len} in / {args.output_len} out tokens")
        _write_section(args.name, name, report, plot)
    return 0 if all(r["failed"] == 0 for r in rows) else 1


def session_cpu_seconds(session: int) -> dict[str, float]:
    """CPU seconds (user + system) so far of each live process of a session, summed by
    process name (/proc; empty where there is none)."""
    tick, out = os.sysconf("SC_CLK_TCK"), {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
            argv0 = (stat.parent / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
        except OSError:  # gone meanwhile
            continue
        fields = text[text.rindex(")") + 2:].split()  # from the state on: state ppid pgrp session ... utime stime
        if int(fields[3]) == session:
            # the title a process set itself (matrixinfer::engine-core, VLLM::Worker), else its
            # program; the kernel's own name is cut at 15 characters
            name = Path(argv0).name or text[text.index("(") + 1:text.rindex(")")]
            out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def run_rates(w: Workload, args, server_session: int | None = None) -> list[dict]:
    """A warm-up request, then every offered rate in turn; the arrivals and prompts come from
    --seed, so two servers driven by this get the same requests at the same times. With the
    server's session (a server the benchmark started), each row also says how the CPU was
    shared during it: the load generator's seconds and each server process's."""
    rng = random.Random(args.seed)
    asyncio.run(_warm_up(w))
    rows = []
    for rate in args.rates:
        n = args.conversations if args.multi_turn else args.num_requests
        total = n * (args.turns if args.multi_turn else 1)
        before = session_cpu_seconds(server_session) if server_session else {}
        with tqdm(total=total, desc=f"rate {rate}/s", file=sys.stderr) as bar:
            t0, c0 = time.perf_counter(), time.process_time()
            if args.multi_turn:
                results = asyncio.run(run_multi_turn(w, rate, n, args.turns, rng, bar))
            else:
                results = asyncio.run(run_single_turn(w, rate, n, rng, bar))
            duration, client_cpu = time.perf_counter() - t0, time.process_time() - c0
        rows.append(summarize(results, rate, duration))
        if server_session:
            after = session_cpu_seconds(server_session)
            rows[-1]["cpu_s"] = {"load generator": client_cpu,
                                 **{k: v - before.get(k, 0.0) for k, v in after.items() if v > before.get(k, 0.0)}}
        print(json.dumps(rows[-1]), file=sys.stderr)
    return rows


def run_vllm_server(peers: Peers, args, ours: Workload) -> dict:
    """vLLM's OpenAI server on the same checkpoint, dtype, threads and sequence limit, driven
    with the same requests (our token pool, our model name) after ours has stopped."""
    import torch

    from matrixinfer.config import ModelConfig

    dtype = args.dtype if args.dtype not in (None, "auto") else ModelConfig.from_pretrained(args.model).torch_dtype
    port, tmp = _free_port(), tempfile.TemporaryDirectory(prefix="mi-bench-vllm-")
    cmd, env = vllm_server_command(peers, args.model, dtype, torch.get_num_threads(), port, ours.model,
                                   args.max_num_seqs)
    print(f"starting vLLM's server: {' '.join(cmd)} ...", file=sys.stderr)
    proc, url, tmp = launch_server(cmd, env, port, tmp)
    try:
        version = httpx.get(url + "/version", timeout=30).json().get("version", "?")
        rows = run_rates(replace(ours, url=url), args, proc.pid)
    finally:
        stop_server(proc, tmp)
    return {"engine": f"vLLM {version}", "dtype": dtype, "results": rows}


def offline_reference(args) -> dict:
    """The same engine offline (`LLM`, core in this process) on the same number of requests of
    the same lengths, all at once: its median decode step at that batch is the floor a served
    TPOT is compared with (the server is stopped by then, so the two do not share the CPU)."""
    from matrixinfer.bench.engine_bench import _requests, run_matrixinfer
    from matrixinfer.config import ModelConfig

    prompts = _requests(args.num_requests, args.input_len, ModelConfig.from_pretrained(args.model).vocab_size)
    mi = run_matrixinfer(args.model, args.dtype or "auto", prompts, args.output_len, False,
                         enforce_eager=args.enforce_eager, per_request_tpot=True)
    mi.llm.shutdown()
    return {"batch": args.num_requests, "decode_step_ms": mi.decode_step_s * 1e3,
            "tpot_p50_ms": statistics.median(mi.tpot_s) * 1e3 if mi.tpot_s else None,
            "output_tok_s": args.num_requests * args.output_len / mi.seconds}


def _table(report: dict) -> str:
    offered = "offered conversations/s" if "multi" in report["mode"] else "offered req/s"
    headers = [offered, "done", "failed", "req/s", "prompt tok (mean)", "out tok/s", "TTFT p50", "TTFT p99",
               "TPOT p50", "TPOT p99", "E2E p50", "cached %"]
    rows = [[r["offered_rate"], r["completed"], r["failed"], r["throughput_req_s"],
             r["prompt_tokens"] / max(1, r["completed"]), r["output_tok_s"],
             r["ttft_p50_s"], r["ttft_p99_s"], r["tpot_p50_s"], r["tpot_p99_s"], r["e2e_p50_s"],
             100 * r["cached_fraction"]] for r in report["results"]]
    return markdown_table(headers, [[("-" if v is None else v) for v in row] for row in rows])


def _series(report: dict) -> list[tuple[str, list[dict]]]:
    """(server, its rows per rate): ours, then each peer's."""
    return [("matrixinfer", report["results"])] + [(p["engine"], p["results"]) for p in report.get("peers", [])]


def _peer_table(rep: dict, peer: dict) -> str:
    def ratio(a, b):
        return "-" if not a or not b else f"{a / b:.2f}x"

    rows = []
    for ours, theirs in zip(rep["results"], peer["results"]):
        row = [_rate_label(ours["offered_rate"])]
        for key, scale in (("output_tok_s", 1), ("ttft_p50_s", 1e3), ("tpot_p50_s", 1e3)):
            a, b = ours[key], theirs[key]
            row += ["-" if a is None else round(scale * a, 1), "-" if b is None else round(scale * b, 1), ratio(a, b)]
        rows.append(row)
    return markdown_table(["offered req/s", "out tok/s: ours", "vLLM", "ratio", "TTFT p50 ms: ours", "vLLM", "ratio",
                           "TPOT p50 ms: ours", "vLLM", "ratio"], rows)


def _cpu_table(series: list[tuple[str, list[dict]]]) -> str:
    """Where the CPU went during each rate's run: wall seconds, then CPU seconds of the load
    generator and of each server process (the machine has os.cpu_count() cores' worth per second)."""
    rows = []
    for name, results in series:
        for r in results:
            if "cpu_s" in r:
                parts = ", ".join(f"{k} {v:.2f}" for k, v in sorted(r["cpu_s"].items(), key=lambda kv: -kv[1]))
                rows.append([name, _rate_label(r["offered_rate"]), round(r["duration_s"], 2), parts])
    return markdown_table(["server", "offered req/s", "wall s", "CPU s by process"], rows) if rows else ""


def _write_section(section: str, name: str, report: dict, plot: Path) -> None:
    """The section holds one table per mode; each run rewrites its own mode's table."""
    parts = {}
    for mode_name in (section, section + "-multiturn"):
        path = bench_dir() / f"{mode_name}.json"
        if path.exists():
            parts[mode_name] = json.loads(path.read_text())
    md = ["## Token service under online load (`matrixinfer bench serve`)", "",
          "Poisson arrivals against `matrixinfer serve` over HTTP, streaming; latencies in seconds as the "
          "client sees them (TTFT to the first visible text). Requests per rate are few, so p99 is close to the "
          "maximum."]
    for mode_name, rep in parts.items():
        per_turn = " (about, in words) per user turn" if "multi" in rep["mode"] else ""
        md += ["", f"### {rep['mode']}: model `{rep['model']}`, {rep['input_len']} prompt tokens{per_turn}, "
                   f"{rep['output_len']} output tokens; {rep['cpu_count']} CPU cores", "",
               _table(rep), "", f"![latency against load]({mode_name}.png)"]
        off = rep.get("offline")
        if off:
            flat = [r for r in rep["results"] if r["offered_rate"] == float("inf") and r["tpot_p50_s"]]
            vs = ""
            if flat:
                served = 1e3 * flat[0]["tpot_p50_s"]
                vs = (f" Served all at once (offered rate inf), TPOT p50 is {served:.2f} ms: "
                      f"**{served / off['decode_step_ms']:.2f}x** the offline step")
                if off.get("tpot_p50_ms"):  # the same formula offline: the others' prefill steps included
                    vs += (f" and **{served / off['tpot_p50_ms']:.2f}x** the offline TPOT p50 "
                           f"({off['tpot_p50_ms']:.2f} ms, timed per request as a client times it, so the steps "
                           "that prefill the other requests count on both sides)")
                vs += "."
            md += ["", f"The same engine offline (`--offline-reference`: `LLM` on {off['batch']} requests of the same "
                       f"lengths, all at once): decode step {off['decode_step_ms']:.2f} ms, "
                       f"{off['output_tok_s']:.0f} output tok/s.{vs}"]
        for peer in rep.get("peers", []):
            md += ["", f"Against {peer['engine']}'s OpenAI server ({peer['dtype']}), driven after ours by the same "
                       "load generator with the same requests at the same times; ratios are ours over theirs "
                       "(throughput: higher is better; latencies: lower is better):", "", _peer_table(rep, peer)]
        cpu = _cpu_table(_series(rep))
        if cpu:
            md += ["", f"How the {rep['cpu_count']} cores were shared during each run (the load generator runs on "
                       "them too):", "", cpu]
        extra = [r for r in rep["results"] if "prompt_tokens_later_turns_mean" in r]
        if extra:
            md += ["", "First turn against later turns (which resend the history, served from the prefix cache):",
                   "", markdown_table(
                       ["offered conversations/s", "first: prompt tok", "first: TTFT p50", "later: prompt tok",
                        "later: cached %", "later: TTFT p50"],
                       [[r["offered_rate"], r["prompt_tokens_first_turn_mean"], r["ttft_first_turn_p50_s"],
                         r["prompt_tokens_later_turns_mean"], 100 * r["cached_fraction_later_turns"],
                         r["ttft_later_turns_p50_s"]] for r in extra])]
    write_section(section, "\n".join(md))


def add_arguments(p) -> None:
    p.add_argument("--url", default=None, help="a running server (default: start one on --model)")
    p.add_argument("--model", default=DEFAULT_MODEL, help="model for the server the benchmark starts")
    p.add_argument("--dtype", default=None, choices=["auto", "float32", "bfloat16"])
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--pdc", action="store_true", help="start the default PDC stack instead of `serve --colocated`")
    p.add_argument("--api-key", default=os.environ.get("MATRIXINFER_API_KEY"))
    p.add_argument("--rates", type=float, nargs="+", default=[1.0, 2.0, 4.0], help="offered loads, requests/s")
    p.add_argument("--num-requests", type=int, default=32, help="requests per rate (single-turn)")
    p.add_argument("--input-len", type=int, default=64, help="prompt tokens (per user turn in multi-turn mode)")
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--multi-turn", action="store_true", help="conversations: each turn resends the history")
    p.add_argument("--conversations", type=int, default=8, help="conversations per rate (multi-turn)")
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--enforce-eager", action="store_true", help="start the server with eager decode steps")
    p.add_argument("--offline-reference", action="store_true",
                   help="also run the same engine offline on --num-requests requests at once; with --rates inf "
                        "the report compares the served TPOT with the offline decode step at the same batch")
    p.add_argument("--vllm-python", default=None,
                   help="an interpreter with vLLM (CPU build): its OpenAI server is driven with the same requests "
                        "after ours, and the report compares the two")
    p.add_argument("--peers", default=None, help="a peers folder as in shared/peers (its venv_vllm is used)")
    p.add_argument("--name", default="serve", help="benchmarks/<name>.json and the BENCHMARKS.md section")
    p.add_argument("--no-write", action="store_true")
    p.add_argument("--json", action="store_true", help="print the report as one JSON line")
