"""Batched equal to solo, bit for bit, on a real GPU (skipped without one; issue #38 item 3).

A decode row's logits must not depend on the bucket it runs in (batch 1: the plan's decode1 / short
launches; 2..8 rows: the bmax-8 GEMVs and the split attention), nor on whether its attention took
the short (direct, rope folded in) or the long (split + combine) kernel: otherwise speculative
verification (engine.spec.cuda_verify: a draft's k + 1 positions as rows of one bucket) could
accept a token plain greedy would not have produced. Checked on tiny random GGUFs (q4_1 and q8_0
llama rows of k = 576 as SmolLM2's, q8_0 / q4_k_m Qwen3 rows of k = 512 with the q/k head norms),
a tiny bf16 Llama, and the real SmolLM2 Q4_1 and Gemma 3 270M Q4_K_M files where present:

* rows at different depths (some past split_kv_tokens = 256, one past Gemma's 512 window) decoded
  together equal the same rows decoded one at a time (np.array_equal of the f32 logits);
* the k + 1 verify rows of a draft equal the plain batch-1 decode steps at the same positions,
  below, across and past 256;
* the target's recorded greedy continuation fed back as the draft (tools/bench_spec.py's replay)
  is accepted whole on both bench_spec workloads' kinds of prompt, alone and batched;
* 33 rows (the 48-row bucket: on h100 / h200 the int8 tensor-core bucket GEMVs, gemv_mmq.min_rows
  32) equal the same rows decoded one at a time.
"""

from __future__ import annotations

import numpy as np
import pytest
from fixtures.checkpoints import write_random_gguf
from test_quant_models import DIMS as QWEN_DIMS  # the same tiny shapes as the quantised-model checks
from test_quant_models import LLAMA_DIMS

from engine.types import SamplingParams, StepItem

GREEDY = SamplingParams(temperature=0.0)
TINY = {
    "llama-q4_1": ("llama", LLAMA_DIMS, "q4_1"),
    "llama-q8_0": ("llama", LLAMA_DIMS, "q8_0"),
    "qwen3-q8_0": ("qwen3", QWEN_DIMS, "q8_0"),
    "qwen3-q4_k_m": ("qwen3", QWEN_DIMS, "q4_k_m"),
}
# the rows' depths (positions of the decoded token): below, at and past split_kv_tokens (256), one
# past Gemma 3's 512-key window
DEPTHS = (3, 17, 130, 255, 256, 300, 530)
SHORT_DEPTHS = (5, 60, 200, 250)  # every row short: the short graph of the bucket


@pytest.fixture(scope="module")
def model_of(tmp_path_factory, request):
    """name -> a loaded model (tiny ones written once per module; real files skip when absent)."""
    from engine.model import load_model

    cache: dict = {}

    def get(name: str):
        if name not in cache:
            if name in TINY:
                family, dims, q = TINY[name]
                path = write_random_gguf(tmp_path_factory.mktemp(name) / f"{name}.gguf", family, dims, q, seed=5)
            elif name == "llama-bf16":
                from test_runner_cuda import write_tiny_llama

                path = tmp_path_factory.mktemp(name)
                write_tiny_llama(path)
            else:
                path = request.getfixturevalue({"smollm2": "smollm2_path", "gemma3": "gemma3_path"}[name])
            cache[name] = load_model(path)
        return cache[name]

    return get


MODELS = [*TINY, "llama-bf16", "smollm2", "gemma3"]


@pytest.fixture(scope="module")
def runner_of(model_of):
    """name -> (model, its CudaRunner), one runner per model for the module (each test prefills
    the sequences it reads). One KV pool (``window_kv_blocks=0``): these tests step the runner with
    block tables alone, and a runner with a window pool (Gemma 3's default) refuses an item without
    a window_table (engine.runner_kv)."""
    from engine.runner_cuda import CudaRunner

    runners: dict = {}

    def get(name: str):
        if name not in runners:
            model = model_of(name)
            # one KV pool (window_kv_blocks=0): the items carry plain block tables; the window pool's
            # own equality to one pool is tests/gpu/test_gemma3.py's
            runners[name] = (model, CudaRunner(model, num_blocks=512, max_model_len=1024, window_kv_blocks=0))
        return runners[name]

    yield get
    for _, r in runners.values():
        r.close()


def _vocab(model) -> int:
    return int(model.dims["vocab"])


def _prefill(runner, model, depths, seed=0, blocks=40):
    """One sequence per depth, prefilled to it (its own table of ``blocks`` blocks); their first tokens."""
    rng = np.random.default_rng(seed)
    tables, firsts = [], []
    for i, d in enumerate(depths):
        table = list(range(i * blocks, i * blocks + blocks))
        prompt = [int(t) for t in rng.integers(3, min(_vocab(model), 30000), d)]
        firsts.append(runner.step([StepItem(i, prompt, 0, table, True, GREEDY)])[0])
        tables.append(table)
    return tables, firsts


def _diff(a, b) -> str:
    bad = np.flatnonzero(a != b)
    return f"{bad.size} of {a.size} logits differ, max |d| {float(np.max(np.abs(a - b))):.3g}" if bad.size else "equal"


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("depths", [DEPTHS, SHORT_DEPTHS, DEPTHS[2:4]], ids=["mixed", "short", "two"])
def test_batched_decode_rows_equal_solo_rows_bit_for_bit(runner_of, name, depths):
    model, runner = runner_of(name)
    tables, firsts = _prefill(runner, model, depths)
    items = [StepItem(i, [t], d, tables[i], True, GREEDY) for i, (d, t) in enumerate(zip(depths, firsts, strict=True))]
    batched_ids = runner.step(items)
    batched = np.array(runner.read_logits(len(items)))
    solo, solo_ids = [], []
    for it in items:  # the same step again, alone (it rewrites the same KV slot)
        solo_ids.append(runner.step([it])[0])
        solo.append(np.array(runner.read_logits(1)[0]))
    report = [f"depth {d}: {_diff(batched[i], solo[i])}" for i, d in enumerate(depths)]
    print(name, "; ".join(report))
    assert all(np.array_equal(batched[i], solo[i]) for i in range(len(items))), report
    assert batched_ids == solo_ids


# 33 rows: the 48-row bucket, where the h100 / h200 profiles run the int8 tensor-core bucket GEMVs
# (gemv_mmq.min_rows 32) in place of the coop ones
WIDE_DEPTHS = tuple(3 + 7 * i for i in range(33))


@pytest.mark.parametrize("name", [*TINY])
def test_a_bucket_of_32_rows_and_more_equals_solo_rows_bit_for_bit(runner_of, name):
    """33 rows decoded together (on h100 / h200: the mma bucket GEMVs) equal each row decoded
    alone (the batch-1 launches), logits bit for bit and the greedy ids."""
    model, runner = runner_of(name)
    bucket = runner._bucket_of[len(WIDE_DEPTHS)]
    mma = [la for st in runner.plan.steps for la in st.launches.get("decode", ()) if la.spec.params.get("mma") and la.runs_at(bucket)]
    if runner.profile.name in ("h100", "h200"):
        assert mma, f"{name}: no mma bucket GEMV in the {bucket}-row pass"
    tables, firsts = _prefill(runner, model, WIDE_DEPTHS, seed=1, blocks=15)
    items = [StepItem(i, [t], d, tables[i], True, GREEDY) for i, (d, t) in enumerate(zip(WIDE_DEPTHS, firsts, strict=True))]
    batched_ids = runner.step(items)
    batched = np.array(runner.read_logits(len(items)))
    solo, solo_ids = [], []
    for it in items:
        solo_ids.append(runner.step([it])[0])
        solo.append(np.array(runner.read_logits(1)[0]))
    report = [f"depth {d}: {_diff(batched[i], solo[i])}" for i, d in enumerate(WIDE_DEPTHS)]
    print(name, f"{len(mma)} mma launches in the {bucket}-row pass;", "; ".join(r for r in report if not r.endswith("equal")) or "all equal")
    assert all(np.array_equal(batched[i], solo[i]) for i in range(len(items))), report
    assert batched_ids == solo_ids


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("depth", [8, 253, 256, 300])
def test_verify_rows_equal_plain_decode_steps_bit_for_bit(runner_of, name, depth):
    """Sequences A and B share a prompt: A decodes 4 plain batch-1 steps, B verifies A's tokens as
    a draft in one pass (rows at depth .. depth + 3; 253 crosses 256 inside the draft; at 256 the
    rows after the first read keys of split 1 that the pass's rope kernel wrote, which the split
    attention loads before its pdl_wait() unless it finds them: tests/test_attention_prewait_emu.py)."""
    model, runner = runner_of(name)
    rng = np.random.default_rng(1)
    prompt = [int(t) for t in rng.integers(3, min(_vocab(model), 30000), depth)]
    ta, tb = list(range(0, 40)), list(range(40, 80))
    tok = runner.step([StepItem(0, prompt, 0, ta, True, GREEDY)])[0]
    runner.step([StepItem(1, prompt, 0, tb, True, GREEDY)])
    plain, toks = [], [tok]
    for j in range(4):
        toks.append(runner.step([StepItem(0, [toks[-1]], depth + j, ta, True, GREEDY)])[0])
        plain.append(np.array(runner.read_logits(1)[0]))
    item = StepItem(1, toks[:4], depth, tb, True, GREEDY, history=prompt + toks[:1], draft=toks[1:4])
    out = runner.verify([item])
    got = np.array(runner.read_logits(4))
    report = [f"pos {depth + j}: {_diff(got[j], plain[j])}" for j in range(4)]
    print(name, depth, "; ".join(report))
    assert all(np.array_equal(got[j], plain[j]) for j in range(4)), report
    assert out == [toks[1:5]]


def _replay(recorded):
    """tools/bench_spec.py's replay proposer: each prompt's recorded plain greedy continuation."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
    from bench_spec import ReplayProposer

    return ReplayProposer(recorded)


def _engine_run(runner, prompts, speculator, max_tokens):
    from engine.bench import NullTokenizer
    from engine.loop import Engine, EngineConfig
    from engine.types import GenerationRequest

    e = Engine(runner, NullTokenizer(), EngineConfig(), speculator=speculator)
    hs = [e.submit(GenerationRequest(f"r{i}", p, GREEDY, max_tokens=max_tokens, ignore_eos=True))
          for i, p in enumerate(prompts)]  # fmt: skip
    e.start()
    try:
        return [[t for ev in h for t in ev.token_ids] for h in hs], e.stats()
    finally:
        e.shutdown(10)


@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_replayed_greedy_continuation_is_accepted_whole_on_real_weights(runner_of, name):
    """tools/bench_spec.py's replay mode as a test: the target's own recorded greedy continuation
    fed back as the draft (k = 4) is accepted token for token (verify rows == plain decode steps,
    so any rejection is a bit difference), on a prompt lookup suits and on free-form chat, one
    request at a time and both at once, and the output is plain greedy's."""
    from engine.spec.config import SpecConfig
    from engine.spec.speculator import Speculator
    from engine.tokenizer import load_tokenizer

    model, runner = runner_of(name)
    tok = load_tokenizer(model.weights)
    text = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n"
    prompts = [
        tok.encode(tok.apply_chat_template(
            [{"role": "user", "content": f"Add type hints to every function:\n{text}"}], add_generation_prompt=True)),
        tok.encode(tok.apply_chat_template(
            [{"role": "user", "content": "Write a short story about a lighthouse."}], add_generation_prompt=True)),
    ]  # fmt: skip
    plain = [_engine_run(runner, [p], None, 192)[0][0] for p in prompts]
    recorded = {tuple(p): toks for p, toks in zip(prompts, plain, strict=True)}
    for batch in ([prompts[0]], [prompts[1]], prompts):
        spec = Speculator(_replay(recorded), SpecConfig("ngram", k=4))
        got, st = _engine_run(runner, batch, spec, 192)
        assert got == [recorded[tuple(p)] for p in batch]
        assert st.spec_draft_tokens > 0
        assert st.spec_accepted_tokens == st.spec_draft_tokens, (st.spec_accepted_tokens, st.spec_draft_tokens)
