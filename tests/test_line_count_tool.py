"""tools/line_count.py: its later-feature list names existing modules only, and its split adds up."""

from __future__ import annotations

from fixtures.tools import load_tool


def test_line_count_attribution_is_complete_and_adds_up():
    lc = load_tool("line_count")
    mods = lc.modules()
    assert set(lc.LATER) <= set(mods), sorted(set(lc.LATER) - set(mods))
    text, _ = lc.report(show_modules=True)
    assert f"engine/: {sum(mods.values())} lines in {len(mods)} modules" in text
    later = sum(n for m, n in mods.items() if m in lc.LATER)
    assert f"pre-redesign scope: {sum(mods.values()) - later} lines" in text
    assert "LATER names modules that do not exist" not in text


def test_line_count_since_a_revision_lists_its_modules():
    lc = load_tool("line_count")
    text = lc.since("HEAD")
    assert text.startswith("modules of engine/ at HEAD that still exist:")
    assert " loop.py " in text and text.rstrip().endswith("gone (split or renamed): none")
