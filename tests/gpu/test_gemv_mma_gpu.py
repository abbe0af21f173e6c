"""The tensor-core decode linear (kernels/gemv_mma.cu.j2) against numpy: every storage type it
decodes (bf16 and the upload layouts q4_k, q6_kr, q8_0r, q4_0r, q4_1r, q5_0r), batch 1 and every batch size
class the decode buckets use, with the params kernel_catalog.gemv_mma_params gives on this device's SM
count (a k split over warps and blocks, and the single-part form), a residual that aliases out, f32
logits, a strided x, more rows than bmax and the glu epilogue, x staged in shared memory (xsm: the
plan's chunks and chunks of one unit round) and from global memory; and a row's output bits the
same alone as in batches of 2..64, with x staged or not (the property the plan relies on: batched
equal to solo). Inputs are seeded (SEED): a failure names its case. Outputs are poisoned
with NaN; the reference is x @ dequantize(W).T in float64 (engine.quant's dequantisation, checked
against gguf in tests/test_quant.py). Run on a GPU machine:
``PYTHONPATH=$PWD python -m pytest -q tests/gpu/test_gemv_mma_gpu.py``.
"""

from __future__ import annotations

import numpy as np
import pytest
from gpu_harness import bf_round, poisoned, rel_err, upload, uploaded_weights

from engine import kernel_catalog as kc
from engine.kernel_catalog.contracts import MMA_UNIT
from engine.kernel_catalog.gemv_mma import mma_bmax

N, K = 1003, 2560  # an odd n (the last tile's row tail), Qwen3-4B's hidden size as k
BATCHES = (1, 2, 3, 8, 17, 32, 64, 100)
TYPES = sorted(MMA_UNIT)


@pytest.fixture(scope="module")
def weights():
    return uploaded_weights(11)


def launch_mma(kernels, weights, p: dict, x: np.ndarray, r: np.ndarray | None = None, x_pad: int = 0):
    """Launch gemv_mma ``p`` on x rows (f64, bf16-exact, [rows, x_stride or k]); (out as f64 [rows, n],
    counters left nonzero). ``r``: the residual (uploaded as out, which the kernel reads and overwrites)."""
    n, k, od = p["n"], p["k"], p["out_dtype"]
    rows = x.shape[0]
    w, _ = weights(p["quant"], n, k)
    out = upload(r, "bf16") if r is not None else poisoned((rows, n), od)
    xd = upload(x, "bf16")
    args = dict(out=out, w=w, x=xd.at(x_pad), residual=out if r is not None else 0, rows=rows)
    count = None
    if p["kparts"] > 1:  # sized as engine.lowering.gemv_mma sizes the scratch
        args["part_sum"] = poisoned((p["kparts"] * rows * n,), "f32")
        tiles = -(-n // (16 * p["mt"] * p["wm"])) * -(-rows // p["bmax"])
        count = args["part_count"] = upload(np.zeros(tiles, np.int32), "i32")
    kernels.launch(kc.choice("gemv_mma", **p), rows, **args)
    left = int(np.count_nonzero(count.get())) if count is not None else 0
    return out.get(), left


def run_mma(kernels, weights, p: dict, rows: int, rng, x_pad: int = 0) -> tuple[float, int, int]:
    """Launch gemv_mma ``p`` on ``rows`` random x rows; (rel err, NaN count, counters left nonzero)."""
    n, k = p["n"], p["k"]
    _, deq = weights(p["quant"], n, k)
    x = bf_round(rng.standard_normal((rows, p["x_stride"] or k)))
    xin = x[:, x_pad : x_pad + k]
    r = bf_round(rng.standard_normal((rows, n))) if p["residual"] else None
    got, left = launch_mma(kernels, weights, p, x, r, x_pad)
    ref = xin @ deq.T + (r if r is not None else 0)
    if p["glu"]:  # silu(gate) * up in the gate half, from the bf16-rounded sums; the up half unwritten
        gate, up = bf_round(ref[:, : p["glu"]]), bf_round(ref[:, p["glu"] :])
        untouched = int(np.isnan(got[:, p["glu"] :]).sum()) == got[:, p["glu"] :].size
        got, ref = got[:, : p["glu"]], gate / (1.0 + np.exp(-gate)) * up
        if not untouched:
            return 1.0, 0, 0
    return rel_err(got, ref), int(np.isnan(got).sum()), left


def _params(qt, n, k, rows, profile, **kw):
    p = kc.gemv_mma_params(qt, n, k, mma_bmax(rows), sm_count=profile.sm_count, **kw)
    assert p is not None, qt
    return p


def _base(qt, n, k, rows, profile, **kw):
    """The launch without x staging, at MMA_SHAPES' row tile (x from global memory)."""
    return _params(qt, n, k, rows, profile, stage_x=False, fit_tile=False, **kw)


def _xsm1(p: dict) -> dict:
    """``p`` with x staged in chunks of one unit round (two stages, a barrier every round)."""
    return {**p, "xsm": 1}


def _split(p: dict, kparts: int) -> dict:
    """``p`` with its k split over ``kparts`` blocks (x staged in that split's chunks where p's is)."""
    q = {**p, "kparts": kparts}
    if p["xsm"]:
        q["xsm"] = kc.mma_xchunk(p["quant"], p["k"], p["bmax"], p["wk"], kparts)
    return q


def _tag(p: dict) -> tuple:
    return (p["quant"], p["bmax"], p["mt"], p["wm"], p["kparts"], p["depth"], p["xsm"])


SEED = 20261207  # inputs seeded (a failure names its case and can be rerun)


def test_gemv_mma_every_type_and_batch(kernels, weights, profile):
    """The plan's launches (x staged in shared memory, mma_row_tile's row tile) and the ones before
    them (x from global memory, MMA_SHAPES' tile) at every batch class."""
    cases = [(_params(qt, N, K, rows, profile, residual=rows % 2 == 0), rows) for qt in TYPES for rows in BATCHES]
    cases += [(_base(qt, N, K, rows, profile, residual=True), rows) for qt in TYPES for rows in (1, 8, 17, 64)]
    kernels.prebuild(dict.fromkeys(kc.spec("gemv_mma", **p) for p, _ in cases))
    rng = np.random.default_rng(SEED)
    bad = []
    for p, rows in cases:
        err, nans, left = run_mma(kernels, weights, p, rows, rng)
        if not (err <= 1e-2 and nans == 0 and left == 0):
            bad.append((_tag(p), rows, err, nans, left))
    assert not bad, (SEED, bad)


@pytest.mark.parametrize("shape", [(N, K), (2560, 4096), (1024, 9728)])
def test_a_row_gets_the_same_bits_alone_and_in_every_batch(kernels, weights, profile, shape):
    """Rows 0, 1, 7 and 16 of x alone (batch 1: the bmax-8 kernel with one live column) and as rows
    of batches of 2, 3, 8, 17, 32 and 64 (every bucket's kernel; f32 out, the unrounded sums): the
    same bits. (2560,
    4096): the o projection's k split over 3 blocks; (1024, 9728): a long k."""
    n, k = shape
    rng = np.random.default_rng(1)
    bad = []
    for qt in TYPES:
        specs = {b: _params(qt, n, k, b, profile, out_dtype="f32") for b in (1, 2, 3, 8, 17, 32, 64)}
        kernels.prebuild(dict.fromkeys(kc.spec("gemv_mma", **p) for p in specs.values()))
        x = bf_round(rng.standard_normal((64, k)))
        solo = {r: launch_mma(kernels, weights, specs[1], x[r : r + 1])[0][0] for r in (0, 1, 7, 16)}
        runs = [(b, p) for b, p in specs.items()]
        # x from global memory at the old tile, and x in chunks of one round: the same bits
        runs += [(b, _base(qt, n, k, b, profile, out_dtype="f32")) for b in (1, 8, 17, 64)]
        runs += [(b, _xsm1(specs[b])) for b in (1, 3, 32)]
        kernels.prebuild(dict.fromkeys(kc.spec("gemv_mma", **p) for _, p in runs))
        for b, p in runs:
            got, left = launch_mma(kernels, weights, p, x[:b])
            for r, want in solo.items():
                if r < b and not np.array_equal(got[r].astype(np.float32).view(np.uint32),
                                                want.astype(np.float32).view(np.uint32)):  # fmt: skip
                    bad.append((n, k, b, _tag(p), r, float(np.abs(got[r] - want).max())))
            if left or np.isnan(got).any():
                bad.append((n, k, b, _tag(p), "nan or counters", left))
    assert not bad, bad[:20]


def test_gemv_mma_variants(kernels, weights, profile):
    """The single-part form, f32 logits, a strided x (a column view), more rows than bmax (two grid
    rows), a k split over many blocks, the glu epilogue (gate|up storing silu(gate) * up, split and
    single-part), a second launch reusing the part counters (the last block of each tile leaves
    its counter zero); each also with x
    in chunks of one unit round (xsm=1: two stages), and the tall bf16 / q8_0r tile (mt 4, 128
    threads)."""
    base = dict(sm_count=profile.sm_count)
    cases = []
    for qt in ("bf16", "q8_0r"):  # mma_row_tile's tall tile: 4 m tiles a warp, 4 warps a block
        for bmax in (8, 16):
            p = kc.gemv_mma_params(qt, N, K, bmax, residual=True, **base)
            cases += [({**p, "mt": 4, "wm": 1, "depth": 1, "min_blocks": 4}, bmax - 1, 0),
                      (_split({**p, "mt": 4, "wm": 1, "depth": 1, "min_blocks": 4}, 3), bmax, 0)]  # fmt: skip
    for qt in TYPES:
        for bmax in (8, 64):
            p1 = kc.gemv_mma_params(qt, N, K, bmax, residual=True, **base)
            cases.append((_split(p1, 1), bmax - 3, 0))
            cases.append((kc.gemv_mma_params(qt, N, K, bmax, out_dtype="f32", **base), bmax, 0))
        cases.append((kc.gemv_mma_params(qt, N, K, 16, x_stride=K + 64, **base), 11, 32))
        cases.append((kc.gemv_mma_params(qt, N, K, 64, residual=True, **base), 100, 0))
        cases.append((_split(kc.gemv_mma_params(qt, N, K, 32, **base), 5), 20, 0))
        for bmax in (8, 16, 64):  # a gate|up of 2 x 501 rows storing silu(gate) * up
            pg = kc.gemv_mma_params(qt, 1002, K, bmax, glu=501, **base)
            cases += [(pg, bmax - 1, 0), (_split(pg, 1), bmax, 0), (_split(pg, 3), 1, 0)]
    cases += [(_xsm1(p), rows, pad) for p, rows, pad in cases if p["xsm"]]
    kernels.prebuild(dict.fromkeys(kc.spec("gemv_mma", **p) for p, _, _ in cases))
    rng = np.random.default_rng(SEED + 1)
    bad = []
    for p, rows, pad in cases:
        for _ in range(2):
            err, nans, left = run_mma(kernels, weights, p, rows, rng, x_pad=pad)
            if not (err <= 1e-2 and nans == 0 and left == 0):
                bad.append((_tag(p), rows, p["out_dtype"], p["glu"], pad, err, nans, left))
    assert not bad, (SEED + 1, bad)


def test_gemv_mma_bf16_is_exact_to_accumulation(kernels, weights, profile):
    """The k permutation and the warps' sum order change nothing beyond rounding: a bf16 weight
    (exact in the tensor-core path) agrees with float64 to accumulation precision."""
    for rows in (1, 5, 40):
        p = _params("bf16", N, K, rows, profile, out_dtype="f32")
        kernels.prebuild([kc.spec("gemv_mma", **p)])
        for q in (p, _base("bf16", N, K, rows, profile, out_dtype="f32")):
            kernels.prebuild([kc.spec("gemv_mma", **q)])
            err, nans, _ = run_mma(kernels, weights, q, rows, np.random.default_rng(SEED + 2 + rows))
            assert nans == 0 and err <= 1e-5, (rows, _tag(q), err)


# tiny models (tests/gpu/test_quant_models.py's shapes): k = 512 / 576 / 1536, gate|up 2 x 1536
QWEN3_DIMS = dict(hidden_size=512, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                  head_dim=64, intermediate_size=1536)
LLAMA_DIMS = dict(hidden_size=576, num_hidden_layers=2, num_attention_heads=9, num_key_value_heads=3,
                  head_dim=64, intermediate_size=1536, tie_word_embeddings=True)


MMA_ALL = "gemv_mma.types=[bf16, q8_0, q4_k, q6_k, q4_0, q4_1, q5_0]"
# a Qwen3 wide enough that some linears split k over blocks (the down projection: 3072 = 24 q4_k units)
QWEN3_SPLIT_DIMS = dict(QWEN3_DIMS, hidden_size=1024, head_dim=128, intermediate_size=3072)


@pytest.mark.parametrize(
    "family,q",
    [("qwen3", "bf16"), ("qwen3", "q8_0"), ("qwen3", "q4_k_m"), ("llama", "q4_0"), ("llama", "q4_1"), ("llama", "q5_0")],
)
def test_plan_on_gemv_mma_matches_the_reference_and_batched_equals_solo(tmp_path, monkeypatch, family, q):
    """The plan with tuning gemv_mma.types naming every type (MEMRA_TUNE): the decode linears run
    gemv_mma at batch 1 and in the buckets (the Qwen3s wide enough that some split k over blocks,
    through the runner's scratch). 1, 3, 20 and 40 sequences (bmax 8, 8, 32, 64) decode one
    step together, graph-replayed: every row's logits match the numpy reference's for that sequence
    alone, and rows of the 20- and 40-row steps run again alone (batch 1) give the same logits, bit
    for bit."""
    from fixtures.checkpoints import Dims, write_qwen3_safetensors, write_random_gguf
    from fixtures.decode_linear_checks import plan_matches_the_reference_and_batched_equals_solo

    from engine.model import load_model

    monkeypatch.setenv("MEMRA_TUNE", MMA_ALL)
    if q == "bf16":
        path = write_qwen3_safetensors(tmp_path / "tiny", seed=7, **QWEN3_SPLIT_DIMS)
    else:
        dims = Dims(**(LLAMA_DIMS if family == "llama" else QWEN3_SPLIT_DIMS), vocab_size=768)
        path = write_random_gguf(tmp_path / f"tiny_{q}.gguf", family, dims, q, seed=7)
    # the Qwen3s split k over blocks (through the scratch); k = 576 rows of q4_0 / q4_1 / q8_0 keep the
    # GEMV (not whole units), so the linears on gemv_mma are the same at batch 1 and in the buckets
    plan_matches_the_reference_and_batched_equals_solo(load_model(path), {"gemv_mma"},
                                                       split="gemv_mma" if family == "qwen3" else None, tol=3e-2,
                                                       label=f"{family} {q} on gemv_mma")  # fmt: skip
