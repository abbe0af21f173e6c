"""The hybrid families' kernels (engine.linear_attn_kernels) against their numpy reference
(engine.ops_ref_linear) on a real GPU, on fresh random inputs with poisoned outputs.

causal_conv1d and gated_delta_rule in both forms (decode: one token per row; varlen prefill: a
sequential walk over each sequence's tokens) with state read from a slot (or zeros), written to
another, and snapshots after chosen tokens; gated_rmsnorm, split_heads, sigmoid_mul and
unpack_qkvz_ba. Skipped without a CUDA device.
"""

from __future__ import annotations

import numpy as np
import pytest
from gpu_harness import bf_round, poisoned, rel_err, upload

from engine import linear_attn_kernels as lk
from engine import ops_ref_linear as L

SLOTS = 16


def _seqs(lens):
    starts = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    return starts, int(starts[-1])


def _state_io(rng, rows):
    """state_in (a slot or -1), state_out (distinct slots), for ``rows`` sequences."""
    perm = rng.permutation(SLOTS)
    outs, pool = perm[:rows].astype(np.int32), perm[rows:]  # restores read slots no row writes
    ins = np.where(rng.random(rows) < 0.3, -1, rng.choice(pool, rows)).astype(np.int32)
    ins[0] = -1
    if rows > 1:
        ins[1] = outs[1]  # the usual decode case: continue in place
    return ins, outs


def _snaps(rng, total, outs, ins):
    """state_snap per token: a few tokens snapshot into slots no sequence reads or writes."""
    free = [s for s in range(SLOTS) if s not in set(outs.tolist()) | set(ins.tolist())]
    snap = np.full(total, -1, np.int32)
    for t, s in zip(rng.permutation(total)[: len(free)], free, strict=False):
        snap[t] = s
    return snap


@pytest.mark.parametrize(
    "varlen,lens,chunks", [(False, [1] * 5, 1), (True, [7, 1, 20], 8), (True, [37, 200, 2], 4), (True, [5, 9], 1)]
)
def test_causal_conv1d(kernels, varlen, lens, chunks):
    rng = np.random.default_rng()
    c, k, xs = 96, 4, 128
    rows = len(lens)
    starts, total = _seqs(lens)
    x = rng.standard_normal((total, xs)).astype(np.float32)
    w = (rng.standard_normal((c, k)) * 0.5).astype(np.float32)
    state0 = rng.standard_normal((SLOTS, c, k - 1)).astype(np.float32)
    ins, outs = _state_io(rng, rows)
    snap = _snaps(rng, total, outs, ins)
    kc_ = lk.conv1d_kernel(c, k, xs, xs, varlen, threads=64, chunks=chunks)
    dx, dstate = upload(x, "bf16"), upload(state0, "f32")
    kernels.launch(kc_, rows, out=dx, x=dx, w=upload(w, "f32"), state=dstate, state_in=upload(ins, "i32"),
                   state_out=upload(outs, "i32"), state_snap=upload(snap, "i32"), seq_starts=upload(starts, "i32"),
                   rows=rows)
    got, st = dx.get(), dstate.get()
    xb = bf_round(x).astype(np.float32)
    want_state = state0.astype(np.float64).copy()
    for s in range(rows):
        lo, hi = starts[s], starts[s + 1]
        init = state0[ins[s]] if ins[s] >= 0 else np.zeros((c, k - 1), np.float32)
        out, new = L.causal_conv1d(xb[lo:hi, :c], w, init)
        assert rel_err(got[lo:hi, :c], out) < 1e-2
        np.testing.assert_array_equal(got[lo:hi, c:], bf_round(x[lo:hi, c:]))  # the columns past C untouched
        want_state[outs[s]] = new
        xs_all = np.concatenate([init.T, xb[lo:hi, :c]])
        for t in range(lo, hi):
            if snap[t] >= 0:
                want_state[snap[t]] = L.conv_state_at(xs_all, t - lo + 1, k)
    assert rel_err(st, want_state) < 1e-6


@pytest.mark.parametrize(
    "varlen,lens,kh,vh,kd,vd,tiled,threads",
    [
        (False, [1] * 4, 2, 4, 32, 32, False, 256),
        (False, [1] * 2, 16, 32, 128, 128, False, 256),  # Qwen3.5-4B's heads, the decode kernel
        (True, [9, 1, 33], 2, 4, 32, 32, True, 32),
        (True, [9, 1, 33], 2, 4, 32, 32, True, 256),
        (True, [40, 3], 2, 4, 16, 16, False, 32),
        (True, [70, 5], 16, 32, 128, 128, False, 32),  # one warp per slice
        (True, [70, 5], 16, 32, 128, 128, True, 128),  # the prefill kernel at Qwen3.5-4B's heads
    ],
)
def test_gated_delta_rule(kernels, varlen, lens, kh, vh, kd, vd, tiled, threads):
    rng = np.random.default_rng()
    rows = len(lens)
    starts, total = _seqs(lens)
    qkv_w = 2 * kh * kd + vh * vd
    qs, bs = qkv_w + 8, vh + 4
    qkv = rng.standard_normal((total, qs)).astype(np.float32)
    b = rng.standard_normal((total, bs)).astype(np.float32)
    a = rng.standard_normal((total, bs)).astype(np.float32)
    A = -np.exp(rng.uniform(-2, 1.5, vh)).astype(np.float32)
    dt = (0.5 * rng.standard_normal(vh)).astype(np.float32)
    state0 = (rng.standard_normal((SLOTS, vh, kd, vd)) * 0.1).astype(np.float32)
    ins, outs = _state_io(rng, rows)
    snap = _snaps(rng, total, outs, ins)
    k_ = lk.delta_rule_kernel(kh, vh, kd, vd, qs, bs, bs, vh * vd, tiled, varlen, threads)
    dout, dstate = poisoned((total, vh * vd)), upload(state0, "f32")
    kernels.launch(k_, rows, out=dout, qkv=upload(qkv, "bf16"), b=upload(b, "bf16"), a=upload(a, "bf16"),
                   A=upload(A, "f32"), dt_bias=upload(dt, "f32"), state=dstate, state_in=upload(ins, "i32"),
                   state_out=upload(outs, "i32"), state_snap=upload(snap, "i32"),
                   seq_starts=upload(starts, "i32"), rows=rows)
    got, st = dout.get(), dstate.get()
    q, k, v = L.split_qkv(bf_round(qkv[:, :qkv_w]), k_heads=kh, v_heads=vh, k_dim=kd, v_dim=vd, v_tiled=tiled)
    g, beta = L.delta_gates(bf_round(a[:, :vh]), bf_round(b[:, :vh]), A, dt)
    want_state = state0.astype(np.float64).copy()
    for s in range(rows):
        lo, hi = starts[s], starts[s + 1]
        cur = state0[ins[s]] if ins[s] >= 0 else np.zeros((vh, kd, vd), np.float32)
        for t in range(lo, hi):  # token by token, so the snapshots fall out
            o, cur = L.delta_rule_recurrent(q[t : t + 1], k[t : t + 1], v[t : t + 1], g[t : t + 1], beta[t : t + 1], cur)
            assert rel_err(got[t], o.reshape(-1)) < 1e-2, (s, t)
            if snap[t] >= 0:
                want_state[snap[t]] = cur
        want_state[outs[s]] = cur
    assert rel_err(st, want_state) < 1e-4


@pytest.mark.parametrize("conv,norm", [(True, True), (False, True), (True, False)])
@pytest.mark.parametrize("rows,tiled,alias,heads", [(1, False, True, "q36"), (3, True, True, "q36"), (2, False, False, "q36"),
                                                    (3, True, True, "tiny")])
def test_gated_delta_rule_with_its_neighbours_fused_stores_their_bits(kernels, conv, norm, rows, tiled, alias, heads):
    """The decode delta rule's ``conv`` and ``norm`` forms (engine.lowering.linear_attention.
    fold_delta_neighbours) against causal_conv1d (in place), gated_delta_rule and gated_rmsnorm
    apart, at Qwen3.6-35B-A3B's heads (a q / k conv channel read by 8 blocks) and the tiny GPU
    models' (by 4): the same output, delta-rule state and conv state bits (live slots, in place or
    not, and snapshots), twice in a row (the per-(row, head) counters back to zero after each launch)."""
    rng = np.random.default_rng()
    kh, vh, kd, vd = (16, 32, 128, 128) if heads == "q36" else (2, 4, 32, 64)
    ck, eps = 4, 1e-6
    qkv_w = 2 * kh * kd + vh * vd
    qs, bs, zs, os_ = qkv_w + 8, vh + 4, vh * vd + 32, vh * vd
    qkv = rng.standard_normal((rows, qs)).astype(np.float32)
    b, a = (rng.standard_normal((rows, bs)).astype(np.float32) for _ in range(2))
    A = -np.exp(rng.uniform(-2, 1.5, vh)).astype(np.float32)
    dt = (0.5 * rng.standard_normal(vh)).astype(np.float32)
    z = rng.standard_normal((rows, zs)).astype(np.float32)
    w = (1 + 0.2 * rng.standard_normal(vd)).astype(np.float32)
    cw = (0.5 * rng.standard_normal((qkv_w, ck))).astype(np.float32)
    state0 = (rng.standard_normal((SLOTS, vh, kd, vd)) * 0.1).astype(np.float32)
    cstate0 = rng.standard_normal((SLOTS, qkv_w, ck - 1)).astype(np.float32)
    ins, outs = _state_io(rng, rows)
    snap = _snaps(rng, rows, outs, ins)
    starts, _ = _seqs([1] * rows)
    io = dict(state_in=upload(ins, "i32"), state_out=upload(outs, "i32"), state_snap=upload(snap, "i32"),
              seq_starts=upload(starts, "i32"), rows=rows)
    common = dict(b=upload(b, "bf16"), a=upload(a, "bf16"), A=upload(A, "f32"), dt_bias=upload(dt, "f32"), **io)
    dz, dw, dcw = upload(z, "bf16"), upload(w, "f32"), upload(cw, "f32")
    conv_k = lk.conv1d_kernel(qkv_w, ck, qs, qs, False)
    plain = lk.delta_rule_kernel(kh, vh, kd, vd, qs, bs, bs, os_, tiled, False)
    norm_k = lk.gated_rmsnorm_kernel(vh, vd, os_, zs, os_, eps)
    fused = lk.delta_rule_kernel(kh, vh, kd, vd, qs, bs, bs, os_, tiled, False, norm=(zs, os_, eps) if norm else None,
                                 conv=ck if conv else 0)
    assert fused.block == plain.block and fused.grid(rows) == plain.grid(rows)
    # apart: conv (in place on qkv) if fused, the rule, the norm (in place) if fused
    dqkv, dout, dstate, dcstate = upload(qkv, "bf16"), poisoned((rows, os_)), upload(state0, "f32"), upload(cstate0, "f32")
    if conv:
        kernels.launch(conv_k, rows, out=dqkv, x=dqkv, w=dcw, state=dcstate, **io)
    kernels.launch(plain, rows, out=dout, qkv=dqkv, state=dstate, **common)
    raw = dout.get()
    if norm:
        kernels.launch(norm_k, rows, out=dout, x=dout, z=dz, w=dw, rows=rows)
    want, want_state, want_cstate = dout.get(), dstate.get(), dcstate.get()
    assert np.isfinite(want).all()
    if norm:
        np.testing.assert_allclose(want, L.gated_rmsnorm(raw, bf_round(z[:, : vh * vd]), w, eps, vd), rtol=2e-2, atol=2e-2)
    ccnt, cnt = upload(np.zeros(rows * kh, np.int32), "i32"), upload(np.zeros(rows * vh, np.int32), "i32")
    for _ in range(2):
        dqkv, dout, dstate, dcstate = upload(qkv, "bf16"), poisoned((rows, os_)), upload(state0, "f32"), upload(cstate0, "f32")
        nout = dout if alias else poisoned((rows, os_))
        extra = dict(cw=dcw, cstate=dcstate, ccnt=ccnt) if conv else {}
        if norm:
            extra.update(nout=nout, z=dz, nw=dw, cnt=cnt)
        kernels.launch(fused, rows, out=dout, qkv=dqkv, state=dstate, **common, **extra)
        assert np.array_equal((nout if norm else dout).get(), want) and np.array_equal(dstate.get(), want_state)
        assert np.array_equal(dcstate.get(), want_cstate)
        if norm and not alias:
            assert np.array_equal(dout.get(), raw)  # (the rule's own output left as stored)
        if conv:
            assert np.array_equal(dqkv.get(), bf_round(qkv))  # (the raw projections left as they were)
        assert not ccnt.get().any() and not cnt.get().any()


def test_gated_rmsnorm(kernels):
    rng = np.random.default_rng()
    t, heads, hd = 5, 4, 64
    x = rng.standard_normal((t, heads * hd)).astype(np.float32)
    z = rng.standard_normal((t, heads * hd + 32)).astype(np.float32)
    w = (1 + 0.2 * rng.standard_normal(hd)).astype(np.float32)
    k_ = lk.gated_rmsnorm_kernel(heads, hd, heads * hd, heads * hd + 32, heads * hd, 1e-6, warps=2)
    dx = upload(x, "bf16")
    kernels.launch(k_, t, out=dx, x=dx, z=upload(z, "bf16"), w=upload(w, "f32"), rows=t)  # in place
    want = L.gated_rmsnorm(bf_round(x), bf_round(z[:, : heads * hd]), w, 1e-6, hd)
    assert rel_err(dx.get(), want) < 1e-2


def test_split_heads_and_sigmoid_mul(kernels):
    rng = np.random.default_rng()
    t, heads, hd = 3, 4, 32
    x = rng.standard_normal((t, 2 * heads * hd + 64)).astype(np.float32)
    sk = lk.split_heads_kernel(heads, hd, x.shape[1], heads * hd, heads * hd, threads=64)
    da, db = poisoned((t, heads * hd)), poisoned((t, heads * hd))
    kernels.launch(sk, t, a=da, b=db, x=upload(x, "bf16"), rows=t)
    wa, wb = L.split_heads(bf_round(x[:, : 2 * heads * hd]), hd, 2)
    np.testing.assert_array_equal(da.get(), wa)
    np.testing.assert_array_equal(db.get(), wb)
    mk = lk.sigmoid_mul_kernel(heads * hd, heads * hd, heads * hd, heads * hd, threads=64)
    dout = poisoned((t, heads * hd))
    kernels.launch(mk, t, out=dout, x=da, gate=db, rows=t)
    assert rel_err(dout.get(), L.sigmoid_mul(wa, wb)) < 1e-2


def test_unpack_qkvz_ba(kernels):
    rng = np.random.default_rng()
    t, kh, vh, kd, vd = 3, 2, 6, 16, 8
    r = vh // kh
    width = kh * (2 * kd + 2 * r * vd)
    qkvz = rng.standard_normal((t, width + 2 * vh)).astype(np.float32)  # qkvz | ba in one buffer
    dq = upload(qkvz, "bf16")
    qkv_w, inner = 2 * kh * kd + vh * vd, vh * vd
    outs = {n: poisoned((t, w)) for n, w in (("qkv", qkv_w), ("z", inner), ("b", vh), ("a", vh))}
    strides = {"qkvz": width + 2 * vh, "ba": width + 2 * vh, "qkv": qkv_w, "z": inner, "b": vh, "a": vh}
    k_ = lk.unpack_kernel(kh, vh, kd, vd, strides, threads=64)
    kernels.launch(k_, t, **outs, qkvz=dq, ba=dq.at(width), rows=t)
    want = L.unpack_qkvz_ba(bf_round(qkvz[:, :width]), bf_round(qkvz[:, width:]), k_heads=kh, v_heads=vh,
                            k_dim=kd, v_dim=vd)
    for name, w in zip(("qkv", "z", "b", "a"), want, strict=True):
        np.testing.assert_array_equal(outs[name].get(), w)
