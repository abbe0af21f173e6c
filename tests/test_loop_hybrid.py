"""The engine loop serving a tiny random Qwen3.5 (dense hybrid) on the numpy reference: recurrent
state slots created, freed and aborted with the sequence; batched greedy == solo (with chunked
prefill and preemption); prefix caching through state snapshots: a repeated ~1,000-token prompt
reports cached_tokens >= 992 and generates exactly what the uncached run does; `memra run` works."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from fixtures.engine_waves import serve_waves
from fixtures.fake_runner import FakeTokenizer
from fixtures.hybrid import write_qwen3_5_gguf, write_qwen3_5_hf

from engine.loop import Engine, EngineConfig
from engine.model import load_model
from engine.reference import ReferenceRunner
from engine.spec.config import SpecConfig
from engine.spec.proposer import NgramProposer
from engine.spec.speculator import Speculator
from engine.types import ConfigError, GenerationRequest, SamplingParams

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory):
    return write_qwen3_5_hf(tmp_path_factory.mktemp("qwen3_5"), seed=11)


@pytest.fixture(scope="module")
def model(hybrid_dir):
    return load_model(hybrid_dir)


def serve(model, waves, *, num_blocks=128, state_slots=64, block_size=4, max_tokens=6, tenant="t", **cfg):
    """Run each wave of prompts after the previous one finished; (tokens, cached) per request, stats."""
    runner = ReferenceRunner(model, num_blocks=num_blocks, block_size=block_size, max_model_len=1100,
                             state_slots=state_slots)
    return serve_waves(runner, waves, max_tokens=max_tokens, tenant=tenant, **cfg)


PROMPTS = [
    [5, 17, 99, 3, 64, 64, 12, 101, 7, 45, 88, 2, 19, 30],
    [5, 17, 99, 3, 64, 64, 12, 9],
    [40, 41],
    [7] * 11,
]


def test_batched_greedy_equals_solo_and_state_is_released(model):
    runner = ReferenceRunner(model, num_blocks=16, block_size=4, max_model_len=64, state_slots=1)
    solo = [runner.generate(p, 6) for p in PROMPTS]
    batched, stats = serve(model, [PROMPTS], num_blocks=12, state_slots=4, max_running=4,
                           prefill_chunk_tokens=6, max_step_tokens=16)
    assert [t for t, _ in batched] == solo
    assert stats.preemptions > 0
    assert stats.state_slots_live == 0 and stats.state_slots_total == 4
    # fewer state slots than requests: admission waits for a slot, output unchanged
    few, stats = serve(model, [PROMPTS], state_slots=2, enable_prefix_cache=False)
    assert [t for t, _ in few] == solo and stats.state_slots_live == 0
    # repeats hit snapshots (every block) and must not change the tokens
    again, stats = serve(model, [PROMPTS, PROMPTS])
    assert [t for t, _ in again] == solo + solo
    assert [c for _, c in again] == [0] * 4 + [12, 4, 0, 8]
    assert stats.state_snapshots > 0


def test_abort_frees_the_state_slot(model):
    runner = ReferenceRunner(model, num_blocks=64, block_size=4, max_model_len=256, state_slots=3)
    e = Engine(runner, FakeTokenizer(eos_token_ids=frozenset()), on_step=lambda e: e.check_invariants())
    e.start()
    try:
        h = e.submit(GenerationRequest("a", [3, 4, 5], sampling=GREEDY, max_tokens=200, ignore_eos=True))
        h.get(timeout=30)
        h.cancel()
        assert list(h)[-1].finish_reason == "abort"
        e.check_invariants()
        assert e.stats().state_slots_live == 0
    finally:
        e.shutdown(5)


def test_repeated_1000_token_prompt_hits_992_and_matches_uncached(model):
    prompt = [int(t) for t in np.random.default_rng(5).integers(3, 128, 1000)]
    kw = dict(num_blocks=160, block_size=16, max_tokens=8, prefill_chunk_tokens=512)
    cold, _ = serve(model, [[prompt]], enable_prefix_cache=False, **kw)
    warm, stats = serve(model, [[prompt], [prompt]], **kw)
    (first, c0), (second, c1) = warm
    assert c0 == 0 and c1 >= 992, c1
    assert first == cold[0][0] and second == cold[0][0]
    assert stats.prefix_hit_tokens >= 992
    # another tenant never hits this tenant's snapshots
    other, _ = serve(model, [[prompt], [prompt[:600]]], tenant="x", **kw)
    assert other[1][1] == 592


def test_sparse_snapshots_still_hit_the_prompt_tail(model):
    """Every 64 tokens plus the prompt's last boundary: a repeat still hits 992 of 1000."""
    prompt = [int(t) for t in np.random.default_rng(6).integers(3, 128, 1000)]
    warm, stats = serve(model, [[prompt], [prompt], [prompt[:700]]], num_blocks=160, block_size=16, max_tokens=4,
                        state_snapshot_tokens=64)
    assert [c for _, c in warm] == [0, 992, 640]
    assert warm[0][0] == warm[1][0]


def test_snapshot_eviction_under_few_slots(model):
    """Two live slots and two more for snapshots: old snapshots are evicted (LRU), never live state."""
    a = [int(t) for t in np.random.default_rng(7).integers(3, 128, 60)]
    b = [int(t) for t in np.random.default_rng(8).integers(3, 128, 60)]
    outs, stats = serve(model, [[a], [b], [a]], num_blocks=64, block_size=4, state_slots=4, max_tokens=3)
    assert stats.state_snapshot_evictions > 0 and stats.state_slots_live == 0
    assert outs[2][0] == outs[0][0]


def test_speculator_with_a_hybrid_runner_without_state_restore_is_refused(model):
    """A runner whose verify() would leave the recurrent state past the accepted tokens is refused
    with one line; the reference restores it (verify_restores_state, tests/test_mtp.py)."""

    class NoRestore(ReferenceRunner):
        verify_restores_state = False

    runner = NoRestore(model, num_blocks=16, block_size=4, max_model_len=64, state_slots=4)
    spec = Speculator(NgramProposer(min_n=1, max_n=3), SpecConfig("ngram", k=4, ngram_min=1))
    with pytest.raises(ConfigError, match="not supported for hybrid models") as err:
        Engine(runner, FakeTokenizer(eos_token_ids=frozenset()), EngineConfig(), speculator=spec)
    assert "\n" not in str(err.value)
    Engine(runner, FakeTokenizer(eos_token_ids=frozenset()), EngineConfig()).shutdown(1)  # without: fine
    ref = ReferenceRunner(model, num_blocks=16, block_size=4, max_model_len=64, state_slots=4)
    Engine(ref, FakeTokenizer(eos_token_ids=frozenset()), EngineConfig(), speculator=spec).shutdown(1)


def test_memra_run_on_a_tiny_qwen3_5(hybrid_dir, tmp_path):
    cmd = [sys.executable, "-m", "engine.cli", "run", str(hybrid_dir), "--backend", "reference",
           "--prompt", "Hello", "--max-tokens", "5", "--temperature", "0"]
    r1 = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r1.returncode == 0, r1.stderr
    r2 = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r2.stdout == r1.stdout and r1.stdout.strip()
    # the same model as llama.cpp's converter writes it (qwen35 GGUF, its own vocab)
    gguf = write_qwen3_5_gguf(tmp_path / "m.gguf", seed=11)
    r3 = subprocess.run([*cmd[:4], str(gguf), *cmd[5:]], capture_output=True, text=True, timeout=120)
    assert r3.returncode == 0, r3.stderr
