"""The server's per-request metrics (runner/server/metrics.py) keep their own counters and
histograms (no lock, a bisect per observation) and expose them at scrape time: the same samples as
prometheus_client's Histogram and Counter fed the same observations."""

from __future__ import annotations

import random

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from runner.server import metrics as server_metrics
from runner.server.metrics import ServerMetrics


class _Engine:
    num_pending_adds = 0

    def engine_stats(self) -> dict:
        return {"num_running": 0, "num_waiting": 0, "kv_cache_usage": 0.0, "prefix_cache_hit_rate": 0.0,
                "prefix_cache_queries": 0, "prefix_cache_hits": 0, "num_preemptions": 0}


def _samples(text: str, prefix: str) -> dict:
    return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples
            if s.name.startswith(prefix) and not s.name.endswith("_created")}


def test_metrics_equal_prometheus_clients_own_for_the_same_observations():
    ours = ServerMetrics(_Engine(), "m")
    registry = CollectorRegistry()
    itl = Histogram("graphrunner:inter_token_latency_seconds", "", buckets=server_metrics._ITL_BUCKETS,
                    registry=registry)
    ttft = Histogram("graphrunner:time_to_first_token_seconds", "", buckets=server_metrics._TTFT_BUCKETS,
                     registry=registry)
    e2e = Histogram("graphrunner:e2e_request_latency_seconds", "", buckets=server_metrics._E2E_BUCKETS,
                    registry=registry)
    tokens = Counter("graphrunner:generation_tokens", "", registry=registry)
    prompt = Counter("graphrunner:prompt_tokens", "", registry=registry)
    finished = Counter("graphrunner:request_success", "", ["finished_reason"], registry=registry)
    rng = random.Random(0)
    for i in range(500):
        value = rng.choice([0.001, 0.005, 0.1, 2.5]) if i % 7 == 0 else rng.expovariate(20.0)  # bounds too
        if i % 50 == 0:
            ours.observe("first_token", f"r{i}", 0.0, ttft=value * 10, num_prompt_tokens=7, num_tokens=2)
            ttft.observe(value * 10), prompt.inc(7), tokens.inc(2)
        else:
            ours.observe("tokens", f"r{i}", 0.0, itl=value, num_tokens=1)
            itl.observe(value), tokens.inc(1)
        if i % 60 == 0:
            reason = "stop" if i % 120 else "length"
            ours.observe("finished", f"r{i}", 0.0, e2e=value * 100, finish_reason=reason)
            e2e.observe(value * 100), finished.labels(reason).inc()
    per_request = ("graphrunner:inter_token", "graphrunner:time_to_first", "graphrunner:e2e",
                   "graphrunner:generation", "graphrunner:prompt", "graphrunner:request")
    mine = {key: value for key, value in _samples(ours.render().decode(), "graphrunner:").items()
            if key[0].startswith(per_request)}
    reference = _samples(generate_latest(registry).decode(), "graphrunner:")
    assert len(reference) > 60 and mine == reference   # every bucket, count, sum and counter
