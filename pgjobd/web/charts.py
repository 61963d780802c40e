"""Charts as inline SVG, drawn on the server: no chart library, no script.

A chart is a few polylines over a time axis. Every label goes through markupsafe's
escape; every coordinate is a number this module formats itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

from markupsafe import Markup, escape

WIDTH = 600
HEIGHT = 140
PAD_LEFT = 44
PAD_BOTTOM = 18
PAD_TOP = 8


@dataclass(frozen=True)
class Series:
    name: str
    css_class: str  # colours live in the stylesheet
    values: Sequence[float]


def line_chart(
    title: str, times: Sequence[datetime], series: Sequence[Series], start: datetime, end: datetime
) -> Markup:
    """Polylines of `series` (each value at the same index of `times`) between `start`
    and `end`, scaled to the largest value; an empty frame says "no samples yet"."""
    span = max((end - start).total_seconds(), 1.0)
    top = max((v for s in series for v in s.values), default=0.0)
    scale = top if top > 0 else 1.0
    plot_w = WIDTH - PAD_LEFT - 4
    plot_h = HEIGHT - PAD_BOTTOM - PAD_TOP

    # Each time's x once for all the series (the overview redraws ~1,800 points on every
    # refresh of every tab: this loop was most of the page's time).
    origin = start.timestamp()
    xs = [
        f"{PAD_LEFT + plot_w * min(max((at.timestamp() - origin) / span, 0.0), 1.0):.1f},"
        for at in times
    ]
    y_of = plot_h / scale

    parts = [
        f'<svg class="chart" viewBox="0 0 {WIDTH} {HEIGHT}" role="img" '
        f'preserveAspectRatio="none" aria-label="{escape(title)}">',
        f"<title>{escape(title)}</title>",
        f'<line class="axis" x1="{PAD_LEFT}" y1="{PAD_TOP + plot_h}" x2="{WIDTH - 4}" '
        f'y2="{PAD_TOP + plot_h}"/>',
        f'<text class="tick" x="{PAD_LEFT - 4}" y="{PAD_TOP + 8}" text-anchor="end">'
        f"{_number(top)}</text>",
        f'<text class="tick" x="{PAD_LEFT - 4}" y="{PAD_TOP + plot_h}" text-anchor="end">0</text>',
        f'<text class="tick" x="{PAD_LEFT}" y="{HEIGHT - 4}">{_clock(start)}</text>',
        f'<text class="tick" x="{WIDTH - 4}" y="{HEIGHT - 4}" text-anchor="end">'
        f"{_clock(end)}</text>",
    ]
    if not times:
        parts.append(
            f'<text class="empty" x="{WIDTH / 2:.0f}" y="{HEIGHT / 2:.0f}" '
            'text-anchor="middle">no samples yet</text>'
        )
    bottom = PAD_TOP + plot_h
    for s in series:
        points = " ".join(f"{x}{bottom - v * y_of:.1f}" for x, v in zip(xs, s.values, strict=True))
        if points:
            parts.append(
                f'<polyline class="{escape(s.css_class)}" fill="none" points="{points}">'
                f"<title>{escape(s.name)}</title></polyline>"
            )
    parts.append("</svg>")
    legend = "".join(
        f'<span class="key {escape(s.css_class)}">{escape(s.name)}</span>' for s in series
    )
    # Every text in `parts` and `legend` that comes from outside (titles, series names,
    # CSS classes) went through escape() above; the rest are numbers and fixed markup
    # (tests/unit/test_web_auth.py holds chart labels to text).
    figure = f"<figure><figcaption>{escape(title)} {legend}</figcaption>{''.join(parts)}</figure>"
    return Markup(figure)  # nosec B704


def _number(value: float) -> str:
    if value >= 10_000:
        return f"{value / 1000:.0f}k"
    return f"{value:.0f}" if value == int(value) else f"{value:.1f}"


def _clock(at: datetime) -> str:
    return at.astimezone(UTC).strftime("%H:%M")
