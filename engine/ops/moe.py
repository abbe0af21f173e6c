"""Mixture-of-experts ops: ``moe_router`` (top-k softmax routing) and ``moe_experts`` (the routed
SwiGLU experts over stacked weights, with an optional sigmoid-gated shared expert) and
``shared_gate`` (a shared expert's sigmoid gate: the families whose graph runs the shared SwiGLU as
plain linear / silu_mul ops), each an OpDef plus its numpy reference over ``engine.ops_ref_moe``.
Must not import CUDA.

The two ops are split where a GPU splits them: the router writes fixed-size ``[tokens, top_k]``
expert ids and weights (device-side, no host synchronisation), the experts op reads them. Qwen3-MoE
uses router + experts; Qwen2-MoE, Qwen3-Next and Qwen3.5-MoE add the shared expert (seven weights).
"""

from __future__ import annotations

from engine import ops_ref_moe
from engine.ops.base import OpDef, RefStep, define
from engine.types import ConfigError


def _dim(s: RefStep, o, attr: str, default=None):
    if attr not in o.attrs and default is None:
        raise ConfigError(f"op {o.op} needs the attribute {attr!r} (a dim name)")
    return s.attr_dim(o, attr, default)


def _moe_router(s: RefStep, o, layer) -> None:
    ids, weights = ops_ref_moe.moe_route(
        s.env[o.inputs[0]],
        s.weight(o.weights[0], layer),
        int(_dim(s, o, "top_k")),
        bool(_dim(s, o, "normalize", False)),
    )
    s.env[o.outputs[0]], s.env[o.outputs[1]] = ids, weights


def _moe_experts(s: RefStep, o, layer) -> None:
    h, ids, weights = (s.env[n] for n in o.inputs)
    w = [s.weight(n, layer) for n in o.weights]
    shared = tuple(w[3:7]) if len(w) == 7 else None
    res = s.env[o.attrs["residual"]] if "residual" in o.attrs else None
    s.env[o.outputs[0]] = ops_ref_moe.moe_experts(h, ids, weights, w[0], w[1], w[2], shared, res)


def _shared_gate(s: RefStep, o, layer) -> None:
    h, y = (s.env[n] for n in o.inputs)
    res = s.env[o.attrs["residual"]] if "residual" in o.attrs else None
    s.env[o.outputs[0]] = ops_ref_moe.shared_gate(h, y, s.weight(o.weights[0], layer), res)


define(
    "moe_router",
    OpDef(
        1,
        2,
        (1, 1),
        {"top_k": "dim", "normalize": "dim"},
    ),
    _moe_router,
)
define(
    "moe_experts",
    OpDef(
        3,
        1,
        (3, 7),
        {"residual": "value"},
        weight_counts=(3, 7),
    ),
    _moe_experts,
)
define(
    "shared_gate",
    OpDef(2, 1, (1, 1), {"residual": "value"}),
    _shared_gate,
)
