"""tests/gpu/runner_harness.py on CPU: the GPU model tests' greedy helpers driven over the numpy
reference (fixtures.constrained.RecordingReference, which has CudaRunner's ``read_logits``), so a
slip in them shows without a GPU: the teacher-forced check gives the reference's own greedy tokens
and fails on a token off a near tie; batched generation equals each sequence alone and the
reference's greedy run, also with a hybrid's state slots."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from fixtures.constrained import RecordingReference

sys.path.insert(0, str(Path(__file__).parent / "gpu"))
from runner_harness import generate, generate_solo, teacher_forced_greedy  # noqa: E402

from engine.model import load_model  # noqa: E402
from engine.reference import ReferenceRunner  # noqa: E402


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    from test_runner_cuda import write_tiny_llama

    path = tmp_path_factory.mktemp("harness-llama")
    write_tiny_llama(path)
    return load_model(path)


def _prompt(seed: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, 384, n)]


def test_teacher_forced_greedy_gives_the_references_tokens(llama):
    ref = ReferenceRunner(llama, num_blocks=64, max_model_len=1024)
    runner = RecordingReference(ReferenceRunner(llama, num_blocks=64, max_model_len=1024))
    prompt = _prompt(3, 11)
    out, errs, flips = teacher_forced_greedy(runner, ref, prompt, list(range(4)), 6, "llama")
    assert out == ref.generate(prompt, 6) and flips == 0
    assert len(errs) == 6 and max(errs) < 1e-5


class _Biased(RecordingReference):
    """Every logit of token 7 raised by 50: greedy picks 7, far from any near tie of the reference."""

    def step(self, items):
        super().step(items)
        self._last[:, 7] += 50.0
        return [7 for _ in items]


def test_teacher_forced_greedy_fails_off_a_near_tie(llama):
    ref = ReferenceRunner(llama, num_blocks=64, max_model_len=1024)
    runner = _Biased(ReferenceRunner(llama, num_blocks=64, max_model_len=1024))
    with pytest.raises(AssertionError, match="rel errs so far"):
        teacher_forced_greedy(runner, ref, _prompt(3, 11), list(range(4)), 4, "biased")


def test_batched_generate_equals_solo_and_the_reference(llama):
    runner = RecordingReference(ReferenceRunner(llama, num_blocks=64, max_model_len=1024))
    seqs = {i: _prompt(10 + i, 5 + 3 * i) for i in range(3)}
    tables = {i: list(range(4 * i, 4 * i + 4)) for i in seqs}
    solo = generate_solo(runner, seqs, tables, 5)
    assert generate(runner, seqs, tables, 5) == solo
    assert solo == {i: runner.ref.generate(p, 6) for i, p in seqs.items()}


def test_state_slots_keep_hybrid_sequences_apart(tmp_path):
    from fixtures.hybrid import write_qwen3_5_hf

    model = load_model(write_qwen3_5_hf(tmp_path / "m", seed=5, tokenizer=False))
    runner = RecordingReference(ReferenceRunner(model, num_blocks=32, max_model_len=256, state_slots=3))
    seqs = {i: _prompt(20 + i, 4 + 5 * i) for i in range(3)}
    tables = {i: list(range(8 * i, 8 * i + 8)) for i in seqs}
    solo = generate_solo(runner, seqs, tables, 4, state_slots=True)
    assert generate(runner, seqs, tables, 4, state_slots=True) == solo
    assert solo == {i: runner.ref.generate(p, 5) for i, p in seqs.items()}
