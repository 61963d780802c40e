"""A small PromQL evaluator for the alert rules of docs/alerts.yml, over /metrics scrapes
taken during a test: selectors with matchers and ranges, max/min/sum [by | without], increase,
rate, deriv, min_over_time, max_over_time, histogram_quantile, vector, comparisons
(filters), `*`, `and`, `or`. Counters are taken as they are (no resets in one run) and
without Prometheus's extrapolation; rates are over the samples' own span."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Union

Labels = frozenset[tuple[str, str]]
Vector = dict[Labels, float]
Ranged = dict[Labels, list[tuple[float, float]]]
Value = Union[float, Vector, Ranged]  # noqa: UP007
Scrape = tuple[float, dict[tuple[str, Labels], float]]  # (time s, samples)

_TOKEN = re.compile(
    r"\s*(?:(?P<dur>\d+[smhd])(?![a-zA-Z_0-9])|(?P<num>\d+(?:\.\d+)?(?:e\d+)?)"
    r"|(?P<str>\"[^\"]*\")|(?P<op>==|!=|>=|<=|=~|!~|[-+*/<>(){}\[\],:=])|(?P<id>[a-zA-Z_:][a-zA-Z0-9_:]*))"
)
_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def duration_s(text: str) -> float:
    return float(text[:-1]) * _SECONDS[text[-1]]


def _tokens(expr: str) -> list[tuple[str, str]]:
    out, pos = [], 0
    expr = expr.strip()
    while pos < len(expr):
        match = _TOKEN.match(expr, pos)
        if not match or match.end() == pos:
            raise ValueError(f"cannot read {expr[pos:]!r}")
        kind = match.lastgroup
        assert kind is not None
        out.append((kind, match.group(kind)))
        pos = match.end()
    return out


@dataclass
class Evaluator:
    scrapes: list[Scrape]
    at: int = 0  # index of the scrape that is "now"
    tokens: list[tuple[str, str]] = field(default_factory=list)
    pos: int = 0

    def evaluate(self, expr: str, at: int) -> Vector:
        self.tokens, self.pos, self.at = _tokens(expr), 0, at
        result = self._or()
        if self.pos != len(self.tokens):
            raise ValueError(f"unread: {self.tokens[self.pos :]}")
        if isinstance(result, float):
            return {frozenset(): result}
        assert not _is_ranged(result)
        return result  # type: ignore[return-value]

    # -- parsing and evaluating at once ------------------------------------------------

    def _peek(self) -> str | None:
        return self.tokens[self.pos][1] if self.pos < len(self.tokens) else None

    def _take(self, wanted: str | None = None) -> str:
        _, text = self.tokens[self.pos]
        if wanted is not None and text != wanted:
            raise ValueError(f"expected {wanted!r}, got {text!r}")
        self.pos += 1
        return text

    def _or(self) -> Value:
        left = self._and()
        while self._peek() == "or":
            self._take()
            right = self._and()
            assert isinstance(left, dict) and isinstance(right, dict)
            left = {**{k: v for k, v in right.items() if k not in left}, **left}  # type: ignore[dict-item]
        return left

    def _and(self) -> Value:
        left = self._compare()
        while self._peek() == "and":
            self._take()
            right = self._compare()
            assert isinstance(left, dict) and isinstance(right, dict)
            left = {k: v for k, v in left.items() if k in right}
        return left

    def _compare(self) -> Value:
        left = self._product()
        op = self._peek()
        if op in (">", "<", "==", "!=", ">=", "<="):
            self._take()
            right = self._product()
            assert isinstance(right, float), "comparisons against a number only"
            test = {
                ">": float.__gt__, "<": float.__lt__, "==": float.__eq__,
                "!=": float.__ne__, ">=": float.__ge__, "<=": float.__le__,
            }[op]  # fmt: skip
            if isinstance(left, float):
                return left if test(left, right) else {}
            return {k: v for k, v in left.items() if test(float(v), right)}  # type: ignore[arg-type]
        return left

    def _product(self) -> Value:
        left = self._unary()
        while self._peek() == "*":
            self._take()
            right = self._unary()
            if isinstance(left, float) and isinstance(right, float):
                left = left * right
            elif isinstance(right, float):
                left = {k: v * right for k, v in left.items()}  # type: ignore[operator]
            else:
                assert isinstance(left, float)
                left = {k: v * left for k, v in right.items()}  # type: ignore[operator]
        return left

    def _unary(self) -> Value:
        kind, text = self.tokens[self.pos]
        if kind == "num":
            self._take()
            return float(text)
        if text == "(":
            self._take()
            inner = self._or()
            self._take(")")
            return inner
        if text in ("max", "min", "sum"):
            return self._aggregate()
        if self.pos + 1 < len(self.tokens) and self.tokens[self.pos + 1][1] == "(":
            return self._function()
        return self._selector()

    def _aggregate(self) -> Vector:
        how = self._take()
        by: list[str] | None = None
        without: list[str] | None = None
        if self._peek() == "by":
            self._take()
            by = self._names()
        elif self._peek() == "without":
            self._take()
            without = self._names()
        self._take("(")
        inner = self._or()
        self._take(")")
        assert isinstance(inner, dict)
        groups: dict[Labels, list[float]] = {}
        for labels, value in inner.items():
            if without is not None:
                key = frozenset((k, v) for k, v in labels if k not in without and k != "__name__")
            else:
                key = frozenset((k, v) for k, v in labels if by is not None and k in by)
            groups.setdefault(key, []).append(float(value))  # type: ignore[arg-type]
        pick = {"max": max, "min": min, "sum": sum}[how]
        return {k: float(pick(vs)) for k, vs in groups.items()}

    def _names(self) -> list[str]:
        self._take("(")
        names = []
        while self._peek() != ")":
            names.append(self._take())
            if self._peek() == ",":
                self._take()
        self._take(")")
        return names

    def _function(self) -> Value:
        name = self._take()
        self._take("(")
        args: list[Value] = [self._or()]
        while self._peek() == ",":
            self._take()
            args.append(self._or())
        self._take(")")
        if name == "vector":
            assert isinstance(args[0], float)
            return {frozenset(): args[0]}
        if name == "histogram_quantile":
            q, buckets = args
            assert isinstance(q, float) and isinstance(buckets, dict)
            return _quantile(q, buckets)  # type: ignore[arg-type]
        ranged = args[0]
        assert isinstance(ranged, dict)
        out: Vector = {}
        for labels, points in ranged.items():
            assert isinstance(points, list)
            if name == "min_over_time":
                out[labels] = min(v for _, v in points)
            elif name == "max_over_time":
                out[labels] = max(v for _, v in points)
            elif len(points) < 2:
                continue  # as Prometheus: a rate needs two samples
            elif name == "increase":
                out[labels] = points[-1][1] - points[0][1]
            elif name == "rate":
                span = points[-1][0] - points[0][0]
                out[labels] = (points[-1][1] - points[0][1]) / span if span else 0.0
            elif name == "deriv":
                out[labels] = _slope(points)
            else:
                raise ValueError(f"function {name} is not supported")
        return out

    def _selector(self) -> Value:
        name = self._take()
        matchers: list[tuple[str, str, str]] = []
        if self._peek() == "{":
            self._take()
            while self._peek() != "}":
                label, op, text = self._take(), self._take(), self._take()
                matchers.append((label, op, text.strip('"')))
                if self._peek() == ",":
                    self._take()
            self._take("}")
        window: float | None = None
        if self._peek() == "[":
            self._take()
            window = duration_s(self._take())
            self._take("]")

        def matches(labels: Labels) -> bool:
            found = dict(labels)
            for label, op, text in matchers:
                got = found.get(label, "")
                ok = {
                    "=": got == text, "!=": got != text,
                    "=~": re.fullmatch(text, got) is not None,
                    "!~": re.fullmatch(text, got) is None,
                }[op]  # fmt: skip
                if not ok:
                    return False
            return True

        now_s = self.scrapes[self.at][0]
        if window is None:
            samples = self.scrapes[self.at][1]
            return {
                labels: v for (n, labels), v in samples.items() if n == name and matches(labels)
            }
        ranged: Ranged = {}
        for at_s, samples in self.scrapes[: self.at + 1]:
            if at_s < now_s - window:
                continue
            for (n, labels), v in samples.items():
                if n == name and matches(labels):
                    ranged.setdefault(labels, []).append((at_s, v))
        return ranged


def _is_ranged(value: Value) -> bool:
    return isinstance(value, dict) and any(isinstance(v, list) for v in value.values())


def _slope(points: list[tuple[float, float]]) -> float:
    n = len(points)
    mean_t = sum(t for t, _ in points) / n
    mean_v = sum(v for _, v in points) / n
    var = sum((t - mean_t) ** 2 for t, _ in points)
    return sum((t - mean_t) * (v - mean_v) for t, v in points) / var if var else 0.0


def _quantile(q: float, buckets: Vector) -> Vector:
    groups: dict[Labels, list[tuple[float, float]]] = {}
    for labels, count in buckets.items():
        rest = frozenset((k, v) for k, v in labels if k != "le")
        le = float(dict(labels)["le"])
        groups.setdefault(rest, []).append((le, count))
    out: Vector = {}
    for labels, points in groups.items():
        points.sort()
        total = points[-1][1]
        if total <= 0:
            out[labels] = math.nan  # as Prometheus: no observations, NaN (compares false)
            continue
        rank, lower_le, lower_count = q * total, 0.0, 0.0
        for le, count in points:
            if count >= rank:
                if math.isinf(le):
                    out[labels] = lower_le
                else:
                    share = (
                        (rank - lower_count) / (count - lower_count) if count > lower_count else 0
                    )
                    out[labels] = lower_le + (le - lower_le) * share
                break
            lower_le, lower_count = le, count
    return out
