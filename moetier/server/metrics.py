"""`/metrics` through prometheus_client: a collector that reads, at each scrape, the engine's
queues, pages, prefix-cache tokens, steps, preemptions and aborts (`moetier_engine_*`), the
confidence gate's quality meter where it is on (`moetier_quality_meter_*`), speculative
decoding's drafts where it is on (`moetier_spec_*`), and the
residency counters per tier (`moetier_residency_*`, residency/telemetry.py's METRICS), and the
server's answers by route and status and its failed streams (`moetier_http_*`), each sample
labelled with the model's name; the exposition format follows the scraper's Accept
header."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from moetier.engine.async_engine import EngineStats
from moetier.engine.speculative import SpecStats
from moetier.residency.telemetry import METRICS, ResidencyTelemetry
from moetier.server.state import ServerState

# (name, kind, help, the EngineStats field)
ENGINE_METRICS = (
    ("running_requests", "gauge", "requests being computed", "running"),
    ("waiting_requests", "gauge", "requests waiting for KV pages or a slot", "waiting"),
    ("kv_pages_used", "gauge", "KV cache pages held by requests", "pages_used"),
    ("kv_pages_free", "gauge", "KV cache pages free (cached ones too)", "pages_free"),
    ("prefix_queried_tokens_total", "counter", "prompt tokens looked up in the prefix cache",
     "prefix_queried_tokens"),
    ("prefix_hit_tokens_total", "counter", "prompt tokens found in the prefix cache",
     "prefix_hit_tokens"),
    ("steps_total", "counter", "engine steps run", "steps"),
    ("preemptions_total", "counter", "requests preempted for KV pages", "preemptions"),
    ("aborted_total", "counter", "requests ended early (client gone, shutdown)", "aborted"),
)  # fmt: skip
# the confidence gate's live quality meter (--quality-meter; engine/quality_meter.py):
# (name, kind, help, the MeterStats field)
METER_METRICS = (
    ("requests_total", "counter", "requests metered (each with a delta-everywhere twin)",
     "requests"),
    ("positions_total", "counter", "output positions compared with the delta everywhere",
     "positions"),
    ("kld_mean", "gauge", "mean KL divergence (nats) of the delta-everywhere model's next-token "
     "distribution from the gated model's, over the positions compared", "mean_kld"),
    ("top1_disagreement_rate", "gauge", "share of the positions compared where the gated and "
     "delta-everywhere models' top tokens differ", "disagreement_rate"),
)  # fmt: skip


def _family(
    name: str, kind: str, help_text: str, labels: list[str]
) -> CounterMetricFamily | GaugeMetricFamily:
    if kind == "counter":
        return CounterMetricFamily(name, help_text, labels=labels)
    return GaugeMetricFamily(name, help_text, labels=labels)


class ServerCollector(Collector):
    """The engine's stats and the residency counters, read when scraped (None: not there)."""

    def __init__(
        self,
        model_name: str,
        stats: Callable[[], EngineStats | None],
        telemetry: Callable[[], ResidencyTelemetry | None],
        http: ServerState | None = None,
    ) -> None:
        self.model_name = model_name
        self.stats = stats
        self.telemetry = telemetry
        self.http = http  # its answers by route and status, and failed streams

    def collect(self) -> Iterator[Metric]:
        stats = self.stats()
        if stats is not None:
            for name, kind, help_text, attr in ENGINE_METRICS:
                family = _family(f"moetier_engine_{name}", kind, help_text, ["model"])
                family.add_metric([self.model_name], float(getattr(stats, attr)))
                yield family
            if stats.spec is not None:
                yield from _spec_families(stats.spec, self.model_name)
            for name, kind, help_text, attr in METER_METRICS if stats.meter is not None else ():
                family = _family(f"moetier_quality_meter_{name}", kind, help_text, ["model"])
                family.add_metric([self.model_name], float(getattr(stats.meter, attr)))
                yield family
        if self.http is not None:
            answered = CounterMetricFamily(
                "moetier_http_responses_total",
                "HTTP answers by route and status (routes the app does not have: other)",
                labels=["route", "status", "model"],
            )
            for (route, status), count in sorted(self.http.responses.items()):
                answered.add_metric([route, str(status), self.model_name], count)
            yield answered
            failed = CounterMetricFamily(
                "moetier_http_stream_errors_total",
                "event streams that ended in an error event (answered 200, then failed)",
                labels=["route", "model"],
            )
            for route, count in sorted(self.http.stream_errors.items()):
                failed.add_metric([route, self.model_name], count)
            yield failed
        counters = self.telemetry()
        if counters is not None:
            for name, kind, help_text, value in METRICS:
                family = _family(f"moetier_residency_{name}", kind, help_text, ["tier", "model"])
                for tier, tier_counters in counters.tiers.items():
                    family.add_metric([tier, self.model_name], float(value(tier_counters)))
                yield family


def _spec_families(spec: SpecStats, model: str) -> Iterator[Metric]:
    """Speculative decoding (--speculative-tokens): drafts proposed and accepted by position
    (0: the first draft after a token), verify steps, and the mean drafts accepted a step."""
    drafted = CounterMetricFamily(
        "moetier_spec_drafted_total", "draft tokens proposed, by position in the draft",
        labels=["position", "model"],
    )  # fmt: skip
    accepted = CounterMetricFamily(
        "moetier_spec_accepted_total", "draft tokens accepted, by position in the draft",
        labels=["position", "model"],
    )  # fmt: skip
    for position, (d, a) in enumerate(zip(spec.drafted, spec.accepted, strict=True)):
        drafted.add_metric([str(position), model], d)
        accepted.add_metric([str(position), model], a)
    yield drafted
    yield accepted
    steps = CounterMetricFamily(
        "moetier_spec_verify_steps_total",
        "a request's steps that verified drafts",
        labels=["model"],
    )
    steps.add_metric([model], spec.steps)
    yield steps
    mean = GaugeMetricFamily(
        "moetier_spec_mean_accepted", "draft tokens accepted per verify step (a step gives "
        "this + 1 tokens)", labels=["model"],
    )  # fmt: skip
    mean.add_metric([model], spec.mean_accepted)
    yield mean


def registry_of(collector: ServerCollector) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return registry


def exposition(registry: CollectorRegistry, accept: str) -> tuple[bytes, str]:
    """(body, content type) of a scrape that sent `accept`."""
    encoder, content_type = choose_encoder(accept)
    return encoder(registry), content_type
