"""A prompt's tail as decode rows on a real GPU (skipped without one; issue #34 item 4,
engine.runner_tail: a dense model's last token, every other position in the prefill pass; a
hybrid's trailing partial block): a cold prompt and its warm repeat (the cached blocks, then only
the tokens after them) give the same sampled token and the same logits bits (np.array_equal of the
f32 logits), then the same logits for six greedy decode steps (so the KV the tail and the warm
prefill wrote is compared too), below short_context and past it (1k, 2k); so does a longer prompt
that copies a cached prompt's partial block (engine.partial_blocks: the positions that prompt
computed by prefill, not its decode-row last) against its own cold run; the tail's rows equal
plain batch-1 decode steps of the same tokens bit for bit below short_context and where the plan
has no TAIL attention (a hybrid); past it a dense plan's tail rows run their attention as the
prefill key split's partials (engine.ir.TAIL), so they agree with plain decode rows and with the
numpy reference to rel 5e-2 on the logits; tails packed into one pass (several sequences at
several depths) give each tail's rows the bits it gets alone; and through the engine loop a
repeated prompt hits the cache (a dense model's partial block too: one row left) and returns the
uncached run's tokens. On a random q4_k_m Qwen3 GGUF, random q4_k_m Qwen3.5 and Qwen3.5-MoE hybrid
GGUFs (the tail's rows through the stateful launches one by one, the warm run restoring the
snapshot at the cached boundary; the MoE one not against batch-1 steps: its decode rows are not
claimed batch-invariant) and a tiny bf16 Llama (whose wide decode makes a hybrid-style tail of
more than ``narrow_rows`` rows run in several passes)."""

from __future__ import annotations

import numpy as np
import pytest
from fixtures.checkpoints import write_random_gguf
from fixtures.hybrid import write_random_hybrid_gguf
from fixtures.hybrid_case import GGUF_DIMS, GGUF_MOE
from test_quant_models import DIMS as QWEN_DIMS
from test_runner_cuda import write_tiny_llama

from engine.runner_tail import tail_count, whole_block_tails
from engine.types import SamplingParams, StepItem

GREEDY = SamplingParams(temperature=0.0)
STEPS = 6
MODELS = ["qwen3-q4_k_m", "qwen3_5-q4_k_m", "qwen3_5_moe-q4_k_m", "llama-bf16"]


@pytest.fixture(scope="module", params=MODELS)
def tail_runner(request, tmp_path_factory):
    from engine.model import load_model
    from engine.runner_cuda import CudaRunner

    name = request.param
    d = tmp_path_factory.mktemp(name)
    slots = {}
    if name == "qwen3-q4_k_m":
        path = write_random_gguf(d / "m.gguf", "qwen3", QWEN_DIMS, "q4_k_m", seed=5)
    elif name.startswith("qwen3_5"):
        moe = GGUF_MOE if "moe" in name else None
        path = write_random_hybrid_gguf(d / "m.gguf", quant="q4_k_m", seed=7, moe=moe, **GGUF_DIMS)
        slots = dict(state_slots=16)
    else:
        write_tiny_llama(d / "m")
        path = d / "m"
    runner = CudaRunner(load_model(path), num_blocks=512, max_model_len=4096, **slots)
    yield name, runner
    runner.close()


class Tables:
    used = 0

    @classmethod
    def take(cls, n: int) -> list[int]:
        cls.used += n
        if cls.used > 512:
            cls.used = n
        return list(range(cls.used - n, cls.used))


def _prompt(runner, n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, runner.plan.dims["vocab"], n)]


def _decode(runner, seq: int, tok: int, pos: int, table: list[int], state: dict) -> list[np.ndarray]:
    out = []
    for _ in range(STEPS):
        tok = runner.step([StepItem(seq, [tok], pos, table, True, GREEDY, state_slot=state.get("state_slot"))])[0]
        out.append(runner.read_logits(1)[0].copy())
        pos += 1
    return out


def _rows(runner, n: int, tail: int) -> int:
    """The decode rows of an ``n``-token prompt whose last ``tail`` tokens follow its cached
    blocks (engine.runner_tail: 1 for a dense model, ``tail`` for a hybrid)."""
    item = StepItem(0, [0] * tail, n - tail, [0], True, GREEDY, prompt_len=n)
    return tail_count(item, runner.block_size, whole_block_tails(runner))


def _last_pass(runner, tail: int) -> int:
    """The first tail row of the tail's last decode pass (passes of at most narrow_rows rows)."""
    from engine.spec.cuda_verify import narrow_rows

    limit = min(narrow_rows(runner.plan, runner._max_rows), runner._max_rows)
    return (tail - 1) // limit * limit


def _bits_equal(a: np.ndarray, b: np.ndarray) -> bool:
    return np.array_equal(np.asarray(a, np.float32).view(np.uint32), np.asarray(b, np.float32).view(np.uint32))


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))


def _span_rows(runner, last_pos: int) -> bool:
    """Whether a tail pass whose last row sits at ``last_pos`` runs the TAIL attention."""
    return bool(runner._tail_attention) and last_pos >= runner.plan.short_context


@pytest.mark.parametrize("tail", [1, 7, 15])
# below and past split_kv_tokens (256): short and long launches (a dense plan's TAIL attention past it)
@pytest.mark.parametrize("depth_blocks", [4, 70, 140])
def test_warm_tail_equals_the_cold_prompt_bit_for_bit(tail_runner, tail, depth_blocks):
    name, runner = tail_runner
    bs = runner.block_size
    assert tail < bs
    hybrid = bool(runner.num_state_slots)
    depth = depth_blocks * bs
    n = depth + tail
    prompt = _prompt(runner, n, depth + tail)
    blocks = (n + STEPS) // bs + 1
    cold_table = Tables.take(blocks)
    cold_state = dict(state_slot=0, state_snapshots=((depth, 1),)) if hybrid else {}
    cold_item = StepItem(10, prompt, 0, cold_table, True, GREEDY, history=prompt, prompt_len=n, **cold_state)
    rows = _rows(runner, n, tail)
    assert rows == (tail if hybrid else 1)
    lo = _last_pass(runner, rows)
    tok_c = runner.step([cold_item])[0]
    logits_c = runner.read_logits(rows - lo)[-1].copy()  # (the last tail pass's last row samples)
    after_c = _decode(runner, 10, tok_c, n, cold_table, cold_state)
    # the warm repeat: the cold run's full blocks (the prefix cache's), a fresh block for the tail
    warm_table = cold_table[:depth_blocks] + Tables.take(blocks - depth_blocks)
    warm_state = dict(state_slot=2, state_restore=1) if hybrid else {}
    warm_item = StepItem(11, prompt[depth:], depth, warm_table, True, GREEDY, history=prompt, prompt_len=n,
                         **warm_state)  # fmt: skip
    tok_w = runner.step([warm_item])[0]  # (a dense model's: tail - 1 tokens prefill, the last a decode row)
    logits_w = runner.read_logits(rows - lo)[-1].copy()
    after_w = _decode(runner, 11, tok_w, n, warm_table, warm_state)
    assert tok_w == tok_c, name
    assert _bits_equal(logits_w, logits_c), (name, float(np.abs(logits_w - logits_c).max()))
    for i, (a, b) in enumerate(zip(after_c, after_w, strict=True)):
        assert _bits_equal(a, b), (name, "decode step", i, float(np.abs(a - b).max()))


@pytest.mark.parametrize(("tail", "depth_blocks"), [(3, 4), (15, 30)])
def test_tail_rows_equal_plain_decode_steps(tail_runner, tail, depth_blocks):
    """The tail's rows are the plain batch-1 decode steps of its tokens, bit for bit: the prompt
    before its tail prefilled (a hybrid's full blocks; a dense model's all but its last token),
    then the tail as one warm item against the same tokens decoded one at a time (items with no
    ``prompt_len``: decode rows), each step's logits against the tail row's."""
    name, runner = tail_runner
    if "moe" in name:
        pytest.skip("MoE decode rows are not claimed batch-invariant (tests/gpu/test_batch_invariance_gpu.py has none)")
    bs = runner.block_size
    hybrid = bool(runner.num_state_slots)
    n = depth_blocks * bs + tail
    k = _rows(runner, n, tail)
    depth = n - k  # (the tail's first position)
    prompt = _prompt(runner, n, 100 + tail)
    table = Tables.take(n // bs + 1)
    st = dict(state_slot=3, state_snapshots=((depth, 4),)) if hybrid else {}
    runner.step([StepItem(20, prompt[:depth], 0, table, False, GREEDY, **st)])
    rows_state = dict(state_slot=5, state_restore=4) if hybrid else {}
    runner.step([StepItem(21, prompt[depth:], depth, table, True, GREEDY, history=prompt, prompt_len=n, **rows_state)])
    lo = _last_pass(runner, k)  # (the rows of the last pass are the ones left to read)
    rows = runner.read_logits(k - lo).copy()
    one_state = dict(state_slot=6) if hybrid else {}
    for j in range(k):
        extra = dict(one_state, state_restore=4) if hybrid and j == 0 else one_state
        runner.step([StepItem(22, [prompt[depth + j]], depth + j, table, True, GREEDY, **extra)])
        if j >= lo:
            got = runner.read_logits(1)[0]
            if _span_rows(runner, n - 1):  # the key split's sums: the decode rows' to rounding
                assert _rel(rows[j - lo], got) <= 5e-2, (name, j, _rel(rows[j - lo], got))
            else:
                assert _bits_equal(got, rows[j - lo]), (name, j, float(np.abs(got - rows[j - lo]).max()))


DENSE = ["qwen3-q4_k_m", "llama-bf16"]


@pytest.mark.parametrize(("tail", "depth_blocks"), [(15, 30), (7, 140)])
def test_span_tail_rows_agree_with_decode_rows_and_the_reference(tail_runner, tail, depth_blocks):
    """Past short_context a dense plan's tail rows (TAIL attention) against plain batch-1 decode
    steps (rel 5e-2) and against the numpy reference's logits of the same positions: within 5e-2
    for bf16; for q4_k_m, whose GPU rows quantise the activations to q8_1 where the reference keeps
    f32 (its decode rows measured rel 6.4e-2 on an H100), no further from it than the decode row of
    the same position is, plus 1e-2."""
    from engine.reference import ReferenceRunner

    name, runner = tail_runner
    if name not in DENSE:
        pytest.skip("a hybrid's tail rows keep the decode attention (bits: test_tail_rows_equal_plain_decode_steps)")
    bs = runner.block_size
    n = depth_blocks * bs + tail
    k = _rows(runner, n, tail)
    depth = n - k  # (the tail's first position: a dense model's last token)
    assert _span_rows(runner, n - 1), "the plan has no TAIL attention past short_context"
    prompt = _prompt(runner, n, 300 + tail)
    table = Tables.take(n // bs + 1)
    runner.step([StepItem(30, prompt[:depth], 0, table, False, GREEDY)])
    runner.step([StepItem(31, prompt[depth:], depth, table, True, GREEDY, history=prompt, prompt_len=n)])
    lo = _last_pass(runner, k)
    rows = runner.read_logits(k - lo).copy()
    want = ReferenceRunner(runner.model, num_blocks=n // bs + 2, max_model_len=n + bs).forward_logits(prompt)
    quantised = "bf16" not in name
    errs = []
    for j in range(lo, k):
        err = _rel(rows[j - lo], want[depth + j])
        errs.append(err)
        runner.step([StepItem(32, [prompt[depth + j]], depth + j, table, True, GREEDY)])
        dec = runner.read_logits(1)[0].copy()
        assert _rel(rows[j - lo], dec) <= 5e-2, (name, j, _rel(rows[j - lo], dec))
        dec_err = _rel(dec, want[depth + j])
        bound = dec_err + 1e-2 if quantised else 5e-2
        assert err <= bound, (name, j, err, dec_err)
    print(f"{name} tail {tail} at {depth}: TAIL rows vs reference rel err max {max(errs):.2e}")


def test_packed_tails_equal_each_alone(tail_runner):
    """Four prompts' tails in one step (their last tokens, after the tokens before them in one
    prefill pass: one tail pass of 4 rows past short_context, at 2k, 1.6k, 1k and 0.5k cached
    tokens) against each alone: each tail's row has the bits and the token it gets alone."""
    name, runner = tail_runner
    if name not in DENSE:
        pytest.skip("a hybrid's tails each run alone (engine.runner_tail.run_tails)")
    bs = runner.block_size
    shapes = [(140, 4), (100, 7), (70, 1), (32, 3)]
    items = []
    for k, (blocks, tail) in enumerate(shapes):
        depth = blocks * bs
        n = depth + tail
        prompt = _prompt(runner, n, 500 + k)
        table = Tables.take(n // bs + 1)
        runner.step([StepItem(40 + k, prompt[:depth], 0, table, False, GREEDY)])
        items.append(StepItem(40 + k, prompt[depth:], depth, table, True, GREEDY, history=prompt, prompt_len=n))
    solo_tok, solo_logits = [], []
    for it in items:
        solo_tok.append(runner.step([it])[0])
        solo_logits.append(runner.read_logits(1)[-1].copy())
    passes = []
    decode = runner._decode
    runner._decode = lambda rows, *a, **k: passes.append(len(rows)) or decode(rows, *a, **k)
    try:
        toks = runner.step(items)
    finally:
        del runner._decode
    assert passes == [4], passes
    rows = runner.read_logits(4)
    assert toks == solo_tok, name
    for k in range(len(items)):
        assert _bits_equal(rows[k], solo_logits[k]), (name, k, float(np.abs(rows[k] - solo_logits[k]).max()))


@pytest.mark.parametrize("depth_blocks", [4, 70])
def test_a_longer_prompt_s_partial_copy_equals_its_cold_run(tail_runner, depth_blocks):
    """engine.partial_blocks on the runner: prompt A (the blocks + 5 tokens) cold; prompt B (A + 4
    tokens, inside the same block) cold in blocks of its own, and warm: A's full blocks, a copy of
    A's last block (copy_blocks), then B from A's last position on (A's first 4 in its partial
    block were prefill rows, as in B's cold run; A's last, a decode row, B computes by prefill).
    The warm B's logits and six decode steps equal the cold B's bit for bit."""
    name, runner = tail_runner
    if runner.num_state_slots:
        pytest.skip("a hybrid has no partial-block entries (its hits restore a snapshot at a block boundary)")
    bs = runner.block_size
    depth = depth_blocks * bs
    b = _prompt(runner, depth + 9, 700 + depth_blocks)
    a = b[: depth + 5]
    blocks = (len(b) + STEPS) // bs + 1
    a_table = Tables.take(blocks)
    runner.step([StepItem(50, a, 0, a_table, True, GREEDY, history=a, prompt_len=len(a))])
    cold_table = Tables.take(blocks)
    tok_c = runner.step([StepItem(51, b, 0, cold_table, True, GREEDY, history=b, prompt_len=len(b))])[0]
    logits_c = runner.read_logits(1)[0].copy()
    after_c = _decode(runner, 51, tok_c, len(b), cold_table, {})
    warm_table = a_table[:depth_blocks] + Tables.take(blocks - depth_blocks)
    runner.copy_blocks([(a_table[depth_blocks], warm_table[depth_blocks])])
    start = len(a) - 1
    tok_w = runner.step([StepItem(52, b[start:], start, warm_table, True, GREEDY, history=b, prompt_len=len(b))])[0]
    logits_w = runner.read_logits(1)[0].copy()
    after_w = _decode(runner, 52, tok_w, len(b), warm_table, {})
    assert tok_w == tok_c, name
    assert _bits_equal(logits_w, logits_c), (name, float(np.abs(logits_w - logits_c).max()))
    for i, (x, y) in enumerate(zip(after_c, after_w, strict=True)):
        assert _bits_equal(x, y), (name, "decode step", i, float(np.abs(x - y).max()))


@pytest.mark.parametrize("tail", [5, 13])
def test_engine_repeat_hits_and_equals_uncached(tail_runner, tail):
    from fixtures.engine_waves import serve_waves

    name, runner = tail_runner
    bs = runner.block_size
    prompt = _prompt(runner, 40 * bs + tail, 7 + tail)
    kw = dict(max_tokens=8, vocab_size=runner.plan.dims["vocab"], prefill_chunk_tokens=8 * bs, max_step_tokens=512)
    ((cold, _),) = serve_waves(runner, [[prompt]], enable_prefix_cache=False, **kw)[0]
    runs, _ = serve_waves(runner, [[prompt], [prompt], [prompt]], **kw)
    assert runs[0] == (cold, 0)
    # a dense model's hit takes its trailing partial block but the last token (a block copy:
    # engine.partial_blocks) and runs one row; a hybrid's ends at the block boundary
    hit = 40 * bs + (0 if runner.num_state_slots else tail - 1)
    for toks, cached in runs[1:]:
        assert cached == hit and toks == cold, name
