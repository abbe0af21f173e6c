"""The MoE ops' numpy math (engine.ops_ref_moe) against an explicit per-token loop and against
transformers' own MoE blocks: Qwen3MoeSparseMoeBlock (router + experts) and Qwen3NextSparseMoeBlock
(plus the sigmoid-gated shared expert that Qwen3-Next and Qwen3.5-MoE use)."""

from __future__ import annotations

import numpy as np
import pytest

from engine.ops_ref_moe import moe_experts, moe_route, sigmoid

RNG = np.random.default_rng(0)


def _w(*shape, scale=0.3):
    return (RNG.standard_normal(shape) * scale).astype(np.float32)


def _loop(h, ids, wts, g, u, d, shared=None):
    out = np.zeros((h.shape[0], d.shape[1]), np.float32)
    for t in range(h.shape[0]):
        for j in range(ids.shape[1]):
            e = ids[t, j]
            a = h[t] @ g[e].T
            out[t] += wts[t, j] * ((a / (1 + np.exp(-a)) * (h[t] @ u[e].T)) @ d[e].T)
        if shared is not None:
            sg, su, sd, gi = shared
            a = h[t] @ sg.T
            out[t] += (1 / (1 + np.exp(-(h[t] @ gi)))) * ((a / (1 + np.exp(-a)) * (h[t] @ su.T)) @ sd.T)
    return out


@pytest.mark.parametrize("normalize", [True, False])
def test_route_and_experts_equal_a_per_token_loop(normalize):
    t, hdim, e, k, i = 9, 24, 6, 2, 8
    h, router = _w(t, hdim, scale=1.0), _w(e, hdim)
    ids, wts = moe_route(h, router, k, normalize)
    logits = h @ router.T
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    for row in range(t):
        order = sorted(range(e), key=lambda x: -p[row, x])[:k]
        assert list(ids[row]) == order
        want = p[row, order] / (p[row, order].sum() if normalize else 1.0)
        np.testing.assert_allclose(wts[row], want, rtol=1e-6)
    g, u, d = _w(e, i, hdim), _w(e, i, hdim), _w(e, hdim, i)
    shared = (_w(5, hdim), _w(5, hdim), _w(hdim, 5), _w(hdim))
    res = _w(t, hdim)
    np.testing.assert_allclose(moe_experts(h, ids, wts, g, u, d), _loop(h, ids, wts, g, u, d), rtol=1e-5, atol=1e-6)
    got = moe_experts(h, ids, wts, g, u, d, shared, residual=res)
    np.testing.assert_allclose(got, _loop(h, ids, wts, g, u, d, shared) + res, rtol=1e-5, atol=1e-6)


def test_router_ties_go_to_the_lower_expert_id():
    ids, wts = moe_route(np.ones((1, 4), np.float32), np.zeros((5, 4), np.float32), 3, False)
    assert ids.tolist() == [[0, 1, 2]] and np.allclose(wts, 0.2)
    assert ids.dtype == np.int32 and wts.dtype == np.float32
    with pytest.raises(ValueError, match="top_k 6 is outside 1..5"):
        moe_route(np.ones((1, 4), np.float32), np.zeros((5, 4), np.float32), 6, False)
    assert np.isfinite(sigmoid(np.array([-1e4, 1e4], np.float32))).all()


def _block_vs_ours(block, cfg, shared: bool):
    import torch

    torch.manual_seed(1)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.3)
    h = torch.randn(1, 7, cfg.hidden_size)
    with torch.no_grad():
        theirs = block(h)[0].numpy()
    i = cfg.moe_intermediate_size
    gate_up = block.experts.gate_up_proj.detach().numpy()  # [E, 2I, H]: gate rows, then up rows
    ids, wts = moe_route(h[0].numpy(), block.gate.weight.detach().numpy(), cfg.num_experts_per_tok, cfg.norm_topk_prob)
    sh = None
    if shared:
        se = block.shared_expert
        sh = tuple(
            w.detach().numpy()
            for w in (se.gate_proj.weight, se.up_proj.weight, se.down_proj.weight, block.shared_expert_gate.weight)
        )
    ours = moe_experts(h[0].numpy(), ids, wts, gate_up[:, :i], gate_up[:, i:], block.experts.down_proj.detach().numpy(), sh)
    err = np.abs(ours - theirs).max() / np.abs(theirs).max()
    assert err < 1e-5, err


@pytest.mark.parametrize("norm", [True, False])
def test_matches_transformers_qwen3_moe_block(norm):
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cfg = transformers.Qwen3MoeConfig(hidden_size=32, moe_intermediate_size=16, num_experts=6, num_experts_per_tok=2, norm_topk_prob=norm)
    _block_vs_ours(Qwen3MoeSparseMoeBlock(cfg).eval(), cfg, shared=False)


def test_shared_expert_matches_transformers_qwen3_next_block():
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextSparseMoeBlock

    cfg = transformers.Qwen3NextConfig(
        hidden_size=32, moe_intermediate_size=16, shared_expert_intermediate_size=24, num_experts=6,
        num_experts_per_tok=3, norm_topk_prob=True,
    )
    _block_vs_ours(Qwen3NextSparseMoeBlock(cfg).eval(), cfg, shared=True)
