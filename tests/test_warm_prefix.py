"""Warm-prefix hits cost host work in proportion to the new tokens, not the prompt: the engine's
admission (hashing, block lookup, tables) and the CUDA runner's binding of a prefill pass of a new
length (fake driver, no GPU). Work is counted in Python function calls (cProfile), not timed, so
the checks hold on a loaded machine."""

from __future__ import annotations

import cProfile
import pstats
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import test_plan_runner_fake as base  # noqa: E402

from engine.types import StepItem  # noqa: E402

fake = base.fake


def _calls(fn) -> int:
    prof = cProfile.Profile()
    prof.enable()
    fn()
    prof.disable()
    return pstats.Stats(prof).total_calls  # type: ignore[attr-defined]


def test_prefill_of_a_new_length_reuses_launch_configs_and_recent_shapes_stay_bound(fake, monkeypatch):
    import engine.runner_cuda as rc

    runner, drv = fake
    built: list[tuple] = []
    real = rc.cuda.PreparedLaunch

    class Counting(real):  # type: ignore[misc, valid-type]
        def __init__(self, fn, grid, *a, **k):
            built.append((fn.name, grid))
            super().__init__(fn, grid, *a, **k)

    monkeypatch.setattr(rc.cuda, "PreparedLaunch", Counting)
    table = list(range(20))

    def tail(n: int) -> list[int]:
        return runner.step([StepItem(0, list(range(1, n + 1)), 300, table, True, base.GREEDY)])

    tail(3)
    first = len(built)
    assert first > 0
    tail(5)  # a tail of another length: its grids are those of length 3 but for the per-token ones
    per_token = {name for name, grid in built[first:]}
    assert len(built) - first < first / 2, (per_token, first)
    fresh = _calls(lambda: tail(7))  # binds every launch of a new shape
    bound = _calls(lambda: tail(7))
    assert bound * 3 < fresh, (bound, fresh)
    for n in range(100, 100 + rc.PREFILL_SHAPES_KEPT + 8):  # more cold shapes than are kept
        runner.step([StepItem(1, list(range(1, n + 1)), 0, table, True, base.GREEDY)])
    tail(9)  # a tail length first seen once the cache is full is kept all the same
    assert _calls(lambda: tail(9)) * 3 < fresh
    before = len(built)
    tail(9)
    assert len(built) == before  # no new launch configuration at all
