"""This process's memory footprint: resident set size now and at its peak.

Read from /proc (Linux) with ``resource`` as the fallback; pure standard library, must not import
numpy, CUDA or other engine modules.
"""

from __future__ import annotations

import os
import resource
import sys


def rss_bytes() -> int:
    """Resident set size now, in bytes (the peak where the platform does not say)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return _max_rss()


def peak_rss_bytes() -> int:
    """The largest resident set size this process has had, in bytes (never below the current one:
    the kernel updates its high-water mark lazily)."""
    return max(_max_rss(), rss_bytes())


def _max_rss() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # macOS reports bytes, Linux KiB


def footprint() -> dict[str, int]:
    """``{"rss_bytes", "peak_rss_bytes"}`` for reports."""
    return {"rss_bytes": rss_bytes(), "peak_rss_bytes": peak_rss_bytes()}
