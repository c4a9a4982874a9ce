"""Residency telemetry: per-tier counters and their Prometheus text exposition.

The tiers are where an expert blob can be found when a layer needs it: "gpu" (slot pool),
"host" (pinned RAM) and "disk" (experts.bin). Each tier counts the requests it served (hits)
and passed down (misses), the bytes moved into it and the seconds its copy path was busy
(so GB/s), the seconds compute stalled waiting for it, and the prefetches issued into it and
later used (so prefetch precision). Rendering follows the text format 0.0.4 of
https://prometheus.io/docs/instrumenting/exposition_formats/ : a HELP and a TYPE line per
family, then one sample per tier, `name{tier="gpu"} value`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

TIERS = ("gpu", "host", "disk")
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass
class TierCounters:
    hits: int = 0
    misses: int = 0
    bytes: int = 0  # moved into this tier
    busy_seconds: float = 0.0  # its copy path was moving bytes
    stall_seconds: float = 0.0  # compute waited for it
    prefetch_issued: int = 0  # blobs predicted for a layer before it ran
    prefetch_used: int = 0  # of those, blobs the layer then asked for
    prefetch_needed: int = 0  # blobs asked for by layers that had a prediction

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else math.nan

    @property
    def gbps(self) -> float:
        return self.bytes / self.busy_seconds / 1e9 if self.busy_seconds > 0 else math.nan

    @property
    def prefetch_precision(self) -> float:
        return self.prefetch_used / self.prefetch_issued if self.prefetch_issued else math.nan

    @property
    def prefetch_recall(self) -> float:
        return self.prefetch_used / self.prefetch_needed if self.prefetch_needed else math.nan

    def add(self, other: TierCounters) -> None:
        """Add `other`'s counts to these."""
        for name in TierCounters.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))


@dataclass
class ResidencyTelemetry:
    tiers: dict[str, TierCounters] = field(
        default_factory=lambda: {tier: TierCounters() for tier in TIERS}
    )

    def __getitem__(self, tier: str) -> TierCounters:
        if tier not in self.tiers:
            raise ValueError(f"unknown tier {tier!r}: the tiers are {', '.join(self.tiers)}")
        return self.tiers[tier]

    def since(self, earlier: ResidencyTelemetry) -> ResidencyTelemetry:
        """The counts added after `earlier` (a snapshot of the same counters) up to these."""
        out = ResidencyTelemetry()
        for tier, counters in self.tiers.items():
            before = earlier.tiers.get(tier, TierCounters())
            out.tiers[tier] = TierCounters(
                **{
                    name: getattr(counters, name) - getattr(before, name)
                    for name in TierCounters.__dataclass_fields__
                }
            )
        return out


# (name, type, help, value of one tier); counters end in _total, units in the name.
METRICS: tuple[tuple[str, str, str, Callable[[TierCounters], float]], ...] = (
    ("hits_total", "counter", "Expert blob requests the tier served.", lambda c: c.hits),
    ("misses_total", "counter", "Expert blob requests the tier passed on.", lambda c: c.misses),
    ("bytes_total", "counter", "Bytes moved into the tier.", lambda c: c.bytes),
    (
        "busy_seconds_total",
        "counter",
        "Seconds the tier's copy path was moving bytes.",
        lambda c: c.busy_seconds,
    ),
    (
        "stall_seconds_total",
        "counter",
        "Seconds compute waited for the tier.",
        lambda c: c.stall_seconds,
    ),
    (
        "prefetch_issued_total",
        "counter",
        "Prefetches issued into the tier.",
        lambda c: c.prefetch_issued,
    ),
    (
        "prefetch_used_total",
        "counter",
        "Prefetched blobs later used.",
        lambda c: c.prefetch_used,
    ),
    (
        "prefetch_needed_total",
        "counter",
        "Blobs asked for by layers that had a prefetch.",
        lambda c: c.prefetch_needed,
    ),
    ("hit_ratio", "gauge", "Hits over requests (NaN before the first).", lambda c: c.hit_rate),
    (
        "bandwidth_gigabytes_per_second",
        "gauge",
        "Bytes moved over busy seconds, in GB/s (NaN before the first copy).",
        lambda c: c.gbps,
    ),
    (
        "prefetch_precision_ratio",
        "gauge",
        "Prefetches used over prefetches issued (NaN before the first).",
        lambda c: c.prefetch_precision,
    ),
    (
        "prefetch_recall_ratio",
        "gauge",
        "Prefetches used over blobs needed by prefetched layers (NaN before the first).",
        lambda c: c.prefetch_recall,
    ),
)


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _number(value: float) -> str:
    if isinstance(value, int):
        return str(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


def render_prometheus(
    telemetry: ResidencyTelemetry,
    prefix: str = "moetier_residency",
    labels: Mapping[str, str] | None = None,
) -> str:
    """The Prometheus text exposition of `telemetry`, one family per counter or ratio, one
    sample per tier; `labels` (e.g. {"model": ...}) are added to every sample."""
    extra = "".join(f',{k}="{_escape_label(v)}"' for k, v in (labels or {}).items())
    lines = []
    for name, kind, help_text, value in METRICS:
        full = f"{prefix}_{name}"
        lines.append(f"# HELP {full} {_escape_help(help_text)}")
        lines.append(f"# TYPE {full} {kind}")
        for tier, counters in telemetry.tiers.items():
            lines.append(
                f'{full}{{tier="{_escape_label(tier)}"{extra}}} {_number(value(counters))}'
            )
    return "\n".join(lines) + "\n"


def served_bytes(
    telemetry: ResidencyTelemetry, cache_tier: str, blob_bytes: float
) -> dict[str, float]:
    """Expert bytes each tier served, from counters (deltas over a run, `since`): the cache
    tier's hits at `blob_bytes` each (a mean blob), the bytes moved into the cache from the host
    tier (moved in, less what came from the store's file) and the bytes read from the file."""
    out = {tier: 0.0 for tier in TIERS}
    cache = telemetry[cache_tier]
    disk = float(telemetry["disk"].bytes)
    out[cache_tier] += cache.hits * blob_bytes
    if cache_tier != "host":
        out["host"] += max(0.0, cache.bytes - disk)
    out["disk"] += disk
    return out
