"""The warm-prefix captures after ready on a real GPU (skipped without one; engine.runner_warm): a
runner built with ``defer_warm_up`` serves a prefix-cache hit's tail before its background work ran
(5 tokens into a block: its decode-row graph, the dense model's last token's or the hybrid's
trailing partial block's, captured by the request itself; a whole last block:
the prefill's bound launches run eagerly) with logits bit-identical to the same tail after the work
ran (the graph the work captured, or the request's own, replayed), for a dense model (tiny Llama,
bf16) and a hybrid (tiny Qwen3.5, bf16: the tail restores a state snapshot)."""

from __future__ import annotations

import numpy as np
import pytest
from fixtures.hybrid import write_qwen3_5_hf
from test_runner_cuda import write_tiny_llama

from engine.runner_tail import tail_count, whole_block_tails
from engine.types import SamplingParams, StepItem

GREEDY = SamplingParams(temperature=0.0)


def _runner(fam: str, d):
    from engine.model import load_model
    from engine.runner_cuda import CudaRunner

    if fam == "llama":
        write_tiny_llama(d / "m")
        return CudaRunner(load_model(d / "m"), num_blocks=128, max_model_len=1024, defer_warm_up=True)
    path = write_qwen3_5_hf(d / "m", seed=7, bf16=True, hidden_size=128, intermediate_size=256,
                            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                            linear_key_head_dim=32, linear_value_head_dim=32, linear_num_key_heads=2,
                            linear_num_value_heads=4, full_attention_interval=2, vocab_size=384)  # fmt: skip
    return CudaRunner(load_model(path), num_blocks=128, max_model_len=1024, state_slots=8, defer_warm_up=True)


@pytest.mark.parametrize("fam", ["llama", "qwen3_5"])
def test_a_tail_before_the_background_work_equals_it_after(fam, tmp_path):
    runner = _runner(fam, tmp_path)
    try:
        assert not runner._graphs  # (nothing captured while it was built)
        bs = runner.block_size
        vocab = runner.plan.dims["vocab"]
        hybrid = fam != "llama"
        depth = 20 * bs
        rng = np.random.default_rng(3)
        prompt = [int(t) for t in rng.integers(3, vocab, depth + bs)]
        table = list(range(-(-(depth + bs) // bs)))
        cold = dict(state_slot=0, state_snapshots=((depth, 1),)) if hybrid else {}
        runner.step([StepItem(0, prompt[:depth], 0, table, False, GREEDY, **cold)])
        warm = dict(state_slot=2, state_restore=1) if hybrid else {}

        def tail(n: int) -> tuple[list, np.ndarray]:
            item = StepItem(1, prompt[depth : depth + n], depth, table, True, GREEDY, history=prompt[: depth + n],
                            prompt_len=depth + n, **warm)  # fmt: skip
            ids = runner.step([item])
            rows = tail_count(item, bs, whole_block_tails(runner)) or 1  # (the last pass's: the dense model's one)
            return ids, runner.read_logits(rows)[-1:].copy()

        before = {n: tail(n) for n in (5, bs)}
        captured = dict(runner._graphs)  # (the 5-token tail's decode-row graph, captured by the request)
        assert ("tail", bs) not in captured and captured
        assert sum(runner.background_work()) == len(runner._graphs) - len(captured)  # (each once)
        assert all(runner._graphs[k][0] is g for k, (g, _) in captured.items())
        for n in (5, bs):
            ids, logits = tail(n)
            assert ids == before[n][0], (fam, n)
            assert np.array_equal(logits.view(np.uint32), before[n][1].view(np.uint32)), (fam, n)
    finally:
        runner.close()
