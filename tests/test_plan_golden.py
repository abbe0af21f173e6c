"""Plans pinned by tests/golden/plans.json: a lowering refactor must leave every kernel source and
launch of the profiles' real settings as they were (tools/plan_golden.py checks every combo; CI this
representative subset)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))

import plan_golden  # noqa: E402


def test_the_golden_covers_every_combo_that_exists():
    assert sorted(plan_golden.load_golden()) == sorted(plan_golden.combos())


@pytest.mark.parametrize("combo", plan_golden.CI_COMBOS)
def test_plan_matches_the_golden(combo):
    assert plan_golden.digest(combo) == plan_golden.load_golden()[combo], (
        f"{combo}: the plan changed; diff `tools/plan_golden.py --dump DIR --only {combo}` against main's"
    )
