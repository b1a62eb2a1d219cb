"""Custom metrics a python handler declares: ``context.metrics.counter(...)`` and kin.

A handler gets one :class:`MetricSet` per model version (``context.metrics``)
and may use it from ``load``, ``preprocess``, ``infer`` and ``postprocess``,
so from any of the model's threads: every update takes the set's lock for a
dict lookup and an add. ``/metrics`` and the dashboard read :meth:`snapshot`
when scraped.

Names are exported as ``aserve_handler_<name>`` with the labels ``model`` and
``version`` first, then the handler's own. What a handler can make grow is
bounded: :data:`MAX_METRICS` metrics per model, :data:`MAX_LABELS` labels per
metric, and :data:`MAX_SERIES` label-value combinations per metric; past that
cap a new combination is counted under every label set to ``"other"`` (and a
warning is logged once per metric), so a handler that labels by request id
costs a bounded number of series, not a leak; so does a value over
:data:`MAX_LABEL_VALUE_CHARS`. Label values and help texts may be any text:
a lone surrogate in one (a multipart filename's undecodable byte, say) is
replaced by U+FFFD as it enters, so that neither the exposition nor msgpack
to a worker can fail on it.

With ``"executor": "process"`` the worker's handler has its own set in
delta mode: updates accumulate there and :meth:`drain` hands what changed
since the last drain (plain lists for msgpack: declarations not yet sent and
per-series deltas) to the worker loop, which sends it with the batch answer;
the server's set :meth:`apply` s it. The worker applies the same cap first,
so what it keeps between two answers is bounded too.
"""

from __future__ import annotations

import logging
import math
import re
import threading
from bisect import bisect_left
from collections.abc import Sequence
from itertools import pairwise
from typing import Any

from aserve.obs.stats import LATENCY_BUCKETS_S
from aserve.types.text import utf8_safe

log = logging.getLogger("aserve.handler")

PREFIX = "aserve_handler_"
MAX_METRICS = 64  # per model version
MAX_LABELS = 8  # per metric, besides model and version
MAX_SERIES = 100  # label-value combinations per metric, besides "other"
MAX_BUCKETS = 40
MAX_HELP_CHARS = 1024
MAX_LABEL_VALUE_CHARS = 128
OTHER = "other"
KINDS = ("counter", "gauge", "histogram")

# Prometheus' metric and label name rules, without colons (kept for recording rules).
_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]{0,99}$")
_RESERVED_SUFFIXES = ("_bucket", "_sum", "_count", "_created")
_RESERVED_LABELS = ("model", "version", "le", "quantile")


class _Family:
    """One declared metric and its series (cumulative, or pending deltas in a worker)."""

    __slots__ = ("buckets", "help", "kind", "labels", "name", "sent", "series", "warned")

    def __init__(
        self, name: str, kind: str, help: str, labels: tuple[str, ...], buckets: tuple[float, ...]
    ) -> None:
        self.name = name
        self.kind = kind
        self.help = help
        self.labels = labels
        self.buckets = buckets
        # Label values -> a float (counter, gauge), [counts, sum] (histogram) or, in a
        # worker's gauge, [set since the last drain, value].
        self.series: dict[tuple[str, ...], Any] = {}
        self.sent = False  # a worker's declaration went to the server
        self.warned = False

    @property
    def signature(self) -> tuple[Any, ...]:
        return (self.kind, self.labels, self.buckets)

    def key(
        self, values: tuple[str, ...], seen: set[tuple[str, ...]], model: str
    ) -> tuple[str, ...]:
        """The series ``values`` count in: themselves, or all-"other" past the cap."""
        if values in seen:
            return values
        other = (OTHER,) * len(self.labels)
        too_long = any(len(v) > MAX_LABEL_VALUE_CHARS for v in values)
        if values != other and (too_long or len(seen - {other}) >= MAX_SERIES):
            if not self.warned:
                self.warned = True
                log.warning(
                    "model %s: metric '%s' has reached %d label-value combinations (or got a "
                    "value over %d characters); new ones are counted under \"%s\"",
                    model, PREFIX + self.name, MAX_SERIES, MAX_LABEL_VALUE_CHARS, OTHER,
                )  # fmt: skip
            values = other
        seen.add(values)
        return values


class MetricSet:
    """A model version's custom metrics. Thread-safe; see the module docstring.

    ``delta``: the set of a worker process, whose values are what changed
    since the last :meth:`drain`.
    """

    def __init__(self, model: str, version: str, delta: bool = False) -> None:
        self.model = model
        self.version = version
        self.delta = delta
        self._lock = threading.Lock()
        self._families: dict[str, _Family] = {}
        # Series ever seen per metric (the cap counts these; a worker's drained
        # deltas leave ``series`` but not this).
        self._seen: dict[str, set[tuple[str, ...]]] = {}
        self._refused: set[str] = set()  # names a worker declared that conflict here

    # --- the handler's API -------------------------------------------------------

    def counter(self, name: str, help: str, labels: Sequence[str] = ()) -> Counter:
        """A counter (exported as ``aserve_handler_<name>_total``); ``inc`` only goes up."""
        if name.endswith("_total"):
            name = name[: -len("_total")]
        return Counter(self, self._declare(name, "counter", help, labels, ()))

    def gauge(self, name: str, help: str, labels: Sequence[str] = ()) -> Gauge:
        """A value that goes up and down: ``set``, ``inc``, ``dec``."""
        return Gauge(self, self._declare(name, "gauge", help, labels, ()))

    def histogram(
        self,
        name: str,
        help: str,
        labels: Sequence[str] = (),
        buckets: Sequence[float] | None = None,
    ) -> Histogram:
        """Observations counted per bucket (upper bounds; +Inf is implied). The default
        buckets are the server's latency buckets, in seconds (0.5 ms to 60 s)."""
        bounds = LATENCY_BUCKETS_S if buckets is None else tuple(float(b) for b in buckets)
        return Histogram(self, self._declare(name, "histogram", help, labels, bounds))

    # --- declaring -----------------------------------------------------------------

    def _declare(
        self, name: str, kind: str, help: str, labels: Sequence[str], buckets: tuple[float, ...]
    ) -> _Family:
        check_declaration(name, kind, help, labels, buckets)
        help = utf8_safe(help)
        labels = tuple(labels)
        with self._lock:
            family = self._families.get(name)
            if family is not None:
                if family.signature != (kind, labels, buckets):
                    raise ValueError(
                        f"metric '{name}' is already declared as a {family.kind} with labels "
                        f"{list(family.labels)}; a second declaration must be the same"
                    )
                return family
            if len(self._families) >= MAX_METRICS:
                raise ValueError(
                    f"metric '{name}': a model may declare at most {MAX_METRICS} metrics"
                )
            family = self._families[name] = _Family(name, kind, help, labels, buckets)
            self._seen[name] = set()
            return family

    # --- updates (any thread) ---------------------------------------------------------

    def _update(self, family: _Family, values: tuple[str, ...], op: str, amount: float) -> None:
        with self._lock:
            key = family.key(values, self._seen[family.name], f"{self.model}/{self.version}")
            series = family.series
            if family.kind == "counter":
                series[key] = series.get(key, 0.0) + amount
            elif family.kind == "histogram":
                entry = series.get(key)
                if entry is None:
                    entry = series[key] = [[0] * (len(family.buckets) + 1), 0.0]
                entry[0][bisect_left(family.buckets, amount)] += 1
                entry[1] += amount
            elif self.delta:  # a worker's gauge: a set replaces, an add adds to what was set
                entry = series.get(key)
                if op == "set":
                    series[key] = [True, amount]
                elif entry is None:
                    series[key] = [False, amount]
                else:
                    entry[1] += amount
            else:
                series[key] = amount if op == "set" else series.get(key, 0.0) + amount

    # --- crossing from a worker process ------------------------------------------------

    def drain(self) -> list[Any] | None:
        """A worker's pending changes as msgpack-able lists, cleared; None when none."""
        with self._lock:
            decls = []
            updates = []
            for f in self._families.values():
                if not f.sent:
                    f.sent = True
                    decls.append([f.name, f.kind, f.help, list(f.labels), list(f.buckets)])
                if f.series:
                    updates.append([f.name, [[list(k), v] for k, v in f.series.items()]])
                    f.series = {}
        return [decls, updates] if decls or updates else None

    def apply(self, drained: list[Any]) -> None:
        """Add what a worker's :meth:`drain` returned. A declaration that conflicts with
        this set's (another worker, or the front, declared it otherwise) is dropped,
        logged once; so is anything malformed."""
        try:
            decls, updates = drained
            for name, kind, help, labels, buckets in decls:
                try:
                    self._declare(name, kind, help, labels, tuple(float(b) for b in buckets))
                except ValueError as exc:
                    if name not in self._refused:
                        self._refused.add(name)
                        log.warning("model %s/%s: a worker's %s", self.model, self.version, exc)
            for name, series in updates:
                family = self._families.get(name)
                if family is None or name in self._refused:
                    continue
                for values, v in series:
                    self._apply_one(family, tuple(str(x) for x in values), v)
        except Exception as exc:  # whatever it was: never into the pipe's transport
            log.warning("model %s/%s: unreadable metrics from a worker: %r", self.model,
                        self.version, exc)  # fmt: skip

    def _apply_one(self, family: _Family, values: tuple[str, ...], v: Any) -> None:
        if len(values) != len(family.labels):
            raise ValueError(f"metric '{family.name}': {len(values)} label values")
        with self._lock:
            key = family.key(values, self._seen[family.name], f"{self.model}/{self.version}")
            series = family.series
            if family.kind == "counter":
                series[key] = series.get(key, 0.0) + float(v)
            elif family.kind == "gauge":
                absolute, value = v
                series[key] = float(value) + (0.0 if absolute else series.get(key, 0.0))
            else:
                counts, total = v
                if len(counts) != len(family.buckets) + 1:
                    raise ValueError(f"metric '{family.name}': {len(counts)} bucket counts")
                entry = series.get(key)
                if entry is None:
                    entry = series[key] = [[0] * len(counts), 0.0]
                entry[0] = [a + int(b) for a, b in zip(entry[0], counts, strict=True)]
                entry[1] += float(total)

    # --- reading (the loop, when scraped) ----------------------------------------------

    def snapshot(self) -> list[dict[str, Any]]:
        """Every metric: exported name, kind, help, labels, buckets and a copy of its series."""
        with self._lock:
            return [
                {
                    "name": PREFIX + f.name,
                    "kind": f.kind,
                    "help": f.help,
                    "labels": list(f.labels),
                    "buckets": list(f.buckets),
                    "series": [
                        (list(k), [list(v[0]), v[1]] if f.kind == "histogram" else v)
                        for k, v in sorted(f.series.items())
                    ],
                }
                for f in self._families.values()
            ]


def check_declaration(
    name: str, kind: str, help: str, labels: Sequence[str], buckets: Sequence[float]
) -> None:
    """Raise ``ValueError`` naming what breaks Prometheus' rules or aserve's bounds."""
    if kind not in KINDS:
        raise ValueError(f"metric '{name}': kind '{kind}' is not one of {', '.join(KINDS)}")
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(
            f"metric name {name!r} is not valid: letters, digits and underscores, not starting "
            "with a digit, at most 100 characters (it is exported as "
            f"'{PREFIX}<name>')"
        )
    if name.endswith(_RESERVED_SUFFIXES):
        raise ValueError(
            f"metric name '{name}' ends in a suffix Prometheus reserves "
            f"({', '.join(_RESERVED_SUFFIXES)})"
        )
    if not isinstance(help, str) or not help or len(help) > MAX_HELP_CHARS:
        raise ValueError(f"metric '{name}': help must be text of 1 to {MAX_HELP_CHARS} characters")
    if isinstance(labels, str):
        raise ValueError(f"metric '{name}': labels must be a list of names, not a string")
    if len(labels) > MAX_LABELS:
        raise ValueError(f"metric '{name}' has {len(labels)} labels, over the limit {MAX_LABELS}")
    for label in labels:
        if not isinstance(label, str) or not _NAME.match(label) or label.startswith("__"):
            raise ValueError(f"metric '{name}': label name {label!r} is not valid")
        if label in _RESERVED_LABELS:
            raise ValueError(f"metric '{name}': label name '{label}' is reserved")
    if len(set(labels)) != len(labels):
        raise ValueError(f"metric '{name}': label names repeat: {list(labels)}")
    if kind == "histogram":
        if not 1 <= len(buckets) <= MAX_BUCKETS:
            raise ValueError(f"metric '{name}': 1 to {MAX_BUCKETS} buckets, not {len(buckets)}")
        if any(not math.isfinite(b) for b in buckets) or any(a >= b for a, b in pairwise(buckets)):
            raise ValueError(f"metric '{name}': buckets must be finite and increasing")


class _Metric:
    __slots__ = ("_family", "_set", "_values")

    def __init__(self, metrics: MetricSet, family: _Family, values: tuple[str, ...] = ()) -> None:
        self._set = metrics
        self._family = family
        self._values = values

    def labels(self, *values: Any, **named: Any) -> Any:
        """The series of these label values (by position or by name), to update."""
        f = self._family
        if named and values:
            raise ValueError(f"metric '{f.name}': label values by position or by name, not both")
        if named:
            if set(named) != set(f.labels):
                raise ValueError(
                    f"metric '{f.name}' has labels {list(f.labels)}, got {sorted(named)}"
                )
            values = tuple(named[label] for label in f.labels)
        if len(values) != len(f.labels):
            raise ValueError(
                f"metric '{f.name}' has {len(f.labels)} labels {list(f.labels)}, "
                f"got {len(values)} values"
            )
        return type(self)(self._set, f, tuple(_label_value(v) for v in values))

    def _values_checked(self) -> tuple[str, ...]:
        if len(self._values) != len(self._family.labels):
            raise ValueError(
                f"metric '{self._family.name}' has labels {list(self._family.labels)}: "
                "call .labels(...) first"
            )
        return self._values


def _label_value(value: Any) -> str:
    text = str(value)
    # One too long counts under "other" (see _Family.key): not worth a pass over it.
    return text if len(text) > MAX_LABEL_VALUE_CHARS else utf8_safe(text)


class Counter(_Metric):
    __slots__ = ()

    def inc(self, amount: float = 1.0) -> None:
        amount = float(amount)
        if not amount >= 0 or math.isinf(amount):
            raise ValueError(f"counter '{self._family.name}': inc({amount}) must be finite, >= 0")
        self._set._update(self._family, self._values_checked(), "add", amount)


class Gauge(_Metric):
    __slots__ = ()

    def set(self, value: float) -> None:
        self._set._update(self._family, self._values_checked(), "set", float(value))

    def inc(self, amount: float = 1.0) -> None:
        self._set._update(self._family, self._values_checked(), "add", float(amount))

    def dec(self, amount: float = 1.0) -> None:
        self._set._update(self._family, self._values_checked(), "add", -float(amount))


class Histogram(_Metric):
    __slots__ = ()

    def observe(self, value: float) -> None:
        value = float(value)
        if math.isnan(value):
            raise ValueError(f"histogram '{self._family.name}': observe(nan)")
        self._set._update(self._family, self._values_checked(), "observe", value)
