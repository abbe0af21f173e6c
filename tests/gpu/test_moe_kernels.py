"""The MoE kernels (moe_topk, moe_gemv glu/down) against the numpy reference on a real GPU.

Fresh random inputs each run: router logits for the top-k softmax (ids exact, weights 1e-5), random
GGUF blocks / bf16 rows for the stacked expert weights of every checked storage type (bf16, q8_0,
q4_k, q5_k, q6_k; relative error 1e-2 for the bf16 outputs), the residual aliasing the output, and
a whole sparse MLP (logits -> moe_topk -> glu -> down) against engine.ops_ref_moe.moe_experts.
Launches through tools/gpu_kernels_check.py's loader (engine.compile + cuda.bindings, torch as the
allocator); skipped without torch and a CUDA device.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from engine import quant
from engine.moe_kernels import combine_kernel, expert_gemv_kernel, topk_kernel
from engine.ops_ref_moe import moe_experts, moe_route

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")]

QUANTS = ("bf16", "q8_0", "q4_k", "q5_k", "q6_k")
SCALE_FIELDS = {"q8_0": (0,), "q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,)}


@pytest.fixture(scope="module")
def gk():
    path = Path(__file__).resolve().parents[2] / "tools" / "gpu_kernels_check.py"
    spec = importlib.util.spec_from_file_location("gpu_kernels_check", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    torch.zeros(1, device="cuda")
    mod.check(mod.drv.cuInit(0))
    return mod


@pytest.fixture(scope="module")
def kernels(gk, tmp_path_factory):
    return gk.Kernels(str(tmp_path_factory.mktemp("kcache")))


def stacked_weight(qt: str, e: int, n: int, k: int, rng) -> tuple[np.ndarray, np.ndarray]:
    """(raw bytes [E * n, row bytes] uint8, dequantised f64 [E, n, k]): random blocks with small
    finite f16 scales, or random bf16 rows."""
    if qt == "bf16":
        bits = (rng.standard_normal((e * n, k)).astype(np.float32) * 0.05).view(np.uint32) >> 16
        raw = bits.astype(np.uint16).view(np.uint8)
        return raw, (bits.astype(np.uint32) << 16).view(np.float32).reshape(e, n, k).astype(np.float64)
    elems, nbytes = quant.BLOCK_SIZES[qt]
    nb = e * n * k // elems
    raw = rng.integers(0, 256, size=(nb, nbytes), dtype=np.uint8)
    for off in SCALE_FIELDS[qt]:
        scale = 0.002 if qt.endswith("_k") else 0.01
        raw[:, off : off + 2] = (rng.uniform(0.2, 1.0, nb) * scale).astype(np.float16).view(np.uint8).reshape(nb, 2)
    deq = quant.dequantize(raw.reshape(-1), qt, (e, n, k)).astype(np.float64)
    return raw.reshape(e * n, -1), deq


def _ids(rng, rows: int, experts: int, top_k: int) -> np.ndarray:
    return np.stack([rng.choice(experts, top_k, replace=False) for _ in range(rows)]).astype(np.int32)


@pytest.mark.parametrize("experts,top_k,normalize", [(128, 8, True), (60, 4, False), (8, 2, True)])
def test_topk_matches_moe_route(gk, kernels, experts, top_k, normalize):
    rng = np.random.default_rng()
    rows = 37
    logits = (rng.standard_normal((rows, experts)) * 2).astype(np.float32)
    logits[0] = 0.0  # every probability equal: the lowest ids win
    c = topk_kernel(experts, top_k, normalize)
    ids = torch.full((rows, top_k), -7, dtype=torch.int32, device="cuda")
    wts = gk.nan_like((rows, top_k), torch.float32)
    kernels.launch(c, [ids, wts, gk.f32(logits), rows], rows)
    torch.cuda.synchronize()
    # routing straight from logits: h = logits, router = identity
    want_ids, want_w = moe_route(logits, np.eye(experts, dtype=np.float32), top_k, normalize)
    np.testing.assert_array_equal(ids.cpu().numpy(), want_ids)
    np.testing.assert_allclose(wts.cpu().numpy(), want_w, rtol=1e-5, atol=1e-7)
    assert ids.cpu().numpy()[0].tolist() == list(range(top_k))


@pytest.mark.parametrize("qt", QUANTS)
def test_glu_and_down_match_numpy(gk, kernels, qt):
    rng = np.random.default_rng()
    e, hidden, inter, top_k, rows = 8, 512, 256, 2, 3
    wg_raw, wg = stacked_weight(qt, e, inter, hidden, rng)
    wu_raw, wu = stacked_weight(qt, e, inter, hidden, rng)
    wd_raw, wd = stacked_weight(qt, e, hidden, inter, rng)
    ids = _ids(rng, rows, e, top_k)
    x = gk.bf_round(rng.standard_normal((rows, hidden)))
    glu = expert_gemv_kernel("glu", qt, inter, hidden, top_k)
    act = gk.nan_like((rows, top_k, inter))
    dev = {n: torch.from_numpy(r).cuda() for n, r in (("g", wg_raw), ("u", wu_raw), ("d", wd_raw))}
    ids_t = gk.i32(ids)
    kernels.launch(glu, [act, dev["g"], dev["u"], gk.bf(x), ids_t, rows], rows)
    g = np.einsum("tk,tjnk->tjn", x, wg[ids])
    ref_act = g / (1 + np.exp(-g)) * np.einsum("tk,tjnk->tjn", x, wu[ids])
    got_act = gk.host(act)
    assert not np.isnan(got_act).any()
    assert gk.rel_err(got_act, ref_act) < 1e-2, gk.rel_err(got_act, ref_act)

    a = gk.bf_round(rng.standard_normal((rows, top_k, inter)))
    w = rng.uniform(0.1, 1.0, (rows, top_k)).astype(np.float32)
    r = gk.bf_round(rng.standard_normal((rows, hidden)))
    ref = np.einsum("tj,tjn->tn", w, np.einsum("tjk,tjnk->tjn", a, wd[ids]))
    for residual in (False, True):
        down = expert_gemv_kernel("down", qt, hidden, inter, top_k, residual=residual)
        out = gk.bf(r) if residual else gk.nan_like((rows, hidden))  # the residual aliases out
        kernels.launch(down, [out, dev["d"], gk.bf(a), ids_t, gk.f32(w), out if residual else 0, rows], rows)
        got = gk.host(out)
        want = ref + (r if residual else 0)
        assert not np.isnan(got).any()
        assert gk.rel_err(got, want) < 1e-2, (residual, gk.rel_err(got, want))


@pytest.mark.parametrize("qt", QUANTS)
@pytest.mark.parametrize("experts,rows,top_k", [(8, 20, 4), (16, 3, 2)])  # ~10 slots per expert (> SB); unchosen experts
def test_grouped_glu_down_combine_match_numpy(gk, kernels, qt, experts, rows, top_k):
    rng = np.random.default_rng()
    hidden, inter = 512, 256
    wg_raw, wg = stacked_weight(qt, experts, inter, hidden, rng)
    wu_raw, wu = stacked_weight(qt, experts, inter, hidden, rng)
    wd_raw, wd = stacked_weight(qt, experts, hidden, inter, rng)
    dev = [torch.from_numpy(r).cuda() for r in (wg_raw, wu_raw, wd_raw)]
    ids = _ids(rng, rows, experts, top_k)
    ids_t = gk.i32(ids)
    x = gk.bf_round(rng.standard_normal((rows, hidden)))
    glu = expert_gemv_kernel("glu_grouped", qt, inter, hidden, top_k, experts=experts, max_slots=128)
    act = gk.nan_like((rows, top_k, inter))
    kernels.launch(glu, [act, dev[0], dev[1], gk.bf(x), ids_t, rows], rows)
    g = np.einsum("tk,tjnk->tjn", x, wg[ids])
    ref_act = g / (1 + np.exp(-g)) * np.einsum("tk,tjnk->tjn", x, wu[ids])
    got_act = gk.host(act)
    assert not np.isnan(got_act).any() and gk.rel_err(got_act, ref_act) < 1e-2, gk.rel_err(got_act, ref_act)

    a = gk.bf_round(rng.standard_normal((rows, top_k, inter)))
    w = rng.uniform(0.1, 1.0, (rows, top_k)).astype(np.float32)
    r = gk.bf_round(rng.standard_normal((rows, hidden)))
    partial = gk.nan_like((rows, top_k, hidden), torch.float32)
    down = expert_gemv_kernel("down_grouped", qt, hidden, inter, top_k, experts=experts, max_slots=128)
    kernels.launch(down, [partial, dev[2], gk.bf(a), ids_t, rows], rows)
    ref_partial = np.einsum("tjk,tjnk->tjn", a, wd[ids])
    got_partial = gk.host(partial)
    assert not np.isnan(got_partial).any() and gk.rel_err(got_partial, ref_partial) < 1e-4
    out = gk.bf(r)  # the residual aliases out
    kernels.launch(combine_kernel(hidden, top_k), [out, partial, gk.f32(w), out, rows], rows)
    want = np.einsum("tj,tjn->tn", w, ref_partial) + r
    assert gk.rel_err(gk.host(out), want) < 1e-2


def test_sparse_mlp_end_to_end(gk, kernels):
    """logits -> moe_topk -> glu -> down(+ residual) against ops_ref_moe on the same routing."""
    rng = np.random.default_rng()
    e, hidden, inter, top_k, rows, qt = 16, 256, 256, 4, 5, "q8_0"
    wg_raw, wg = stacked_weight(qt, e, inter, hidden, rng)
    wu_raw, wu = stacked_weight(qt, e, inter, hidden, rng)
    wd_raw, wd = stacked_weight(qt, e, hidden, inter, rng)
    h = gk.bf_round(rng.standard_normal((rows, hidden)))
    res = gk.bf_round(rng.standard_normal((rows, hidden)))
    logits = (rng.standard_normal((rows, e)) * 2).astype(np.float32)
    ids = torch.zeros((rows, top_k), dtype=torch.int32, device="cuda")
    wts = torch.zeros((rows, top_k), dtype=torch.float32, device="cuda")
    act = gk.nan_like((rows, top_k, inter))
    out = gk.bf(res)
    kernels.launch(topk_kernel(e, top_k, True), [ids, wts, gk.f32(logits), rows], rows)
    dev = [torch.from_numpy(x).cuda() for x in (wg_raw, wu_raw, wd_raw)]
    kernels.launch(expert_gemv_kernel("glu", qt, inter, hidden, top_k), [act, dev[0], dev[1], gk.bf(h), ids, rows], rows)
    down = expert_gemv_kernel("down", qt, hidden, inter, top_k, residual=True)
    kernels.launch(down, [out, dev[2], act, ids, wts, out, rows], rows)
    want_ids, want_w = moe_route(logits, np.eye(e, dtype=np.float32), top_k, True)
    np.testing.assert_array_equal(ids.cpu().numpy(), want_ids)
    ref = moe_experts(h.astype(np.float32), want_ids, want_w, wg.astype(np.float32), wu.astype(np.float32),
                      wd.astype(np.float32), residual=res.astype(np.float32))
    got = gk.host(out)
    assert gk.rel_err(got, ref) < 2e-2, gk.rel_err(got, ref)
