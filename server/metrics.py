"""Prometheus metrics, kept in a registry owned by one app (no process-global state).

With several HTTP worker processes (``--api-workers``), ``PROMETHEUS_MULTIPROC_DIR`` is set and
prometheus_client keeps the counters and histograms in files there; every worker's /metrics then
reports the sum over all workers.
"""

import os
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

PREFIX = "llm"
# The Gateway API Inference Extension's model-server protocol names its gauges after vLLM's; its
# endpoint picker (and dashboards made for vLLM) read these.
VLLM_PREFIX = "vllm:"

TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
# Decode steps of a small model on a GPU take well under a millisecond.
ITL_BUCKETS = (0.0001, 0.00025, 0.0005, 0.00075, 0.001, 0.0015, 0.002, 0.003, 0.004, 0.005,
               0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5,
               0.75, 1.0, 2.5)
E2E_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
               50.0, 60.0, 120.0, 240.0, 480.0, 960.0)
QUEUE_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class EngineStatsCollector:
    """Gauges read from ``engine.stats()`` at scrape time; nothing while no engine is loaded.

    Each is exported under our name and, where the inference extension's model-server protocol
    asks for it, under vLLM's name with vLLM's ``model_name`` label and the same value."""

    def __init__(self, get_engine: Callable[[], object | None]):
        self._get_engine = get_engine
        self._created = time.time()

    def collect(self):
        engine = self._get_engine()
        if engine is None:
            return
        stats = engine.stats()
        total, used = int(stats.kv_blocks_total), int(stats.kv_blocks_used)
        cached = int(getattr(stats, "kv_blocks_cached", 0))
        for name, doc, value in (
            ("num_requests_running", "Requests being decoded.", stats.running),
            ("num_requests_waiting", "Requests waiting to be scheduled.", stats.waiting),
            ("kv_cache_blocks_total", "KV cache blocks in the pool.", total),
            ("kv_cache_blocks_used", "KV cache blocks in use.", used),
            ("kv_cache_usage_ratio", "Share of the KV cache blocks in use (0..1).",
             used / total if total else 0.0),
            ("kv_cache_blocks_cached", "KV cache blocks holding a cached prefix that no request holds.", cached),
            ("kv_cache_cached_ratio", "Share of the KV cache blocks holding a cached prefix no request holds (0..1).",
             cached / total if total else 0.0),
        ):
            yield GaugeMetricFamily(f"{PREFIX}_{name}", doc, value=value)
        yield from self._vllm_families(engine, stats, used / total if total else 0.0)
        for name, doc, value in (
            ("prefix_cache_queries_tokens", "Prompt tokens looked up in the prefix cache.",
             getattr(stats, "prefix_cache_queries", 0)),
            ("prefix_cache_hits_tokens", "Prompt tokens found in the prefix cache.",
             getattr(stats, "prefix_cache_hits", 0)),
            ("sampled_tokens", "Generated tokens, counted as each engine step's tokens arrive "
                               "(generation_tokens counts a request's when it finishes).",
             getattr(stats, "sampled_tokens", 0)),
        ):
            yield CounterMetricFamily(f"{PREFIX}_{name}", doc, value=value)

    def _vllm_families(self, engine, stats, usage: float):
        model = {"model_name": engine.model_name}
        for name, doc, value in (
            ("num_requests_running", "Requests being decoded (llm_num_requests_running).", stats.running),
            ("num_requests_waiting", "Requests waiting to be scheduled (llm_num_requests_waiting).",
             stats.waiting),
            ("kv_cache_usage_perc", "Share of the KV cache blocks in use, 1 meaning all "
                                    "(llm_kv_cache_usage_ratio).", usage),
        ):
            family = GaugeMetricFamily(VLLM_PREFIX + name, doc, labels=list(model))
            family.add_metric(list(model.values()), value)
            yield family
        info = engine.info
        cache = {"block_size": str(info.block_size), "num_gpu_blocks": str(info.num_blocks)}
        family = GaugeMetricFamily(VLLM_PREFIX + "cache_config_info",
                                   "KV cache configuration, in the labels (value 1).", labels=list(cache))
        family.add_metric(list(cache.values()), 1)
        yield family
        # No LoRA adapters are served: none running or waiting, none can be loaded. The value is
        # when that set last changed, which for this server is its start.
        lora = {"max_lora": "0", "running_lora_adapters": "", "waiting_lora_adapters": ""}
        family = GaugeMetricFamily(VLLM_PREFIX + "lora_requests_info",
                                   "LoRA adapters running and waiting, in the labels; the value is when "
                                   "they last changed.", labels=list(lora))
        family.add_metric(list(lora.values()), self._created)
        yield family


class Metrics:
    def __init__(self, get_engine: Callable[[], object | None]):
        shared = bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))
        self.registry = CollectorRegistry(auto_describe=True)
        # across processes the files are what is scraped, so the metrics themselves stay unlisted
        r = CollectorRegistry() if shared else self.registry
        self.ttft = Histogram(f"{PREFIX}_time_to_first_token_seconds",
                              "Time from arrival to the first generated token.",
                              buckets=TTFT_BUCKETS, registry=r)
        self.inter_token = Histogram(f"{PREFIX}_inter_token_latency_seconds",
                                     "Time between consecutive generated tokens of a request.",
                                     buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram(f"{PREFIX}_e2e_request_latency_seconds",
                             "Time from arrival to the last token of a finished request.",
                             buckets=E2E_BUCKETS, registry=r)
        self.queue = Histogram(f"{PREFIX}_request_queue_time_seconds",
                               "Time a request waited before its prefill started.",
                               buckets=QUEUE_BUCKETS, registry=r)
        self.prompt_tokens = Counter(f"{PREFIX}_prompt_tokens", "Prompt tokens of finished requests.",
                                     registry=r)
        self.prompt_chars = Counter(f"{PREFIX}_prompt_chars", "Characters of finished requests' prompts.",
                                    registry=r)
        self.prompt_chars_reused = Counter(
            f"{PREFIX}_prompt_chars_reused",
            "Prompt characters not encoded again: a kept prompt with the same start gave their token ids "
            "(prefix caching).", registry=r)
        self.generation_tokens = Counter(f"{PREFIX}_generation_tokens", "Generated tokens.",
                                         registry=r)
        self.finished = Counter(f"{PREFIX}_requests_finished", "Finished requests by finish reason.",
                                ["reason"], registry=r)
        self.rejected = Counter(f"{PREFIX}_requests_rejected",
                                "Requests refused before admission, by reason.", ["reason"], registry=r)
        self.http_requests = Counter(f"{PREFIX}_http_requests", "HTTP responses by route and status.",
                                     ["method", "route", "status"], registry=r)
        for reason in ("length", "stop", "eos", "abort", "error"):
            self.finished.labels(reason=reason)
        for reason in ("queue_full", "invalid", "too_long"):
            self.rejected.labels(reason=reason)
        self.registry.register(EngineStatsCollector(get_engine))
        if shared:
            MultiProcessCollector(self.registry)
        else:
            ProcessCollector(registry=self.registry)

    def render(self) -> bytes:
        return generate_latest(self.registry)
