"""Prometheus metrics at /metrics, under vLLM's names with the `graphrunner:` prefix.

Engine state (running / waiting requests, KV-cache usage, prefix-cache queries and hits,
preemptions, steps by CUDA graph mode) is read when /metrics is scraped, so the step loop pays
nothing for it (an engine process reports it with its outputs, at most every 50 ms, and when
idle); per-request latencies and token counts are observed on the event loop from AsyncLLM's
stats listener, when the caller takes an output."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# Buckets as vLLM's (seconds).
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
                0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                480.0, 960.0, 1920.0, 7680.0)

PREFIX = "graphrunner:"


class _EngineCollector:
    """Reads the engine's counters at scrape time."""

    def __init__(self, async_llm, model_name: str) -> None:
        self.async_llm, self.model_name = async_llm, model_name

    def collect(self):
        stats = self.async_llm.engine_stats()
        labels = ["model_name"]
        values = [self.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(PREFIX + name, doc, labels=labels)
            family.add_metric(values, value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(PREFIX + name, doc, labels=labels)
            family.add_metric(values, value)
            return family

        yield gauge("num_requests_running", "Requests in the running batch.", stats["num_running"])
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled (queued to the engine included).",
                    stats["num_waiting"] + self.async_llm.num_pending_adds)
        yield gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).", stats["kv_cache_usage"])
        yield gauge("prefix_cache_hit_rate", "Prefix-cache hits / queries, in tokens, since start.",
                    stats["prefix_cache_hit_rate"])
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      stats["prefix_cache_queries"])
        yield counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.", stats["prefix_cache_hits"])
        yield counter("num_preemptions", "Requests preempted (recomputed later) to free KV blocks.",
                      stats["num_preemptions"])
        steps = CounterMetricFamily(PREFIX + "engine_steps", "Model steps by CUDA graph runtime mode "
                                    "(FULL, PIECEWISE, NONE = eager).", labels=labels + ["mode"])
        counts = stats.get("steps_by_mode", {})
        for mode in ("FULL", "PIECEWISE", "NONE"):
            steps.add_metric(values + [mode], counts.get(mode, 0))
        yield steps


class ServerMetrics:
    """The server's registry; `observe` is AsyncLLM's stats listener."""

    def __init__(self, async_llm, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name"]
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens of requests that started generating.",
                                     labels, registry=self.registry).labels(model_name)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Generated tokens.", labels,
                                         registry=self.registry).labels(model_name)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Arrival to first token.", labels,
                              buckets=_TTFT_BUCKETS, registry=self.registry).labels(model_name)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "Time between a request's tokens.", labels,
                             buckets=_ITL_BUCKETS, registry=self.registry).labels(model_name)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Arrival to the last token.", labels,
                             buckets=_E2E_BUCKETS, registry=self.registry).labels(model_name)
        self.finished = Counter(PREFIX + "request_success", "Finished requests by finish reason.",
                                labels + ["finished_reason"], registry=self.registry)
        self.registry.register(_EngineCollector(async_llm, model_name))

    def observe(self, event: str, request_id: str, stamp: float, **fields) -> None:
        if event == "first_token":
            self.ttft.observe(fields["ttft"])
            self.prompt_tokens.inc(fields["num_prompt_tokens"])
            self.generation_tokens.inc(fields["num_tokens"])
        elif event == "tokens":
            self.itl.observe(fields["itl"])
            self.generation_tokens.inc(fields["num_tokens"])
        elif event == "finished":
            self.e2e.observe(fields["e2e"])
            self.finished.labels(self.model_name, fields["finish_reason"]).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
