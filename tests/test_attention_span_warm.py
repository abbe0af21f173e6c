"""Warm == cold bits with the key-split prefill attention, on the CPU: the engine (scheduler, block
manager, prefix cache) over tests/fixtures/attn_emu_runner.py, whose layer is the attention step
of a real plan (a tiny Llama on the h200 profile with a small span, so that prompts of a few
hundred tokens cross several spans) run by the emulator. A repeated prompt's tail (a prefix hit:
at most ``split_rows`` rows, the per-span partials + attention_combine's fold) and an extended
prompt's rest (the folding single pass) must give the bits the uncached run's passes gave each
position. The control: the split launches of a plan with another span give other bits, so the
check can fail. The GPU's checks: tests/gpu/test_tail_attention_gpu.py (kernels),
tests/gpu/test_warm_tail_gpu.py and tests/gpu/test_hybrid_runner.py (the runner)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from fixtures.attn_emu_runner import AttnEmuRunner
from fixtures.engine_waves import serve_waves, tokens_of

from engine import kernel_catalog as kc
from engine.graph import load_family
from engine.model import dims_for_size
from engine.plan import build_plan
from engine.profile import get_profile, with_tuning

SPLIT_ROWS = 16


def _plan(span: int, window: int = 0, key: str = "prefill"):
    """The attention step's ``key`` launches (and the plan's scratch) of a one-layer bf16 SmolLM2-shaped
    plan with the key split ``span``; ``window``: the same launches with a sliding window."""
    g = load_family("llama")
    d = dict(dims_for_size("llama", "smollm2-135m"))
    d.update(hidden=128, heads=4, kv_heads=2, head_dim=32, layers=1, intermediate=256, vocab=384, rope_dim=32,
             q_dim=128, kv_dim=64)  # fmt: skip
    tune = f"attention_prefill.span={span}; attention_prefill.block_kv=16; attention_prefill.split_rows={SPLIT_ROWS}"
    plan = build_plan(g, d, g.quant("bf16"), with_tuning(get_profile("h200"), tune))
    launches = next(s for s in plan.steps if s.op.op == "attention").launches[key]
    if window:  # the same launches with a sliding window (Gemma's local layers, any family's window attribute)
        launches = tuple(dataclasses.replace(la, spec=kc.spec(la.spec.template, **{**la.spec.params, "window": window}))
                         for la in launches)  # fmt: skip
    return launches, plan.scratch


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("attn_emu")


def _prompt(seed: int, n: int, vocab: int = 97) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, vocab, n)]


def _check(runner: AttnEmuRunner) -> None:
    assert runner.recomputed > 0, "no position was computed twice: nothing compared"
    assert not runner.mismatches, runner.mismatches[:5]


def _forms(runner: AttnEmuRunner) -> set[str]:
    """Which launch forms the runner's passes took: "single", "split"."""
    return {"split" if any("partial" in e for e in ran) else "single" for _, ran in runner.ran}


@pytest.mark.parametrize("window", [0, 40], ids=["full", "window40"])
def test_repeated_and_extended_prompts_resume_with_the_cold_bits(workdir, window):
    launches, scratch = _plan(32, window)
    assert [la.spec.params.get("partial", False) for la in launches[:2]] == [False, True]
    assert {la.spec.params["window"] for la in launches} == {window}
    runner = AttnEmuRunner(workdir, launches, scratch, pass_tokens=70)
    a, b = _prompt(1, 203), _prompt(2, 100)
    a2 = a + _prompt(3, 45)  # a second turn: the rest (48 rows after the hit at 192) in one pass
    kw = dict(prefill_chunk_tokens=64, max_step_tokens=512, max_tokens=4, vocab_size=97)
    cold, _ = serve_waves(runner, [[a, b], [a2]], enable_prefix_cache=False, **kw)
    warm, _ = serve_waves(runner, [[a, b], [a, b], [a2]], **kw)
    assert [c for _, c in warm] == [0, 0, 192, 96, 192]
    assert tokens_of(warm) == [cold[0][0], cold[1][0], cold[0][0], cold[1][0], cold[2][0]]
    assert _forms(runner) == {"single", "split"}
    _check(runner)


def test_another_span_breaks_warm_equals_cold(workdir):
    """The control: the cold passes fold spans of 32 keys, the warm tails' split launches spans of
    64: the tail rows past the first span differ."""
    single, scratch = _plan(32)
    split, scratch2 = _plan(64)
    runner = AttnEmuRunner(workdir, (single[0],) + tuple(split[1:]), scratch + scratch2, pass_tokens=300)
    a = _prompt(4, 200)
    kw = dict(prefill_chunk_tokens=300, max_step_tokens=512, max_tokens=2, vocab_size=97)
    serve_waves(runner, [[a]], enable_prefix_cache=False, **kw)
    serve_waves(runner, [[a], [a]], **kw)
    assert runner.mismatches and all(p >= 192 for _, p in runner.mismatches)
