"""The warm-prefix tail on CudaRunner's fake driver (no GPU): the prefill passes of one sequence's
1 .. block_size tokens (what a prefix-cache hit leaves to run) are captured into CUDA graphs when
the runner is built, from a warm run that writes only the sinks; a warm request then replays one
graph for its layers (the head stays eager) and uploads inputs sized by its new tokens, never by
the cached prompt."""

from __future__ import annotations

import numpy as np
import pytest
from fixtures.hybrid import write_qwen3_5_hf
from test_plan_runner_fake import GREEDY, FakeDriver, fake_builder
from test_runner_cuda import write_tiny_llama

from engine.types import StepItem


def _build(tmp_path, monkeypatch, hybrid: bool):
    """(runner, driver, events): ("htod", ptr, bytes copy) and ("launch", kernel, in a capture), in order."""
    import engine.runner_cuda as rc
    from engine.model import load_model

    drv = FakeDriver()
    mod = drv.module()
    events: list[tuple] = []
    htod, prepared = mod.htod, mod.PreparedLaunch

    def rec_htod(ptr, host, stream=None):
        events.append(("htod", ptr, np.asarray(host).copy()))
        return htod(ptr, host, stream)

    class RecPrepared(prepared):
        def __call__(self, args):
            events.append(("launch", self.fn.name, drv.capturing))
            return super().__call__(args)

    mod.htod, mod.PreparedLaunch = rec_htod, RecPrepared
    monkeypatch.setattr(rc, "cuda", mod)
    if hybrid:
        path = write_qwen3_5_hf(tmp_path / "m", bf16=True, hidden_size=128, intermediate_size=256,
                                linear_key_head_dim=32, linear_value_head_dim=32)
        runner = rc.CudaRunner(load_model(path), num_blocks=300, max_model_len=4096,
                               builder=fake_builder(tmp_path), state_slots=6)
    else:
        write_tiny_llama(tmp_path / "m")
        runner = rc.CudaRunner(load_model(tmp_path / "m"), num_blocks=300, max_model_len=4096,
                               builder=fake_builder(tmp_path))
    return runner, drv, events


def _view(runner, raw: np.ndarray, name: str, dtype, n: int) -> np.ndarray:
    off = runner._in_off[name]
    return raw[off : off + n * np.dtype(dtype).itemsize].view(dtype)


@pytest.mark.parametrize("hybrid", [False, True], ids=["llama", "qwen3_5"])
def test_tails_are_captured_from_a_warm_run_into_the_sinks(tmp_path, monkeypatch, hybrid):
    runner, drv, events = _build(tmp_path, monkeypatch, hybrid)
    bs = runner.block_size
    assert sorted(k[1] for k in runner._graphs if k[0] == "tail") == list(range(1, bs + 1))
    assert drv.captures == bs
    for n in range(1, bs + 1):  # the graph keeps the very launches the eager pass of n tokens runs
        assert runner._graphs[("tail", n)][1] is runner._prefill_bound[("prefill", n, 1, n)]
    # every launch that ran while building (not those recorded into a graph) read inputs that
    # write only the sinks
    last, launched = None, 0
    for ev in events:
        if ev[0] == "htod" and ev[1] == runner._in_dev.ptr:
            last = ev[2]
        elif ev[0] == "launch" and last is not None and not ev[2]:
            launched += 1
            slots = _view(runner, last, "slots", np.int32, 1)  # (the first row: every tail has one)
            assert (slots // bs == runner._sink_block).all(), ev[1]
            tables = last[runner._tables_off : runner._tables_off + 4 * runner._table_ld].view(np.int32)
            assert (tables == runner._sink_block).all(), ev[1]
            if hybrid:
                assert _view(runner, last, "state_in", np.int32, 1)[0] == -1
                assert _view(runner, last, "state_out", np.int32, 1)[0] == runner._state_sink
                assert (_view(runner, last, "state_snap", np.int32, bs) == -1).all()
    assert launched > 0


@pytest.mark.parametrize("hybrid", [False, True], ids=["llama", "qwen3_5"])
def test_a_warm_tail_replays_its_graph_and_uploads_by_new_tokens(tmp_path, monkeypatch, hybrid):
    runner, drv, events = _build(tmp_path, monkeypatch, hybrid)
    bs = runner.block_size
    state = dict(state_slot=2, state_restore=4) if hybrid else {}
    uploads = []
    for depth in (4 * bs, 200 * bs):  # the same 5-token tail after 64 and after 3,200 cached tokens
        drv.reset()
        events.clear()
        table = list(range(depth // bs + 1))
        item = StepItem(0, [7, 8, 9, 10, 11], depth, table, True, GREEDY, history=[1] * (depth + 5), **state)
        assert runner.step([item]) == [0]
        assert drv.graph_launches == 1 and drv.captures == 0
        names = [n for n, _, _ in drv.launches]
        assert names and not any(n.startswith(("embed", "attention_prefill", "gated_delta", "causal_conv")) for n in names)
        assert names[-1].startswith("argmax")  # only the head and its sampler launch from Python
        uploads.append(sum(drv.h2d))
        raw = next(ev[2] for ev in events if ev[0] == "htod" and ev[1] == runner._in_dev.ptr)
        assert _view(runner, raw, "positions", np.int32, 5).tolist() == list(range(depth, depth + 5))
        assert _view(runner, raw, "slots", np.int32, 5).tolist() == [
            table[p // bs] * bs + p % bs for p in range(depth, depth + 5)
        ]
        if hybrid:
            assert _view(runner, raw, "state_in", np.int32, 1)[0] == 4
            assert _view(runner, raw, "state_out", np.int32, 1)[0] == 2
    assert uploads[0] == uploads[1]  # the cached prompt's length changes no upload
    # graphs off (or a tail longer than a block): the same pass eagerly
    drv.reset()
    runner.use_graphs = False
    runner.step([StepItem(0, [7, 8, 9, 10, 11], 4 * bs, list(range(5)), True, GREEDY, **state)])
    assert drv.graph_launches == 0 and any(n.startswith("attention_prefill") for n, _, _ in drv.launches)


def test_a_one_token_prompt_tail_is_a_prefill_and_a_generated_token_a_decode_row(tmp_path, monkeypatch):
    """A hit that leaves the prompt's last token alone runs it as a one-row prefill (its tail graph
    and the prefill head), as the cold pass computed it; the same token past the prompt is a decode
    row (the decode graph, no prefill head)."""
    runner, drv, _ = _build(tmp_path, monkeypatch, False)
    bs = runner.block_size
    depth = 4 * bs
    table = list(range(depth // bs + 1))
    drv.reset()
    runner.step([StepItem(0, [7], depth, table, True, GREEDY, history=[1] * depth + [7], prompt_len=depth + 1)])
    assert drv.graph_launches == 1 and runner._graphs[("tail", 1)][0] is not None
    assert [n for n, _, _ in drv.launches][-1].startswith("argmax")  # the head, eagerly after the tail graph
    row = StepItem(0, [7], depth, table, True, GREEDY, history=[1] * depth + [7], prompt_len=depth)
    drv.reset()
    runner.step([row])  # (the decode graph's capture: a warm run of its launches, then the capture)
    assert not any(n.startswith("attention_prefill") for n, _, _ in drv.launches)
    drv.reset()
    runner.step([row])
    assert drv.graph_launches == 1 and not drv.launches  # the batch-1 decode graph alone
