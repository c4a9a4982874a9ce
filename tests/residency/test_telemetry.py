"""Prometheus text exposition of residency telemetry, checked by a parser of the format rules."""

from __future__ import annotations

import math
import re

import pytest

from moetier.residency.telemetry import TIERS, ResidencyTelemetry, render_prometheus, served_bytes

NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
LABEL = r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\\n]|\\\\|\\"|\\n)*)"'
SAMPLE = re.compile(rf"^({NAME})\{{((?:{LABEL},?)*)\}} (\S+)$")
NUMBER = re.compile(r"^([+-]?(\d+\.?\d*([eE][+-]?\d+)?|\.\d+)|NaN|[+-]Inf)$")


def parse(text: str) -> dict[str, dict]:
    """Families by name: {"type", "help", "samples": {labels tuple: float}}; raises
    AssertionError on any breach of the text format 0.0.4 rules used here."""
    assert text.endswith("\n") and "\r" not in text
    families: dict[str, dict] = {}
    current = None
    for line in text.splitlines():
        if line.startswith("# HELP "):
            name, _, doc = line[7:].partition(" ")
            assert re.fullmatch(NAME, name) and name not in families, line
            current = families[name] = {"help": doc, "type": None, "samples": {}}
        elif line.startswith("# TYPE "):
            name, _, kind = line[7:].partition(" ")
            assert current is not None and current is families.get(name), line
            assert current["type"] is None, line
            assert kind in ("counter", "gauge", "histogram", "summary", "untyped"), line
            assert not current["samples"], "TYPE must come before the samples"
            current["type"] = kind
        else:
            match = SAMPLE.match(line)
            assert match, f"not a sample line: {line!r}"
            name, labels, value = match.group(1), match.group(2), match.groups()[-1]
            assert current is not None and current is families.get(name), f"stray: {line}"
            assert current["type"], f"sample before its TYPE: {line}"
            assert NUMBER.match(value), line
            pairs = tuple(
                (k, v.replace('\\"', '"').replace("\\n", "\n").replace("\\\\", "\\"))
                for k, v in re.findall(LABEL, labels)
            )
            assert len({k for k, _ in pairs}) == len(pairs), f"repeated label: {line}"
            assert pairs not in current["samples"], f"duplicate sample: {line}"
            current["samples"][pairs] = float(value)
    for name, family in families.items():
        assert family["type"] and family["samples"], name
        if family["type"] == "counter":
            assert name.endswith("_total"), name
    return families


def test_every_counter_and_ratio_per_tier():
    t = ResidencyTelemetry()
    t["gpu"].hits, t["gpu"].misses = 90, 10
    t["host"].hits, t["host"].misses, t["host"].bytes, t["host"].busy_seconds = 8, 2, 3e9, 0.5
    t["host"].prefetch_issued, t["host"].prefetch_used, t["host"].stall_seconds = 40, 30, 0.25
    t["host"].prefetch_needed = 60
    t["disk"].bytes, t["disk"].busy_seconds = 7_000_000_000, 2.0
    families = parse(render_prometheus(t))
    assert len(families) == 12

    def value(name, tier):
        return families["moetier_residency_" + name]["samples"][(("tier", tier),)]

    assert [value("hits_total", tier) for tier in TIERS] == [90, 8, 0]
    assert value("hit_ratio", "gpu") == 0.9 and value("hit_ratio", "host") == 0.8
    assert math.isnan(value("hit_ratio", "disk"))  # no request yet
    assert value("bandwidth_gigabytes_per_second", "host") == 6.0
    assert value("bandwidth_gigabytes_per_second", "disk") == 3.5
    assert value("prefetch_precision_ratio", "host") == 0.75
    assert value("prefetch_recall_ratio", "host") == 0.5
    assert math.isnan(value("prefetch_recall_ratio", "gpu"))
    assert value("stall_seconds_total", "host") == 0.25
    assert value("bytes_total", "disk") == 7e9
    assert families["moetier_residency_hits_total"]["type"] == "counter"
    assert families["moetier_residency_hit_ratio"]["type"] == "gauge"


def test_extra_labels_are_escaped():
    text = render_prometheus(ResidencyTelemetry(), prefix="x", labels={"model": 'a"b\\c\nd'})
    assert 'model="a\\"b\\\\c\\nd"' in text
    samples = parse(text)["x_bytes_total"]["samples"]
    assert (("tier", "gpu"), ("model", 'a"b\\c\nd')) in samples


def test_unknown_tier_is_refused():
    with pytest.raises(ValueError, match="unknown tier 'ssd'"):
        ResidencyTelemetry()["ssd"]


@pytest.mark.parametrize(
    "bad",
    [
        "# TYPE x_total counter\nx_total 1\n",  # no HELP
        '# HELP x_total h\nx_total{tier="gpu"} 1\n',  # no TYPE
        '# HELP x h\n# TYPE x counter\nx{tier="gpu"} 1\n',  # counter without _total
        '# HELP x h\n# TYPE x gauge\nx{tier="gpu"} one\n',  # not a number
        '# HELP x h\n# TYPE x gauge\nx{tier="gpu"} 1',  # no final newline
    ],
)
def test_the_parser_rejects_breaches(bad):
    with pytest.raises(AssertionError):
        parse(bad)


def test_since_and_the_bytes_each_tier_served():
    """Counter deltas over a run, and where the expert bytes came from: the cache tier's hits
    (a mean blob each), the bytes moved into it from the host tier, the file's reads."""
    before, after = ResidencyTelemetry(), ResidencyTelemetry()
    before["gpu"].hits, before["gpu"].bytes, before["disk"].bytes = 5, 1000, 200
    after["gpu"].hits, after["gpu"].misses, after["gpu"].bytes = 15, 4, 1700
    after["disk"].bytes = 300
    run = after.since(before)
    assert (run["gpu"].hits, run["gpu"].misses, run["gpu"].bytes) == (10, 4, 700)
    assert run["disk"].bytes == 100 and run["host"].hits == 0
    assert served_bytes(run, "gpu", 50.0) == {"gpu": 500.0, "host": 600.0, "disk": 100.0}
    # on CPU without a host tier the cache is the "host" tier; its misses came from the file
    assert served_bytes(run, "host", 50.0) == {"gpu": 0.0, "host": 0.0, "disk": 100.0}
