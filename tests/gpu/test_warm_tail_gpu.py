"""The warm-prefix tail's captured graph on a real GPU (skipped without one): a prefix-cache hit's
tail (2 .. block_size tokens of one sequence after its cached blocks: engine.runner_tail's decode
rows, a dense model's last token after a prefill of the others, a hybrid's every token, below a
whole block; a prefill pass for one) replayed from the graph the runner captured when it was
built gives logits bit-identical to the same pass run eagerly, for a dense model (tiny Llama,
bf16) and a hybrid (tiny Qwen3.5, bf16: the tail restores a state snapshot); and through the
engine loop a repeated prompt, and prompts that extend or cut a cached prompt inside its last
block, hit and equal their uncached runs."""

from __future__ import annotations

import numpy as np
import pytest
from fixtures.hybrid import write_qwen3_5_hf
from test_runner_cuda import write_tiny_llama

from engine.runner_tail import graph_key, pass_is_short, tail_count, whole_block_tails
from engine.types import SamplingParams, StepItem

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module", params=["llama", "qwen3_5"])
def tail_runner(request, tmp_path_factory):
    from engine.model import load_model
    from engine.runner_cuda import CudaRunner

    d = tmp_path_factory.mktemp(request.param)
    if request.param == "llama":
        write_tiny_llama(d / "m")
        runner = CudaRunner(load_model(d / "m"), num_blocks=128, max_model_len=1024)
    else:
        path = write_qwen3_5_hf(d / "m", seed=7, bf16=True, hidden_size=128, intermediate_size=256,
                                num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                linear_key_head_dim=32, linear_value_head_dim=32, linear_num_key_heads=2,
                                linear_num_value_heads=4, full_attention_interval=2, vocab_size=384)
        runner = CudaRunner(load_model(path), num_blocks=128, max_model_len=1024, state_slots=8)
    yield request.param, runner
    runner.close()


@pytest.mark.parametrize("tail", [2, 5, 16])
def test_tail_graph_logits_equal_the_eager_pass(tail_runner, tail):
    fam, runner = tail_runner
    bs = runner.block_size
    vocab = runner.plan.dims["vocab"]
    rng = np.random.default_rng(tail)
    depth = 20 * bs  # the cached prefix
    prompt = [int(t) for t in rng.integers(3, vocab, depth + tail)]
    table = list(range(blocks := -(-(depth + tail) // bs)))
    hybrid = fam != "llama"
    # the cold prefill (chunks of more than a block: eager), snapshotting the state after `depth`
    # tokens into slot 1 for the hybrid
    cold = dict(state_slot=0, state_snapshots=((depth, 1),)) if hybrid else {}
    runner.step([StepItem(0, prompt[:depth], 0, table, False, GREEDY, **cold)])
    warm = dict(state_slot=2, state_restore=1) if hybrid else {}
    item = StepItem(1, prompt[depth:], depth, table[:blocks], True, GREEDY, history=prompt, prompt_len=depth + tail,
                    **warm)  # fmt: skip
    # a whole block: the captured prefill tail graph; fewer tokens: decode rows (engine.runner_tail:
    # the dense model's last token, the hybrid's every one), their graph captured ahead too, the
    # last row sampling
    rows = tail_count(item, bs, whole_block_tails(runner)) or 1
    assert rows == (1 if tail == bs or not hybrid else tail)
    if tail == bs:
        assert ("tail", tail) in runner._graphs
    else:
        assert graph_key(runner, rows, "greedy", pass_is_short(runner, item)) in runner._graphs
    runner.use_graphs = True
    ids_graph = runner.step([item])
    logits_graph = runner.read_logits(rows)[-1:]
    runner.use_graphs = False
    ids_eager = runner.step([item])
    logits_eager = runner.read_logits(rows)[-1:]
    runner.use_graphs = True
    assert ids_graph == ids_eager
    assert np.array_equal(logits_graph.view(np.uint32), logits_eager.view(np.uint32)), fam


@pytest.mark.parametrize("blocks", [8, 30])
def test_engine_repeat_hits_and_equals_uncached(tail_runner, blocks):
    """A repeated prompt of 8 / 30 blocks + 7 tokens (the tiny Llama's tail rows below its
    short_context of 256 tokens: the verify launches; past it: the TAIL attention's key split):
    the dense model's hit takes its partial block's first 6 tokens too (a copy of the cached
    block, engine.partial_blocks) and runs one decode row (as its cold run does), the hybrid's stops
    at the boundary and runs seven; both give the uncached run's tokens, every time."""
    from fixtures.engine_waves import serve_waves

    fam, runner = tail_runner
    bs = runner.block_size
    vocab = runner.plan.dims["vocab"]
    prompt = [int(t) for t in np.random.default_rng(9 + blocks).integers(3, vocab, blocks * bs + 7)]
    kw = dict(max_tokens=8, vocab_size=vocab, prefill_chunk_tokens=8 * bs, max_step_tokens=512)
    (cold, _), = serve_waves(runner, [[prompt]], enable_prefix_cache=False, **kw)[0]
    runs, _ = serve_waves(runner, [[prompt], [prompt], [prompt]], **kw)
    assert runs[0] == (cold, 0)
    hit = blocks * bs + (6 if fam == "llama" else 0)
    for toks, cached in runs[1:]:  # the tail graph (1 or 7 rows), every time
        assert cached == hit and toks == cold, fam


@pytest.mark.parametrize("blocks", [8, 30])
def test_engine_partial_hits_of_longer_and_shorter_prompts_equal_uncached(tail_runner, blocks):
    """A prompt A of 8 / 30 blocks + 5 tokens, then A extended by 3 tokens inside its last block, A
    cut to 3 tokens into it, and A again: the dense model's hits copy the positions of the cached
    partial block that each prompt's own cold run computes by prefill (engine.partial_blocks: A's
    first 4, never its last, a decode row; then the extension's entry), the hybrid's stop at the
    boundary; each gives its uncached run's tokens."""
    from fixtures.engine_waves import serve_waves

    fam, runner = tail_runner
    bs = runner.block_size
    vocab = runner.plan.dims["vocab"]
    depth = blocks * bs
    a = [int(t) for t in np.random.default_rng(40 + blocks).integers(3, vocab, depth + 8)]
    prompts = [a[: depth + 5], a, a[: depth + 3], a[: depth + 5]]
    kw = dict(max_tokens=8, vocab_size=vocab, prefill_chunk_tokens=8 * bs, max_step_tokens=512)
    cold = [serve_waves(runner, [[p]], enable_prefix_cache=False, **kw)[0][0][0] for p in prompts]
    runs, _ = serve_waves(runner, [[p] for p in prompts], **kw)
    assert [toks for toks, _ in runs] == cold, fam
    want = [0, depth + 4, depth + 2, depth + 4] if fam == "llama" else [0, depth, depth, depth]
    assert [cached for _, cached in runs] == want, fam


def test_copy_blocks_copies_one_block_of_every_layer(tail_runner, monkeypatch):
    """CudaRunner.copy_blocks (engine.runner_kv): in order, each destination block's K and V in
    every layer become the source's, nothing else changes; through one 2D copy, and through one
    copy a row where the pitch is past the device's 2D limit."""
    from engine import cuda

    fam, runner = tail_runner
    per, pitch, n = runner._kv_block_bytes, runner._kv_layer_bytes, runner.kv.nbytes
    pairs = [(3, 7), (7, 9), (20, 3)]
    for two_d in (True, False):
        if not two_d:
            monkeypatch.setattr(cuda, "_max_pitch", lambda: 0)
        before = np.random.default_rng(1).integers(0, 256, n, dtype=np.uint8)
        cuda.htod(runner.kv.ptr, before)
        runner.copy_blocks(pairs)
        runner.stream.synchronize()
        after = cuda.dtoh(np.empty(n, np.uint8), runner.kv.ptr)
        want = before.reshape(-1, pitch).copy()
        for src, dst in pairs:
            want[:, dst * per : (dst + 1) * per] = want[:, src * per : (src + 1) * per]
        assert np.array_equal(after, want.reshape(-1)), (fam, two_d)
    cuda.memset(runner.kv.ptr, 0, n)


@pytest.mark.parametrize("tail", [7, 16])
def test_tail_after_a_span_has_the_cold_pass_logits(tail_runner, tail):
    """With the key-split prefill attention (the profile's attention_prefill.span; docs/kernels.md):
    a 976 / 967-token prompt crosses a span; its cold pass (one pass of more than split_rows rows:
    the folding single launch) and the tail a prefix hit leaves (the per-span launches + the fold,
    from the captured tail graph) give the last row the same logits, bit for bit."""
    fam, runner = tail_runner
    span = int(runner.profile.tune("attention_prefill").get("span") or 0)
    if not span:
        pytest.skip(f"profile {runner.profile.name} has no key split (attention_prefill.span 0)")
    bs = runner.block_size
    vocab = runner.plan.dims["vocab"]
    rng = np.random.default_rng(100 + tail)
    depth = 60 * bs
    prompt = [int(t) for t in rng.integers(3, vocab, depth + tail)]
    table = list(range(-(-(depth + tail) // bs)))
    hybrid = fam != "llama"
    names = {la.spec.entry for st in runner.plan.steps for la in st.launches.get("prefill", ())}
    assert any("partial" in n for n in names), "the plan has no split launch"
    cold = dict(state_slot=0, state_snapshots=((depth, 1),)) if hybrid else {}
    runner.use_graphs = True
    runner.step([StepItem(0, prompt, 0, table, True, GREEDY, history=prompt, **cold)])
    logits_cold = runner.read_logits(1)
    warm = dict(state_slot=2, state_restore=1) if hybrid else {}
    runner.step([StepItem(1, prompt[depth:], depth, table, True, GREEDY, history=prompt, **warm)])
    logits_warm = runner.read_logits(1)
    assert np.array_equal(logits_cold.view(np.uint32), logits_warm.view(np.uint32)), fam
