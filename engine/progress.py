"""Progress bars (tqdm) on stderr for the long start-up phases: weight loading, kernel compilation.

``bar(iterable, desc)`` wraps an iterable; it draws only when stderr is a terminal (logs and tests
stay clean). Must not import CUDA or other engine modules.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any, TypeVar

T = TypeVar("T")


def _enabled(stream: Any) -> bool:
    return bool(getattr(stream, "isatty", lambda: False)())


def bar(iterable: Iterable[T], desc: str, total: int | None = None, unit: str = "it", file: Any = None) -> Iterable[T]:
    """``iterable`` with a tqdm bar on ``file`` (default: the current sys.stderr) when enabled."""
    from tqdm import tqdm

    stream = file if file is not None else sys.stderr
    return tqdm(
        iterable, desc=desc, total=total, unit=unit, file=stream, disable=not _enabled(stream), leave=False,
        dynamic_ncols=True,
    )
