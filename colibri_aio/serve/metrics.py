"""``GET /metrics``: Prometheus text from the server's requests, the engine's counters and the model's disk.

Request figures (time to first token, queue wait, duration, tok/s of the
last request) are recorded as requests finish. Engine and disk figures are
read at scrape time: :class:`EngineStats` (the numbers ``run --stats``
shows) and ``/proc/diskstats`` for the device holding the model (r/s, read
bytes/s, utilisation over the time since the previous scrape, and the raw
counters for Prometheus' own ``rate()``).
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics,
                               generate_latest)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector

from colibri_aio.engine.stats import EngineStats
from colibri_aio.engine.device import Snapshot, between
from colibri_aio.policy.backpressure import DeviceSample

if TYPE_CHECKING:
    from colibri_aio.engine.engine import Engine
    from colibri_aio.engine.line import RequestLine

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class ServerMetrics:
    """The server's metrics registry: request histograms plus the engine and disk read at each scrape."""

    def __init__(self, engine: "Engine", line: "RequestLine") -> None:
        disable_created_metrics()  # the *_created series only repeat the start time
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        self.requests = Counter("colibri_requests", "Requests answered, by endpoint and HTTP status",
                                ["endpoint", "status"], registry=r)
        self.ttft = Histogram("colibri_time_to_first_token_seconds",
                              "From a request's arrival to its first token (queue wait included)",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.queue_wait = Histogram("colibri_queue_wait_seconds", "From a request's arrival to its turn at the engine",
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.duration = Histogram("colibri_request_duration_seconds", "From a generation request's arrival to its end",
                                  buckets=LATENCY_BUCKETS, registry=r)
        self.last_decode_tps = Gauge("colibri_last_request_decode_tokens_per_second",
                                     "Decode speed of the last finished request", registry=r)
        self.last_prefill_tps = Gauge("colibri_last_request_prefill_tokens_per_second",
                                      "Prefill speed of the last finished request (cached tokens excluded)", registry=r)
        self.last_ttft = Gauge("colibri_last_request_time_to_first_token_seconds",
                               "Time to first token of the last request", registry=r)
        r.register(_EngineCollector(engine, line))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector(Collector):
    """Engine counters, queue state and disk load, read when Prometheus scrapes."""

    MIN_DISK_INTERVAL = 0.5  # seconds; closer scrapes repeat the last disk sample instead of a noisy one

    def __init__(self, engine: "Engine", line: "RequestLine") -> None:
        self.engine, self.line = engine, line
        self._disk = engine.device  # the engine's DeviceMonitor of the model's disk (None: no block device)
        self._disk_last: Snapshot | None = self._disk.read() if self._disk is not None else None
        self._disk_sample: DeviceSample | None = None

    def collect(self) -> Iterator[Metric]:
        yield from self._queue()
        yield from _engine_metrics(self.engine.stats())
        if self._disk is not None:
            yield from self._device()

    def _queue(self) -> Iterator[Metric]:
        yield GaugeMetricFamily("colibri_queue_waiting", "Requests waiting for the engine", value=self.line.waiting)
        yield GaugeMetricFamily("colibri_queue_capacity", "Requests allowed to wait (--max-queue)",
                                value=self.line.max_waiting)
        yield GaugeMetricFamily("colibri_engine_busy", "1 while every sequence slot holds a request",
                                value=int(self.line.busy))
        yield GaugeMetricFamily("colibri_requests_generating", "Requests holding a sequence slot",
                                value=self.line.holders)

    def _device(self) -> Iterator[Metric]:
        assert self._disk is not None
        now = self._disk.read()
        if now is None:
            return
        if self._disk_last is None or now.t - self._disk_last.t >= self.MIN_DISK_INTERVAL:
            self._disk_sample = between(self._disk_last, now) or self._disk_sample
            self._disk_last = now
        counters = now.counters
        labels = ["device"], [self._disk.device]
        if counters is not None:
            yield _counter("colibri_disk_reads_completed", "Reads the model's device completed", counters.reads, labels)
            yield _counter("colibri_disk_read_bytes", "Bytes the model's device read", counters.sectors_read * 512,
                           labels)
            yield _counter("colibri_disk_io_seconds", "Time the model's device had I/O in flight",
                           counters.io_ticks_ms / 1000, labels)
        s = self._disk_sample
        if s is not None:
            yield _gauge("colibri_disk_reads_per_second", "Device reads/s since the previous scrape",
                         s.reads / s.interval, labels)
            yield _gauge("colibri_disk_read_bytes_per_second", "Device read bytes/s since the previous scrape",
                         s.read_bps, labels)
            yield _gauge("colibri_disk_utilization", "Share of time with device I/O in flight (0..1), since the "
                         "previous scrape", s.util, labels)
            yield _gauge("colibri_disk_read_await_seconds", "Mean device read latency since the previous scrape",
                         s.r_await_ms / 1000, labels)


def _engine_metrics(s: EngineStats) -> Iterator[Metric]:
    yield _counter("colibri_prompt_tokens", "Prompt tokens prefilled", s.prompt_tokens)
    yield _counter("colibri_prompt_tokens_cached", "Prompt tokens found in the KV cache (not prefilled)",
                   s.prompt_tokens_cached)
    yield _counter("colibri_generated_tokens", "Tokens generated", s.generated_tokens)
    yield _counter("colibri_prefill_seconds", "Time spent prefilling", s.prefill_s)
    yield _counter("colibri_decode_seconds", "Time spent decoding", s.decode_s)
    yield _gauge("colibri_decode_tokens_per_second", "Tokens generated per second of decode, since start",
                 s.generated_tokens / s.decode_s if s.decode_s else 0.0)
    yield _gauge("colibri_prefill_tokens_per_second", "Prompt tokens prefilled per second of prefill, since start",
                 s.prompt_tokens / s.prefill_s if s.prefill_s else 0.0)
    yield _gauge("colibri_sequence_slots", "Sequence slots the engine holds (--parallel)", s.sequences_total)
    yield _gauge("colibri_sequence_slots_busy", "Sequence slots holding a generation", s.sequences_busy)
    yield _counter("colibri_batch_steps", "Decode steps over every decoding stream together (--parallel > 1)",
                   s.batch_steps)
    yield _gauge("colibri_batch_size", "Streams in the last batched decode step", s.batch_last_rows)
    yield _gauge("colibri_batch_size_mean", "Streams per batched decode step, on average", s.batch_rows_mean)
    yield _gauge("colibri_batch_union_experts_mean",
                 "Distinct experts a MoE layer read per batched step (the union of its streams' choices), on average",
                 s.batch_union_mean)
    lookups = CounterMetricFamily("colibri_expert_lookups", "Expert lookups by where the expert was found",
                                  labels=["result"])
    for result, n in (("pinned", s.pinned_hits), ("cached", s.cached_hits), ("prefetched", s.prefetch_hits),
                      ("missed", s.misses)):
        lookups.add_metric([result], n)
    yield lookups
    yield _gauge("colibri_expert_hit_rate", "Share of expert lookups served from memory, since start", s.hit_rate)
    yield _counter("colibri_expert_bytes_read", "Expert bytes delivered by the reader", s.bytes_read)
    yield _counter("colibri_io_bytes", "Bytes asked of the disk for experts (aligned ranges)", s.io_bytes)
    yield _counter("colibri_read_busy_seconds", "Time with at least one expert read in flight", s.read_busy_s)
    yield _gauge("colibri_expert_reads_in_flight", "Expert reads in flight now", s.reads_in_flight)
    yield _gauge("colibri_expert_slots_used", "Expert cache slots holding an expert", s.slots_used)
    yield _gauge("colibri_expert_slots", "Expert cache slots", s.slots_total)
    yield _counter("colibri_prefetch_reads", "Experts read ahead on a lookahead prediction", s.prefetch_reads)
    yield _counter("colibri_prefetch_wasted", "Prefetched experts evicted unused", s.prefetch_wasted)
    yield _gauge("colibri_prefetch_on", "1 while prefetch is on", int(s.prefetch_on))
    info = InfoMetricFamily("colibri_prefetch", "Prefetch state and the reason for it")
    info.add_metric([], {"state": "on" if s.prefetch_on else "off", "reason": s.prefetch_reason})
    yield info
    yield _gauge("colibri_lookahead_precision", "Share of prefetched experts that were used", s.lookahead_precision)
    yield _gauge("colibri_lookahead_recall", "Share of used experts that were predicted", s.lookahead_recall)
    yield _gauge("colibri_rss_bytes", "Resident memory of the server", s.rss)
    yield _gauge("colibri_peak_rss_bytes", "Peak resident memory of the server", s.peak_rss)


def _counter(name: str, doc: str, value: float, labels: tuple[list[str], list[str]] | None = None) -> Metric:
    m = CounterMetricFamily(name, doc, labels=labels[0] if labels else None)
    m.add_metric(labels[1] if labels else [], value)
    return m


def _gauge(name: str, doc: str, value: float, labels: tuple[list[str], list[str]] | None = None) -> Metric:
    m = GaugeMetricFamily(name, doc, labels=labels[0] if labels else None)
    m.add_metric(labels[1] if labels else [], value)
    return m
