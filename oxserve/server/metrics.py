"""Prometheus metrics (vLLM's names under the `oxserve:` prefix).

Engine gauges and counters are read from the engine thread's latest `EngineStats` at
scrape time, so nothing is counted twice; latency histograms are observed on the event
loop when a request's last output arrives. Each server has its own registry.
"""

from __future__ import annotations

from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from oxserve.outputs import RequestOutput
from oxserve.engine.engine import EngineStats
from oxserve.engine.memory import IDLE_TRIM, heap_stats, resident_bytes
from oxserve.server.async_engine import RequestTiming
from oxserve.server.quotas import KeyQuota

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)
TOKEN_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)


class ServerMetrics:
    def __init__(self, snapshot: Callable[[], EngineStats], keys: list[KeyQuota] | None = None):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(snapshot))
        self.registry.register(_MemoryCollector())
        if keys:
            self.registry.register(_KeyCollector(keys))
        self.ttft = Histogram(
            "oxserve:time_to_first_token_seconds", "Time from arrival to the first generated token.",
            buckets=LATENCY_BUCKETS, registry=self.registry,
        )
        self.tpot = Histogram(
            "oxserve:time_per_output_token_seconds", "Mean time per output token after the first, per request.",
            buckets=TOKEN_LATENCY_BUCKETS, registry=self.registry,
        )
        self.e2e = Histogram(
            "oxserve:e2e_request_latency_seconds", "Time from arrival to the last token.",
            buckets=LATENCY_BUCKETS, registry=self.registry,
        )
        self.finished = Counter(
            "oxserve:request_success", "Finished requests by finish reason.", ["finished_reason"], registry=self.registry
        )

    def observe_finished(self, timing: RequestTiming, output: RequestOutput, now: float) -> None:
        completion = output.outputs[0]
        self.finished.labels(completion.finish_reason).inc()
        if completion.finish_reason == "abort" or timing.first_token is None:
            return  # a cut-off request says nothing about latency
        self.ttft.observe(timing.first_token - timing.arrival)
        self.e2e.observe(now - timing.arrival)
        if len(completion.token_ids) > 1:
            self.tpot.observe((now - timing.first_token) / (len(completion.token_ids) - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    def __init__(self, snapshot: Callable[[], EngineStats]):
        self.snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        s = self.snapshot()
        yield GaugeMetricFamily("oxserve:num_requests_running", "Requests in the running batch.", value=s.num_running)
        yield GaugeMetricFamily("oxserve:num_requests_waiting", "Requests waiting to be scheduled.", value=s.num_waiting)
        yield GaugeMetricFamily("oxserve:num_waiting_tokens", "Tokens the waiting requests have yet to compute.",
                                value=s.num_waiting_tokens)  # fmt: skip
        yield GaugeMetricFamily("oxserve:kv_cache_usage_perc", "Fraction of cache blocks in use (0-1).", value=s.cache_usage)
        yield CounterMetricFamily("oxserve:num_preemptions", "Preemptions (recompute) so far.", value=s.num_preemptions)
        yield CounterMetricFamily("oxserve:prompt_tokens", "Prompt tokens prefilled.", value=s.prompt_tokens)
        yield CounterMetricFamily("oxserve:generation_tokens", "Tokens generated.", value=s.generation_tokens)
        # vLLM's names: acceptance rate = accepted / draft, mean accept length = 1 + accepted / verifying steps.
        yield CounterMetricFamily("oxserve:spec_decode_num_drafts", "Steps that verified a request's drafts.",
                                  value=s.spec_drafts)
        yield CounterMetricFamily("oxserve:spec_decode_num_draft_tokens", "Speculative draft tokens verified.",
                                  value=s.spec_draft_tokens)
        yield CounterMetricFamily("oxserve:spec_decode_num_accepted_tokens", "Speculative draft tokens accepted.",
                                  value=s.spec_accepted_tokens)
        yield CounterMetricFamily("oxserve:grammar_mask_seconds", "Time spent on structured-output token masks.",
                                  value=s.grammar_mask_seconds)
        yield CounterMetricFamily("oxserve:grammar_mask_steps", "Steps that applied a structured-output mask.",
                                  value=s.grammar_mask_steps)
        # Prefix caching, vLLM's names for the token counters: hit rate = hits / queries.
        usage = s.prefix_checkpoints / s.prefix_checkpoint_capacity if s.prefix_checkpoint_capacity else 0.0
        for kind, name, doc, value in (
            (CounterMetricFamily, "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", s.prefix_queries),
            (CounterMetricFamily, "prefix_cache_hits", "Prompt tokens found in the prefix cache (not computed).", s.prefix_hits),
            (CounterMetricFamily, "prefix_cache_requests", "Requests that looked up the prefix cache.", s.prefix_requests),
            (CounterMetricFamily, "prefix_cache_hit_requests", "Requests that found a cached prefix.", s.prefix_hit_requests),
            (GaugeMetricFamily, "prefix_checkpoints", "KDA state checkpoints held.", s.prefix_checkpoints),
            (GaugeMetricFamily, "prefix_checkpoint_usage_perc", "Fraction of the checkpoint pool in use (0-1).", usage),
            (CounterMetricFamily, "prefix_checkpoint_evictions", "KDA checkpoints evicted.", s.prefix_checkpoint_evictions),
            (GaugeMetricFamily, "prefix_cached_blocks", "Cache blocks holding a hashed prefix (in use or free).",
             s.prefix_cached_blocks),
            (CounterMetricFamily, "prefix_block_evictions", "Hashed cache blocks reused for other content.",
             s.prefix_block_evictions),
            (CounterMetricFamily, "mm_items_encoded", "Images and videos encoded by the vision tower.", s.mm_items_encoded),
            (CounterMetricFamily, "mm_items_cached", "Images and videos found in the encoder cache.", s.mm_items_cached),
        ):
            yield kind(f"oxserve:{name}", doc, value=value)


class _MemoryCollector:
    """The process's memory: resident, and glibc's heap split into bytes in use and free bytes
    malloc holds. A leak shows as in-use bytes climbing; allocator retention as free-held
    bytes climbing while in-use stays flat (docs/reliability.md#soak)."""

    def collect(self) -> Iterator[Metric]:
        if (rss := resident_bytes()) is not None:
            yield GaugeMetricFamily("oxserve:resident_memory_bytes", "Resident memory of the server process (RSS).", value=rss)
        heap = heap_stats()
        if heap is None:  # not glibc (or glibc < 2.33): no split to show
            return
        yield GaugeMetricFamily("oxserve:heap_in_use_bytes", "malloc'd bytes in use, all arenas and mmapped blocks.",
                                value=heap.in_use)  # fmt: skip
        yield GaugeMetricFamily("oxserve:heap_free_held_bytes", "Freed bytes glibc malloc keeps in its arenas (resident or not).",
                                value=heap.free_held)  # fmt: skip
        yield GaugeMetricFamily("oxserve:heap_mmapped_bytes", "In-use bytes in blocks mmapped on their own (past the mmap threshold).",
                                value=heap.mmapped)  # fmt: skip
        yield GaugeMetricFamily("oxserve:heap_arenas", "glibc malloc arenas (the main one and per-thread ones).", value=heap.arenas)
        # Free-held bytes stay counted after a trim (the chunks stay free in malloc, their pages go back): these say what went.
        yield CounterMetricFamily("oxserve:heap_trims", "malloc_trim calls while the engine was idle.", value=IDLE_TRIM.trims)
        yield CounterMetricFamily("oxserve:heap_trim_released_bytes", "Resident bytes the idle trims gave back to the OS.",
                                  value=IDLE_TRIM.released_bytes)  # fmt: skip
        yield CounterMetricFamily("oxserve:heap_trim_seconds", "Time the idle trims took.", value=IDLE_TRIM.seconds)


class _KeyCollector:
    """Per API key, labelled by the key's name (never the key)."""

    def __init__(self, keys: list[KeyQuota]):
        self.keys = keys

    def collect(self) -> Iterator[Metric]:
        requests = CounterMetricFamily("oxserve:key_requests", "Requests admitted, per API key.", labels=["key"])
        tokens = CounterMetricFamily("oxserve:key_tokens", "Prompt and generated tokens charged, per API key.", labels=["key"])
        in_flight = GaugeMetricFamily("oxserve:key_requests_in_flight", "Requests in flight, per API key.", labels=["key"])
        limited = CounterMetricFamily("oxserve:key_rate_limited", "Requests refused (429) per API key and limit.",
                                      labels=["key", "limit"])  # fmt: skip
        for q in self.keys:
            requests.add_metric([q.name], q.num_requests)
            tokens.add_metric([q.name], q.num_tokens)
            in_flight.add_metric([q.name], q.in_flight)
            for limit, n in q.num_limited.items():
                limited.add_metric([q.name, limit.replace(" ", "_")], n)
        yield from (requests, tokens, in_flight, limited)
