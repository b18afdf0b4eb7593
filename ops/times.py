"""The time texts dflashctl reads and shows: ISO-8601 UTC stamps and short durations. Stdlib only: the host
side loads it."""

from __future__ import annotations

import calendar
import time


def parse_iso(text: str | None) -> float | None:
    """``2026-11-29T15:02:11Z`` -> epoch seconds (None when absent or unreadable)."""
    if not text:
        return None
    try:
        return float(calendar.timegm(time.strptime(text, "%Y-%m-%dT%H:%M:%SZ")))
    except (TypeError, ValueError):
        return None


def duration(seconds: float) -> str:
    if seconds < 10:
        return f"{seconds:.1f}s"
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"


__all__ = ["duration", "parse_iso"]
