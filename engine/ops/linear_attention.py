"""The hybrid families' ops (Qwen3.5 / Qwen3-Next): the Gated DeltaNet layer's causal_conv1d and
gated_delta_rule (both keep recurrent state per sequence), its gated_rmsnorm, Qwen3-Next's
unpack_qkvz_ba, and the gated full attention's split_heads and sigmoid_mul. Each is an OpDef plus its numpy reference over
``engine.ops_ref_linear``. Must not import CUDA.

Dims the ops read (models/qwen3_5.yaml): ``lin_k_heads``, ``lin_v_heads``, ``lin_k_dim``,
``lin_v_dim``, ``lin_conv_kernel``, ``lin_conv_dim``, ``v_heads_tiled`` (llama.cpp's converter
stores the v heads tiled, HF grouped by k head), ``rms_eps`` and the attention ``head_dim``.
"""

from __future__ import annotations

import numpy as np

from engine import ops_ref_linear as L
from engine.ops.base import OpDef, RefStep, define


def _dims(s: RefStep) -> dict:
    return s.runner.model.dims


def _snapshot_points(s: RefStep, n: int) -> list[tuple[int, int]]:
    """(tokens, slot) snapshot requests inside this item, sorted, each within 1..n."""
    return sorted((p, slot) for p, slot in s.snapshots if 0 < p <= n)


def _conv(s: RefStep, o, layer) -> None:
    d = _dims(s)
    x = s.env[o.inputs[0]]
    w = s.weight(o.weights[0], layer).reshape(int(d["lin_conv_dim"]), int(d["lin_conv_kernel"]))
    live = s.state(o, layer)
    out, new = L.causal_conv1d(x, w, live)
    if s.snapshots:
        xs = np.concatenate([live.T, np.asarray(x, np.float32)], axis=0)
        for p, slot in _snapshot_points(s, len(x)):
            s.save_snapshot(o, layer, slot, L.conv_state_at(xs, p, w.shape[1]))
    live[...] = new
    s.env[o.outputs[0]] = out


def _delta(s: RefStep, o, layer) -> None:
    d = _dims(s)
    qkv, b, a = (s.env[n] for n in o.inputs)
    A, dt_bias = (s.weight(w, layer) for w in o.weights)
    kh, vh, kd, vd = (int(d[k]) for k in ("lin_k_heads", "lin_v_heads", "lin_k_dim", "lin_v_dim"))
    q, k, v = L.split_qkv(qkv, k_heads=kh, v_heads=vh, k_dim=kd, v_dim=vd, v_tiled=bool(d["v_heads_tiled"]))
    g, beta = L.delta_gates(a, b, A, dt_bias)
    live = s.state(o, layer)
    n = len(qkv)
    # Run the sequence in segments that end at the snapshot points, so that each snapshot (and
    # the state a later item restores from it) is the exact float32 state at that position.
    bounds = [p for p, _ in _snapshot_points(s, n)]
    cuts = sorted(set([0, *bounds, n]))
    out = np.empty((n, vh, vd), dtype=np.float64)
    state = live
    for lo, hi in zip(cuts, cuts[1:], strict=False):
        rule = L.delta_rule_recurrent if hi - lo == 1 else L.delta_rule_chunked
        out[lo:hi], s64 = rule(q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi], state)
        state = s64.astype(np.float32)
        for p, slot in _snapshot_points(s, n):
            if p == hi:
                s.save_snapshot(o, layer, slot, state)
    live[...] = state
    s.env[o.outputs[0]] = out.reshape(n, vh * vd).astype(np.float32)


def _unpack_qkvz_ba(s: RefStep, o, layer) -> None:
    d = _dims(s)
    qkvz, ba = (s.env[n] for n in o.inputs)
    kh, vh, kd, vd = (int(d[k]) for k in ("lin_k_heads", "lin_v_heads", "lin_k_dim", "lin_v_dim"))
    outs = L.unpack_qkvz_ba(qkvz, ba, k_heads=kh, v_heads=vh, k_dim=kd, v_dim=vd)
    for name, arr in zip(o.outputs, outs, strict=True):
        s.env[name] = arr


def _gated_rmsnorm(s: RefStep, o, layer) -> None:
    d = _dims(s)
    x, z = (s.env[n] for n in o.inputs)
    s.env[o.outputs[0]] = L.gated_rmsnorm(x, z, s.weight(o.weights[0], layer), s.runner.eps, int(d["lin_v_dim"]))


def _split_heads(s: RefStep, o, layer) -> None:
    parts = L.split_heads(s.env[o.inputs[0]], s.runner.head_dim, len(o.outputs))
    for name, part in zip(o.outputs, parts, strict=True):
        s.env[name] = part


def _sigmoid_mul(s: RefStep, o, layer) -> None:
    s.env[o.outputs[0]] = L.sigmoid_mul(s.env[o.inputs[0]], s.env[o.inputs[1]])


def _conv_state(d: dict) -> tuple[int, ...]:
    return (int(d["lin_conv_dim"]), int(d["lin_conv_kernel"]) - 1)


def _delta_state(d: dict) -> tuple[int, ...]:
    return (int(d["lin_v_heads"]), int(d["lin_k_dim"]), int(d["lin_v_dim"]))


define(
    "causal_conv1d",
    OpDef(
        1,
        1,
        (1, 1),
        state=_conv_state,
    ),
    _conv,
)
define(
    "gated_delta_rule",
    OpDef(
        3,
        1,
        (2, 2),
        state=_delta_state,
    ),
    _delta,
)
define("unpack_qkvz_ba", OpDef(2, 4, (0, 0)), _unpack_qkvz_ba)
define("gated_rmsnorm", OpDef(2, 1, (1, 1)), _gated_rmsnorm)
define("split_heads", OpDef(1, 2, (0, 0)), _split_heads)
define("sigmoid_mul", OpDef(2, 1, (0, 0)), _sigmoid_mul)
