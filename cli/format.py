"""Human-readable numbers for terminal output."""

from __future__ import annotations


def si(value: float, unit: str = "", digits: int = 1) -> str:
    """174.6B-style scaling (K, M, B/G, T, P)."""
    for threshold, suffix in ((1e15, "P"), (1e12, "T"), (1e9, "B" if not unit else "G"), (1e6, "M"), (1e3, "K")):
        if abs(value) >= threshold:
            return f"{value / threshold:.{digits}f}{suffix}{unit}"
    return f"{value:.{digits}f}{unit}" if isinstance(value, float) and not value.is_integer() else f"{int(value)}{unit}"


def gib(num_bytes: float) -> str:
    return f"{num_bytes / 2**30:.1f} GiB"


def seconds(s: float) -> str:
    if s >= 86400:
        return f"{s / 86400:.1f} days"
    if s >= 3600:
        return f"{s / 3600:.1f} h"
    if s >= 1:
        return f"{s:.2f} s"
    return f"{s * 1e3:.1f} ms"
