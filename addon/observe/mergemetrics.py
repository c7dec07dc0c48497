"""The supervisor's /metrics: the workers' Prometheus texts merged into one.

Counters and histograms add up. Gauges are merged by what they say: a `*_up` or `*_writable`
gauge is the lowest worker's (1 only if every worker is), an age the oldest worker's, and
every other gauge (bytes queued, requests held) the sum.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from prometheus_client.parser import text_string_to_metric_families

Labels = tuple[tuple[str, str], ...]


def _gauge_merge(name: str) -> str:
    if name.endswith(("_up", "_writable")):
        return "min"
    if name.endswith("_age_seconds"):
        return "max"
    return "sum"


def _combine(how: str, old: float, new: float) -> float:
    if how == "min":
        return min(old, new)
    if how == "max":
        return max(old, new)
    return old + new


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if value == int(value) and abs(value) < 2**53:
        return f"{int(value)}.0"
    return repr(value)


def merge(texts: Iterable[str], own: str = "") -> bytes:
    """One exposition from several workers' (and the supervisor's `own` families)."""
    heads: dict[str, tuple[str, str]] = {}
    samples: dict[str, dict[tuple[str, Labels], float]] = {}
    for text in [own, *texts]:
        for family in text_string_to_metric_families(text):
            heads.setdefault(family.name, (family.type, family.documentation))
            into = samples.setdefault(family.name, {})
            for sample in family.samples:
                key = (sample.name, tuple(sorted(sample.labels.items())))
                if key not in into:
                    into[key] = sample.value
                    continue
                how = "sum"
                if sample.name.endswith("_created"):
                    how = "min"  # the first worker's start
                elif family.type == "gauge":
                    how = _gauge_merge(family.name)
                into[key] = _combine(how, into[key], sample.value)
    lines: list[str] = []
    for name, (kind, doc) in heads.items():
        shown_name = f"{name}_total" if kind == "counter" else name  # as generate_latest
        lines.append(f"# HELP {shown_name} {_escape(doc)}")
        lines.append(f"# TYPE {shown_name} {kind}")
        for (sample_name, labels), value in samples[name].items():
            shown = ",".join(f'{k}="{_escape(v)}"' for k, v in labels)
            lines.append(
                f"{sample_name}{{{shown}}} {_number(value)}"
                if shown
                else f"{sample_name} {_number(value)}"
            )
    return ("\n".join(lines) + "\n").encode()
