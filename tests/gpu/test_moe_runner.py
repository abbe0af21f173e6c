"""A tiny random Qwen3-MoE checkpoint on CudaRunner vs the numpy reference (skipped without a GPU).

Three layers, the middle one dense (mlp_only_layers), 8 experts of which 2 run per token, k-quant
friendly widths: bf16 safetensors (per-expert tensors, stacked on load) and q8_0 / q4_k_m GGUF
(stacked ``*_exps``; q4_k_m with q6_k expert down projections in even layers), and the bf16 model
with a sigmoid-gated shared expert (tests/test_moe_load.py's moe_shared family). Checks: prefill and
decode logits close to the reference and greedy tokens equal to its argmax (where the reference's
top two are not a near tie); batched greedy output (the per-slot expert kernels at 2 rows, the
grouped ones at 5, moe_router's routing per token group) equal to each sequence run alone (the
batch-1 kernels); CUDA-graph decode bit-identical to eager; a 20-row decode pass (the grouped GEMM)
within the bound its emulated rounding gives each row (tests/fixtures/step_numerics.py).
"""

from __future__ import annotations

import numpy as np
import pytest
from fixtures.checkpoints import write_qwen3_moe_gguf, write_qwen3_moe_safetensors
from fixtures.moe_case import (
    DECODE_PROMPT_SEED,
    DECODE_STEPS,
    DIMS,
    SEED,
    SHARED_DECODE_PROMPT_SEED,
    WIDE_PROMPT_LEN,
    WIDE_PROMPT_SEEDS,
)
from fixtures.moe_case import prompt as _prompt
from runner_harness import GREEDY, generate, generate_solo, teacher_forced_greedy
from runner_harness import rel as _rel

from engine.types import StepItem

FORMATS = ("bf16", "q8_0", "q4_k_m", "shared")


@pytest.fixture(scope="module", params=FORMATS)
def moe(request, tmp_path_factory):
    from engine import paths
    from engine.model import load_model
    from engine.reference import ReferenceRunner
    from engine.runner_cuda import CudaRunner

    models_dir = paths.models_dir  # (the shared variant points it at a copy with its family)
    d = tmp_path_factory.mktemp(f"moe_{request.param}")
    if request.param == "shared":
        path = _with_shared_expert(write_qwen3_moe_safetensors(d / "m", seed=SEED, **DIMS), d)
    elif request.param == "bf16":
        path = write_qwen3_moe_safetensors(d / "m", seed=SEED, **DIMS)
    else:
        path = write_qwen3_moe_gguf(d / "m.gguf", quant=request.param, seed=SEED, **DIMS)
    model = load_model(path)
    runner = CudaRunner(model, num_blocks=128, max_model_len=512)
    yield request.param, runner, ReferenceRunner(model, num_blocks=64, max_model_len=512)
    runner.close()
    paths.models_dir = models_dir


SHARED = 128  # the shared expert's width


def _with_shared_expert(path, tmp):
    """The bf16 checkpoint at ``path`` plus a sigmoid-gated shared expert in its sparse layers (a
    second bf16 shard, an index), under test_moe_load's moe_shared family (a models dir in ``tmp``
    that the process reads from now on)."""
    import json
    import shutil

    from test_moe_load import SHARED_FAMILY

    from engine import paths

    root = tmp / "models"
    shutil.copytree(paths.models_dir(), root)
    (root / "moe_shared.yaml").write_text(SHARED_FAMILY)
    paths.models_dir = lambda: root  # the caller restores it
    rng = np.random.default_rng(9)
    h = DIMS["hidden_size"]
    tensors = {}
    for i in (0, 2):
        p = f"model.layers.{i}.mlp."
        tensors[p + "shared_expert.gate_proj.weight"] = rng.standard_normal((SHARED, h)) * 0.05
        tensors[p + "shared_expert.up_proj.weight"] = rng.standard_normal((SHARED, h)) * 0.05
        tensors[p + "shared_expert.down_proj.weight"] = rng.standard_normal((h, SHARED)) * 0.05
        tensors[p + "shared_expert_gate.weight"] = rng.standard_normal((1, h)) * 0.2
    header, blobs, off = {}, [], 0
    for name, a in tensors.items():
        bits = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
        raw = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16).tobytes()
        header[name] = {"dtype": "BF16", "shape": list(a.shape), "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    with open(path / "model-shared.safetensors", "wb") as f:
        f.write(len(head).to_bytes(8, "little") + head + b"".join(blobs))
    base = json.loads((path / "model.safetensors").read_bytes()[8:][: int.from_bytes((path / "model.safetensors").read_bytes()[:8], "little")])
    weight_map = {n: "model.safetensors" for n in base if n != "__metadata__"}
    weight_map.update(dict.fromkeys(tensors, "model-shared.safetensors"))
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(architectures=["SharedExpertTestForCausalLM"], shared_expert_intermediate_size=SHARED)
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def test_moe_plan_uses_the_expert_kernels(moe):
    fmt, runner, _ = moe
    templates = {la.spec.template for st in runner.plan.steps for m in ("decode1", "decode") for la in st.launches[m]}
    assert {"moe_router", "moe_gemv", "moe_combine"} <= templates and "moe_topk" not in templates  # decode: fused router
    assert ("moe_shared" in templates) is (fmt == "shared")
    prefill = {la.spec.template for st in runner.plan.steps for la in st.launches["prefill"]}
    assert {"moe_sort", "moe_gemm", "moe_combine"} <= prefill and "moe_gemv" not in prefill
    decode = [la for st in runner.plan.steps for la in st.launches["decode"] if la.spec.template == "moe_gemm"]
    least = runner.profile.tune("gemm_decode").get("moe_min_rows") or 16  # (16: 4 tokens per expert, 8 top 2)
    assert decode and all(la.min_rows == least and la.spec.params["tile_m"] == 16 for la in decode)


def test_long_prefill_matches_the_reference(moe):
    """A 300-token prompt: 75 (token, slot) pairs per expert on average, so the grouped GEMM runs
    experts over several row tiles; then two long prompts batched give the tokens each gives alone."""
    fmt, runner, ref = moe
    prompt = _prompt(77, 300)
    table = list(range(4 * 8, 4 * 8 + 20))
    tok = runner.step([StepItem(0, prompt, 0, table, True, GREEDY)])[0]
    got = np.array(runner.read_logits(1)[0])
    want = ref.forward_logits(prompt)[-1]
    err = _rel(got, want)
    print(f"moe {fmt}: 300-token prefill logits rel err {err:.2e}")
    assert err < 2e-2, err
    top2 = np.sort(want)[-2:]
    assert tok == int(np.argmax(want)) or top2[1] - top2[0] < 2e-2 * (np.abs(want).max() + 1e-6)
    seqs = {0: prompt, 1: _prompt(78, 260)}
    tables = {0: table, 1: list(range(60, 80))}
    solo = generate_solo(runner, seqs, tables, 3)
    assert generate(runner, seqs, tables, 3) == solo, fmt


def test_logits_and_greedy_match_the_reference(moe):
    fmt, runner, ref = moe
    seed = SHARED_DECODE_PROMPT_SEED if fmt == "shared" else DECODE_PROMPT_SEED
    prompt = _prompt(seed, 13)  # (well conditioned: tests/test_moe_conditioning.py)
    _, errs, flips = teacher_forced_greedy(runner, ref, prompt, list(range(4)), DECODE_STEPS, fmt, tie=2e-2)
    print(f"moe {fmt}: logits rel err {', '.join(f'{e:.2e}' for e in errs)}; near-tie flips {flips}")
    assert max(errs) < 2e-2, errs


@pytest.mark.parametrize("batch", [2, 5])  # bucket 2: the per-slot expert GEMVs; 8: the grouped ones
def test_batched_greedy_equals_solo(moe, batch):
    fmt, runner, _ = moe
    bucket = runner._bucket_of[batch]
    if any(la.spec.template == "moe_gemm" and la.runs_at(bucket) for st in runner.plan.steps for la in st.launches["decode"]):
        pytest.skip(f"the {bucket}-row pass runs the grouped GEMM (gemm_decode.moe_min_rows), batch-variant by design")
    seqs = {i: _prompt(10 + i, 5 + 3 * i) for i in range(batch)}
    tables = {i: list(range(4 * i, 4 * i + 4)) for i in seqs}
    solo = generate_solo(runner, seqs, tables, 8)
    batched = generate(runner, seqs, tables, 8)
    assert batched == solo, fmt


@pytest.mark.parametrize("batch", [1, 3])
def test_graph_decode_is_bit_identical_to_eager(moe, batch):
    _, runner, _ = moe
    seqs = {i: _prompt(30 + i, 7) for i in range(batch)}
    tables = {i: list(range(4 * i, 4 * i + 4)) for i in seqs}
    runner.step([StepItem(i, p, 0, tables[i], False, GREEDY) for i, p in seqs.items()])
    items = [StepItem(i, [5], len(p), tables[i], True, GREEDY) for i, p in seqs.items()]
    runner.use_graphs = True
    runner.step(items)
    graph = np.array(runner.read_logits(batch))
    runner.use_graphs = False
    runner.step(items)
    eager = np.array(runner.read_logits(batch))
    runner.use_graphs = True
    assert np.isfinite(graph).all() and np.array_equal(graph, eager)


def test_wide_batch_decode_matches_the_emulated_rounding(moe):
    """20 sequences decoding together: at least 4 tokens per expert on average (8 experts, top 2),
    so the decode bucket runs moe_sort + the grouped GEMM (row tiles of 16). Each row against the
    reference with the plan's own roundings (tests/fixtures/step_numerics.py: the prefill's bf16
    GEMMs, its bf16 P, bf16-decoded expert weights, int8 x of the dense GEMVs, bf16 activations):
    the row's logits within REF_FACTOR times the largest distance from the reference of that
    emulation under f32-level noise (the GPU's summation order lands a rounding-noise away from
    the emulation: step_numerics), the prefill's last-row logits likewise, and its greedy tokens
    the emulation's (or a near tie). The table printed gives each row's distances:
    GPU-reference, emulation-reference, the perturbed emulations' range, GPU-emulation, and the
    prefill row's."""
    from fixtures.step_numerics import row_check

    fmt, runner, ref = moe
    seqs = {i: _prompt(s, WIDE_PROMPT_LEN) for i, s in enumerate(WIDE_PROMPT_SEEDS)}
    tables = {i: [100 + i] for i in seqs}
    first = runner.step([StepItem(i, p, 0, tables[i], True, GREEDY) for i, p in seqs.items()])
    got_first = np.array(runner.read_logits(len(seqs)))  # (the prefill's head rows, in item order)
    items = [StepItem(i, [t], len(seqs[i]), tables[i], True, GREEDY) for i, t in zip(seqs, first, strict=True)]
    toks = runner.step(items)
    got = np.array(runner.read_logits(len(items)))
    lines, bad = [], []
    for row, p in enumerate(seqs.values()):
        want_first = np.asarray(ref.forward_logits(p)[-1], np.float64)
        want = np.asarray(ref.forward_logits(p + [first[row]])[-1], np.float64)
        chk = row_check(ref, runner.plan, p, first[row], len(items), WIDE_PROMPT_SEEDS[row], want, want_first)
        err, err_first = _rel(got[row], want), _rel(got_first[row], want_first)
        lines.append(f"row {row:2d}: gpu-ref {err:.2e}  emu-ref {chk.emu_err:.2e}  perturbed-ref "
                     f"{min(chk.draw_errs):.2e}..{max(chk.draw_errs):.2e}  bound {chk.bound:.2e}  "
                     f"gpu-emu {_rel(got[row], chk.last):.2e} | prefill gpu-ref {err_first:.2e} "
                     f"emu-ref {chk.first_err:.2e} bound {chk.first_bound:.2e}")
        if err > chk.bound or err_first > chk.first_bound or not chk.greedy_ok(first[row], decode=False) \
                or not chk.greedy_ok(toks[row]):
            bad.append((row, first[row], toks[row], lines[-1]))
    print(f"moe {fmt}: b20 decode rows\n" + "\n".join(lines))
    assert not bad, (fmt, bad)


# (name, MEMRA_TUNE spec, MEMRA_PDL, use_graphs): the batch-1 features of a q4_k_m model's decode
# step, each switched off in turn
DECODE1_VARIANTS = (
    ("default", "", "", True),
    ("eager", "", "", False),
    ("no PDL", "", "0", True),
    ("no early trigger", "decode_graph.early_trigger=false", "", True),
    ("no q8x GEMVs", "gemv_coop.q8x=false", "", True),
    ("no wsm tiles", "gemv_coop.q8x_wsm_kb=0", "", True),
    ("no q|k + v pair", "decode_graph.pair_linears=false", "", True),
)


def test_q4_k_m_first_decode_step_per_batch1_feature(tmp_path, monkeypatch):
    """The q4_k_m model's first batch-1 decode step (the well-conditioned decode prompt) against the
    reference with each batch-1 feature switched off in turn (DECODE1_VARIANTS): every variant must
    match; the failure message lists each variant's logits error and greedy token, so one run
    shows which feature is wrong."""
    from engine import cuda
    from engine.model import load_model
    from engine.profile import select, with_tuning
    from engine.reference import ReferenceRunner
    from engine.runner_cuda import CudaRunner

    model = load_model(write_qwen3_moe_gguf(tmp_path / "m.gguf", quant="q4_k_m", seed=SEED, **DIMS))
    ref = ReferenceRunner(model, num_blocks=64, max_model_len=512)
    prompt = _prompt(DECODE_PROMPT_SEED, 13)
    prof = select(cuda.detect_devices()[0])
    rows = []
    for name, tune, pdl, graphs in DECODE1_VARIANTS:
        monkeypatch.setenv("MEMRA_PDL", pdl)
        runner = CudaRunner(model, with_tuning(prof, tune) if tune else prof, num_blocks=64, max_model_len=512,
                            use_graphs=graphs)
        try:
            tok = runner.step([StepItem(0, prompt, 0, list(range(4)), True, GREEDY)])[0]
            seq = [*prompt, tok]
            nxt = runner.step([StepItem(0, [tok], len(prompt), list(range(4)), True, GREEDY)])[0]
            got = np.array(runner.read_logits(1)[0])
        finally:
            runner.close()
        want = ref.forward_logits(seq)[-1]
        rows.append((name, f"{_rel(got, want):.2e}", nxt, int(np.argmax(want))))
    print("q4_k_m first decode step:", rows)
    assert all(float(e) < 2e-2 for _, e, _, _ in rows), rows
