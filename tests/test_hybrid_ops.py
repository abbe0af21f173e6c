"""The hybrid families' numpy ops (engine.ops_ref_linear) against explicit loops, each other and
transformers' own functions: chunked delta rule == recurrent, conv1d with state split anywhere ==
whole, gated RMSNorm, split heads, v-head orders."""

from __future__ import annotations

import numpy as np
import pytest

from engine import ops_ref_linear as L


def _inputs(seed=0, t=150, h=4, dk=16, dv=8):
    rng = np.random.default_rng(seed)
    q, k = rng.standard_normal((t, h, dk)), rng.standard_normal((t, h, dk))
    v = rng.standard_normal((t, h, dv))
    g = -np.abs(rng.standard_normal((t, h))) * 0.3
    beta = rng.random((t, h))
    s0 = rng.standard_normal((h, dk, dv)) * 0.1
    return q, k, v, g, beta, s0


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_delta_rule_equals_recurrent(chunk):
    q, k, v, g, beta, s0 = _inputs()
    o1, s1 = L.delta_rule_recurrent(q, k, v, g, beta, s0)
    o2, s2 = L.delta_rule_chunked(q, k, v, g, beta, s0, chunk=chunk)
    assert np.abs(o1 - o2).max() < 1e-12 and np.abs(s1 - s2).max() < 1e-12


def test_delta_rule_split_carries_state():
    q, k, v, g, beta, s0 = _inputs(1)
    whole, s_whole = L.delta_rule_chunked(q, k, v, g, beta, s0)
    a, s_mid = L.delta_rule_chunked(q[:61], k[:61], v[:61], g[:61], beta[:61], s0)
    b, s_end = L.delta_rule_recurrent(q[61:], k[61:], v[61:], g[61:], beta[61:], s_mid)
    assert np.abs(np.concatenate([a, b]) - whole).max() < 1e-12
    assert np.abs(s_end - s_whole).max() < 1e-12


def test_delta_rule_explicit_single_token():
    """One token by hand: S' = exp(g) S + k beta (v - (exp(g) S)^T k)^T, o = S'^T q / sqrt(dk)."""
    q, k, v, g, beta, s0 = _inputs(2, t=1, h=1, dk=4, dv=3)
    qn = q[0, 0] / np.linalg.norm(q[0, 0]) / 2.0
    kn = k[0, 0] / np.sqrt(np.sum(k[0, 0] ** 2) + 1e-6)
    s = np.exp(g[0, 0]) * s0[0]
    s = s + np.outer(kn, beta[0, 0] * (v[0, 0] - s.T @ kn))
    o, s1 = L.delta_rule_recurrent(q, k, v, g, beta, s0)
    assert np.allclose(s1[0], s) and np.allclose(o[0, 0], s.T @ qn, atol=1e-6)


def test_matches_transformers_delta_rules():
    torch = pytest.importorskip("torch")
    m = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
    q, k, v, g, beta, s0 = _inputs(3)
    ours, s_ours = L.delta_rule_chunked(q, k, v, g, beta, s0)

    def t(x):
        return torch.tensor(x[None], dtype=torch.float64)

    for fn in (m.torch_chunk_gated_delta_rule, m.torch_recurrent_gated_delta_rule):
        o, s = fn(t(q), t(k), t(v), t(g), t(beta), initial_state=torch.tensor(s0[None]),
                  output_final_state=True, use_qk_l2norm_in_kernel=True)
        assert np.abs(o[0].numpy() - ours).max() < 1e-5
        assert np.abs(s[0].numpy() - s_ours).max() < 1e-5


def test_causal_conv1d_state_split_anywhere():
    rng = np.random.default_rng(4)
    x, w = rng.standard_normal((20, 6)).astype(np.float32), rng.standard_normal((6, 4)).astype(np.float32)
    zero = np.zeros((6, 3), np.float32)
    whole, st = L.causal_conv1d(x, w, zero)
    # explicit: out[t, c] = silu(sum_j w[c, j] * x[t - 3 + j, c]) with zeros before the start
    pad = np.concatenate([np.zeros((3, 6), np.float32), x])
    ref = np.stack([(pad[t : t + 4] * w.T).sum(0) for t in range(20)])
    assert np.allclose(whole, ref / (1 + np.exp(-ref)), atol=1e-6)
    for cut in (1, 2, 5, 19):
        a, mid = L.causal_conv1d(x[:cut], w, zero)
        b, end = L.causal_conv1d(x[cut:], w, mid)
        assert np.array_equal(np.concatenate([a, b]), whole) and np.array_equal(end, st)


def test_gated_rmsnorm_and_split_heads():
    rng = np.random.default_rng(5)
    x, z, w = rng.standard_normal((3, 8)), rng.standard_normal((3, 8)), rng.standard_normal(4)
    out = L.gated_rmsnorm(x, z, w, 1e-6, 4)
    for t in range(3):
        for h in range(2):
            xs, zs = x[t, h * 4 : h * 4 + 4], z[t, h * 4 : h * 4 + 4]
            want = xs / np.sqrt(np.mean(xs**2) + 1e-6) * w * zs / (1 + np.exp(-zs))
            assert np.allclose(out[t, h * 4 : h * 4 + 4], want, atol=1e-5)
    qg = np.arange(2 * 2 * 3, dtype=np.float32).reshape(1, 12)  # 2 heads of [q(3) | gate(3)]
    q, gate = L.split_heads(qg, 3, 2)
    assert q.tolist() == [[0, 1, 2, 6, 7, 8]] and gate.tolist() == [[3, 4, 5, 9, 10, 11]]


def test_v_head_orders():
    assert L.v_head_to_k_head(2, 6, False).tolist() == [0, 0, 0, 1, 1, 1]
    assert L.v_head_to_k_head(2, 6, True).tolist() == [0, 1, 0, 1, 0, 1]
    with pytest.raises(ValueError):
        L.v_head_to_k_head(4, 6, False)


def test_unpack_qkvz_ba_matches_transformers_ordering():
    torch = pytest.importorskip("torch")
    nxt = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    kh, vh, kd, vd, t = 2, 6, 4, 3, 5
    rng = np.random.default_rng(6)
    qkvz = rng.standard_normal((t, kh * (2 * kd + 2 * (vh // kh) * vd))).astype(np.float32)
    ba = rng.standard_normal((t, 2 * vh)).astype(np.float32)
    qkv, z, b, a = L.unpack_qkvz_ba(qkvz, ba, k_heads=kh, v_heads=vh, k_dim=kd, v_dim=vd)

    class Cfg:  # the attributes fix_query_key_value_ordering reads
        num_k_heads, num_v_heads, head_k_dim, head_v_dim = kh, vh, kd, vd

    q2, k2, v2, z2, b2, a2 = nxt.Qwen3NextGatedDeltaNet.fix_query_key_value_ordering(
        Cfg, torch.tensor(qkvz[None]), torch.tensor(ba[None])
    )
    want = np.concatenate([x[0].reshape(t, -1).numpy() for x in (q2, k2, v2)], axis=1)
    assert np.array_equal(qkv, want)
    assert np.array_equal(z, z2[0].reshape(t, -1).numpy())
    assert np.array_equal(b, b2[0].numpy()) and np.array_equal(a, a2[0].numpy())


@pytest.mark.parametrize("chunk", [16, 64])
def test_delta_rule_varlen_equals_recurrent_with_snapshots(chunk):
    """The kernels' contract in the chunked form (chunks cut at snapshot tokens) against the
    token-by-token form: outputs, the final slots and every snapshot, f32 inputs, rel err < 1e-5."""
    rng = np.random.default_rng(5)
    lens, h, dk, dv, slots = [1, 15, 16, 63, 64, 65, 150], 3, 16, 8, 24
    starts = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    n = int(starts[-1])
    q, k, v, g, beta, _ = (x.astype(np.float32) for x in _inputs(6, t=n, h=h, dk=dk, dv=dv))
    states = (rng.standard_normal((slots, h, dk, dv)) * 0.1).astype(np.float32)
    rows = len(lens)
    outs = np.arange(rows, dtype=np.int32)
    ins = np.where(np.arange(rows) % 2 == 0, -1, rows + np.arange(rows)).astype(np.int32)
    ins[1] = outs[1]
    snap = np.full(n, -1, np.int32)
    picks = [starts[3] + 15, starts[5] + 63, starts[5] + 64, starts[6] + 3, starts[6] + 100, starts[1]]
    for i, t in enumerate(picks):
        snap[t] = 2 * rows + i
    got, got_states = L.delta_rule_varlen(q, k, v, g, beta, states, starts, ins, outs, snap, chunk=chunk)
    want, want_states = np.empty_like(got), states.astype(np.float64).copy()
    for s in range(rows):
        cur = states[ins[s]] if ins[s] >= 0 else np.zeros((h, dk, dv))
        for t in range(starts[s], starts[s + 1]):
            want[t : t + 1], cur = L.delta_rule_recurrent(q[t : t + 1], k[t : t + 1], v[t : t + 1], g[t : t + 1],
                                                          beta[t : t + 1], cur)
            if snap[t] >= 0:
                want_states[snap[t]] = cur
        want_states[outs[s]] = cur
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-5
    assert np.linalg.norm(got_states - want_states) / np.linalg.norm(want_states) < 1e-5
    assert all(np.abs(got_states[2 * rows + i]).max() > 0 for i in range(len(picks)))
