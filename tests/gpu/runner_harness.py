"""Runner-level helpers of the GPU model tests: greedy generation of several sequences in one batch
and each alone, a teacher-forced greedy check of a runner against the numpy reference, and the
tiny random Llama's CudaRunner.

They drive a runner only through ``step`` / ``read_logits`` (CudaRunner on a GPU; a numpy
reference with ``read_logits``, fixtures.constrained.RecordingReference, runs them on CPU), so
this module imports neither engine.cuda nor cuda-python.
"""

from __future__ import annotations

import numpy as np

from engine.types import SamplingParams, StepItem

GREEDY = SamplingParams(temperature=0.0)


def rel(a, b) -> float:
    """||a - b|| / ||b|| (logits rows)."""
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def teacher_forced_greedy(runner, ref, prompt: list[int], table: list[int], n: int, what, tie: float = 2e-2,
                          **item) -> tuple[list[int], list[float], int]:  # fmt: skip
    """Prefill ``prompt`` (sequence 0 on ``table``), then decode greedily until ``n`` tokens are out,
    checking each token as it comes against the reference over the same sequence: it is the argmax
    of the runner's own logits, and where it is not the reference's argmax the reference's top two
    are a near tie (gap below ``tie`` x max |logit|; the failure names ``what``, the step and the
    logits errors so far). ``item``: further StepItem fields (a hybrid's ``state_slot``).
    Returns (the n tokens, the logits' rel error against the reference per token, near-tie flips)."""
    tok = runner.step([StepItem(0, prompt, 0, table, True, GREEDY, **item)])[0]
    seq, errs, flips = list(prompt), [], 0
    for step in range(n):
        got = np.array(runner.read_logits(1)[0])
        want = ref.forward_logits(seq)[-1]
        errs.append(rel(got, want))
        if tok != int(np.argmax(want)):
            flips += 1
            top2 = np.sort(want)[-2:]
            gap = (top2[1] - top2[0]) / (np.abs(want).max() + 1e-6)
            assert gap < tie, (what, step, tok, int(np.argmax(want)), f"gap {gap:.3f}", "rel errs so far", errs)
        assert tok == int(np.argmax(got))
        seq.append(tok)
        if step < n - 1:
            tok = runner.step([StepItem(0, [tok], len(seq) - 1, table, True, GREEDY, **item)])[0]
    return seq[len(prompt) :], errs, flips


def generate(runner, seqs: dict[int, list[int]], tables: dict[int, list[int]], steps: int,
             state_slots: bool = False) -> dict[int, list[int]]:  # fmt: skip
    """Greedy tokens of each sequence, all in one batch: one prefill step, then ``steps`` decode
    steps (with ``state_slots``, sequence i in state slot i: a hybrid's recurrent state)."""

    def item(i: int, tokens: list[int], pos: int) -> StepItem:
        return StepItem(i, tokens, pos, tables[i], True, GREEDY, state_slot=i if state_slots else None)

    out: dict[int, list[int]] = {i: [] for i in seqs}
    for i, t in zip(seqs, runner.step([item(i, p, 0) for i, p in seqs.items()]), strict=True):
        out[i].append(t)
    for _ in range(steps):
        items = [item(i, [out[i][-1]], len(p) + len(out[i]) - 1) for i, p in seqs.items()]
        for i, t in zip(seqs, runner.step(items), strict=True):
            out[i].append(t)
    return out


def generate_solo(runner, seqs: dict[int, list[int]], tables: dict[int, list[int]], steps: int,
                  state_slots: bool = False) -> dict[int, list[int]]:  # fmt: skip
    """``generate`` of each sequence alone (the batch-1 path): what the batched run must equal."""
    out: dict[int, list[int]] = {}
    for i, p in seqs.items():
        out.update(generate(runner, {i: p}, tables, steps, state_slots))
    return out


def tiny_llama_runner(path):
    """A CudaRunner (256 blocks, 1024 tokens) over test_runner_cuda's tiny random Llama, written at
    ``path``."""
    from test_runner_cuda import write_tiny_llama

    from engine.model import load_model
    from engine.runner_cuda import CudaRunner

    write_tiny_llama(path)
    return CudaRunner(load_model(path), num_blocks=256, max_model_len=1024)
