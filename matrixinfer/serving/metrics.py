"""Prometheus metrics with vLLM's names under the `matrixinfer:` prefix. Engine state
(running/waiting, KV usage, prefix cache) is read from the engine's stats at scrape time;
latencies and tokens are observed by the API as requests finish."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

P = "matrixinfer:"
disable_created_metrics()  # no *_created series, as in vLLM
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 60.0, 120.0)


class _EngineCollector:
    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        s, model = self.engine.stats(), [self.engine.model_name]
        yield from _per_model(GaugeMetricFamily, model, [
            ("num_requests_running", "Sequences being computed.", s.num_running),
            ("num_requests_waiting", "Sequences waiting to be scheduled.", s.num_waiting),
            ("kv_cache_usage_perc", "KV-cache usage, 1 means 100 percent.", s.kv_cache_usage),
        ])
        yield from _per_model(CounterMetricFamily, model, [
            ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", s.prefix_cache_queries),
            ("prefix_cache_hits", "Prompt tokens found in the prefix cache.", s.prefix_cache_hits),
        ])
        if s.spec_num_drafts:
            yield from _spec_decode_metrics(s, model)
        if hasattr(self.engine, "role_stats"):  # a PDC front end: per-role instances and the hand-off
            yield from _pdc_metrics(self.engine, model[0])


def _per_model(family, model: list[str], entries):
    """One metric family of `family`'s kind per (name, help, value), labelled by model name."""
    for name, doc, value in entries:
        m = family(P + name, doc, labels=["model_name"])
        m.add_metric(model, value)
        yield m


def _spec_decode_metrics(s, model: list[str]):
    """vLLM's speculative-decoding counters, and the mean acceptance length (tokens per step)."""
    yield from _per_model(CounterMetricFamily, model, [
        ("spec_decode_num_drafts", "Verification steps of a request with drafts.", s.spec_num_drafts),
        ("spec_decode_num_draft_tokens", "Draft tokens verified.", s.spec_num_draft_tokens),
        ("spec_decode_num_accepted_tokens", "Draft tokens accepted.", s.spec_num_accepted_tokens),
    ])
    c = CounterMetricFamily(P + "spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, per draft "
                            "position.", labels=["model_name", "position"])
    for pos, value in enumerate(s.spec_accepted_per_pos):
        c.add_metric([*model, str(pos)], value)
    yield c
    g = GaugeMetricFamily(P + "spec_decode_mean_acceptance_length", "Tokens a verification step yields on "
                          "average: 1 + accepted drafts per step.", labels=["model_name"])
    g.add_metric(model, 1 + s.spec_num_accepted_tokens / s.spec_num_drafts)
    yield g


# name -> (kind, help, key of Instance.info())
PDC_INSTANCE_METRICS = {
    "pdc_instance_up": ("gauge", "1 if the instance's process is alive.", "alive"),
    "pdc_requests": ("gauge", "Requests the front end has on the instance.", "requests"),
    "pdc_queued_prompt_tokens": ("gauge", "Prompt tokens on the instance not yet through prefill.",
                                 "queued_prompt_tokens"),
    "pdc_num_requests_running": ("gauge", "Sequences the instance is computing.", "running"),
    "pdc_num_requests_waiting": ("gauge", "Sequences waiting on the instance.", "waiting"),
    "pdc_kv_cache_usage_perc": ("gauge", "The instance's KV-cache usage, 1 means 100 percent.", "kv_cache_usage"),
    "pdc_handoffs": ("counter", "Requests a prefill instance handed to decode.", "handed_off"),
    "pdc_kv_loaded_tokens": ("counter", "Tokens whose KV the instance loaded from EMS instead of computing.",
                             "kv_loaded_tokens"),
    "pdc_instance_restarts": ("counter", "Times the instance's process was restarted.", "restarts"),
}


def _pdc_metrics(engine, model: str):
    infos = engine.role_stats()
    for name, (kind, doc, key) in PDC_INSTANCE_METRICS.items():
        family = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
        m = family(P + name, doc, labels=["model_name", "role", "instance"])
        for info in infos:
            m.add_metric([model, info["role"], info["instance"]], float(info[key]))
        yield m
    loaded = sum(i["kv_loaded_tokens"] for i in infos if i["role"] == "decode")
    c = CounterMetricFamily(P + "pdc_kv_handoff_bytes", "Latent KV bytes decode instances loaded from EMS.",
                            labels=["model_name"])
    c.add_metric([model], loaded * engine.kv_bytes_per_token)
    yield c
    h = engine.handoff_latency
    buckets = [(str(b), c) for b, c in zip(h.buckets, h.counts)] + [("+Inf", h.total)]
    fam = HistogramMetricFamily(P + "pdc_kv_handoff_seconds", "From a request's first token (prefill) to its "
                                "second (decode): the hand-off through EMS as the client sees it.",
                                labels=["model_name"])
    fam.add_metric([model], buckets, h.sum)
    yield fam



class ServingMetrics:
    def __init__(self, engine):
        self.model_name = engine.model_name
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram(P + "time_to_first_token_seconds", "Time to first token.", ["model_name"],
                              buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram(P + "time_per_output_token_seconds", "Mean time per output token after the first, "
                              "per request.", ["model_name"], buckets=TPOT_BUCKETS, registry=r)
        self.e2e = Histogram(P + "e2e_request_latency_seconds", "Request latency from arrival to last token.",
                             ["model_name"], buckets=E2E_BUCKETS, registry=r)
        self.prompt_tokens = Counter(P + "prompt_tokens", "Prompt tokens processed.", ["model_name", "tenant"],
                                     registry=r)
        self.generation_tokens = Counter(P + "generation_tokens", "Tokens generated.", ["model_name", "tenant"],
                                         registry=r)
        self.request_success = Counter(P + "request_success", "Finished requests.", ["model_name", "finished_reason"],
                                       registry=r)
        self.request_rejected = Counter(P + "request_rejected", "Requests refused before admission.",
                                        ["model_name", "reason"], registry=r)
        self.cached_prompt_tokens = Counter(P + "prompt_tokens_cached", "Prompt tokens served from the prefix "
                                            "cache (local or the EMS pool), per tenant.", ["model_name", "tenant"],
                                            registry=r)
        r.register(_EngineCollector(engine))

    def observe(self, tenant: str, prompt_tokens: int, completion_tokens: int, ttft: float | None, e2e: float,
                longest_choice: int, finish_reasons: list[str | None], cached_tokens: int = 0) -> None:
        """One finished request. TPOT is over the longest choice (n > 1 choices decode together)."""
        m = self.model_name
        self.prompt_tokens.labels(m, tenant).inc(prompt_tokens)
        self.cached_prompt_tokens.labels(m, tenant).inc(cached_tokens)
        self.generation_tokens.labels(m, tenant).inc(completion_tokens)
        self.e2e.labels(m).observe(e2e)
        if ttft is not None:
            self.ttft.labels(m).observe(ttft)
            if longest_choice > 1:
                self.tpot.labels(m).observe((e2e - ttft) / (longest_choice - 1))
        for reason in finish_reasons:
            self.request_success.labels(m, reason or "abort").inc()

    def rejected(self, reason: str) -> None:
        self.request_rejected.labels(self.model_name, reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
