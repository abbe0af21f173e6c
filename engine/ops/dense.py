"""The dense decoder's ops (Llama, Qwen3, Gemma): embed, rmsnorm, head_rmsnorm, linear, rope,
attention, silu_mul, concat — each an OpDef plus its numpy reference over ``engine.ops_ref``
(what each computes: docs/dsl.md's op table).

Optional attributes name dims (``kind "dim"``; layers that differ run their own op, gated by ``when``):
embed ``scale``, the norms' weight ``offset``, rope ``theta``/``scaling``, attention
``window``/``scale``. Without them each op computes what it did for Llama. Must not import CUDA."""

from __future__ import annotations

import numpy as np

from engine import ops_ref
from engine.ops.base import MODEL_SCALING, OpDef, RefStep, define


def _embed(s: RefStep, o, layer) -> None:
    out = ops_ref.embed(s.env[o.inputs[0]], s.weight(o.weights[0], layer))
    scale = s.attr_dim(o, "scale")
    if scale is not None:  # float32 multiplier, as transformers' Gemma embed_scale in an f32 model
        out = out * np.float32(scale)
    s.env[o.outputs[0]] = out


def _norm_weight(s: RefStep, o, layer) -> np.ndarray:
    w = s.weight(o.weights[0], layer)
    offset = s.attr_dim(o, "offset")
    return w if not offset else np.float32(offset) + w  # Gemma: x_hat * (1 + w), formed in f32


def _rmsnorm(s: RefStep, o, layer) -> None:
    s.env[o.outputs[0]] = ops_ref.rmsnorm(s.env[o.inputs[0]], _norm_weight(s, o, layer), s.runner.eps)


def _head_rmsnorm(s: RefStep, o, layer) -> None:
    r = s.runner
    s.env[o.outputs[0]] = ops_ref.head_rmsnorm(s.env[o.inputs[0]], _norm_weight(s, o, layer), r.eps, r.head_dim)


def _linear(s: RefStep, o, layer) -> None:
    x = s.env[o.inputs[0]]
    res = s.env[o.attrs["residual"]] if "residual" in o.attrs else None
    if not s.all_logits and o.outputs == ("logits",):
        x = x[-1:]
        res = res[-1:] if res is not None else None
    for out_name, wn in zip(o.outputs, o.weights, strict=True):
        s.env[out_name] = ops_ref.linear(x, s.weight(wn, layer), res)


def _rope(s: RefStep, o, layer) -> None:
    r = s.runner
    # a `scaling` attribute's value is used even when it is None (this layer type has no scaling)
    scaling = s.attr_dim(o, "scaling") if "scaling" in o.attrs else MODEL_SCALING
    cos, sin = r.rope_tables(o.attrs.get("freq_factors"), s.attr_dim(o, "theta"), scaling)
    cos, sin = cos[s.positions], sin[s.positions]
    for src, dst in zip(o.inputs, o.outputs, strict=True):
        s.env[dst] = ops_ref.rope_apply(s.env[src], cos, sin, head_dim=r.head_dim, style=r.model.rope_style)


def _attention(s: RefStep, o, layer) -> None:
    r = s.runner
    q, k, v = (s.env[n] for n in o.inputs)
    window = s.attr_dim(o, "window")
    pool = window and s.window_table is not None  # the window layers' own KV pool (engine.kv_groups)
    s.env[o.outputs[0]] = ops_ref.attention(
        q,
        k,
        v,
        (s.k_window if pool else s.k_cache)[layer],
        (s.v_window if pool else s.v_cache)[layer],
        s.window_table if pool else s.block_table,
        s.start_pos,
        heads=r.heads,
        kv_heads=r.kv_heads,
        head_dim=r.head_dim,
        scale=s.attr_dim(o, "scale"),
        window=window,
    )


def _concat(s: RefStep, o, layer) -> None:
    s.env[o.outputs[0]] = np.concatenate([np.asarray(s.env[n], np.float32) for n in o.inputs], axis=-1)


def _silu_mul(s: RefStep, o, layer) -> None:
    s.env[o.outputs[0]] = ops_ref.silu_mul(s.env[o.inputs[0]], s.env[o.inputs[1]])


define("embed", OpDef(1, 1, (1, 1), {"scale": "dim"}), _embed)
define("rmsnorm", OpDef(1, 1, (1, 1), {"offset": "dim"}), _rmsnorm)
define("head_rmsnorm", OpDef(1, 1, (1, 1), {"offset": "dim"}), _head_rmsnorm)
define("linear", OpDef(1, None, (1, 8), {"residual": "value"}), _linear)
define("rope", OpDef(2, 2, (0, 0), {"freq_factors": "tensor", "theta": "dim", "scaling": "dim"}), _rope)
define("attention", OpDef(3, 1, (0, 0), {"window": "dim", "scale": "dim"}), _attention)
define("silu_mul", OpDef(2, 1, (0, 0)), _silu_mul)
define("concat", OpDef(2, 1, (0, 0)), _concat)
