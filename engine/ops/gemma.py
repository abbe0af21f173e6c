"""Ops the Gemma block adds to the dense vocabulary: ``gelu_tanh_mul`` (the GeGLU gate) and ``add``
(the residual sum after Gemma's post-attention and post-MLP norms). Each is an OpDef plus its numpy
reference over ``engine.ops_ref``. The Gemma norms ((1 + w)), embedding scale, q/k norms, per-layer
RoPE base and sliding window are attributes of the dense ops (engine.ops.dense). Must not import CUDA.
"""

from __future__ import annotations

from engine import ops_ref
from engine.ops.base import OpDef, RefStep, define


def _gelu_tanh_mul(s: RefStep, o, layer) -> None:
    s.env[o.outputs[0]] = ops_ref.gelu_tanh_mul(s.env[o.inputs[0]], s.env[o.inputs[1]])


def _add(s: RefStep, o, layer) -> None:
    s.env[o.outputs[0]] = s.env[o.inputs[0]] + s.env[o.inputs[1]]


define("gelu_tanh_mul", OpDef(2, 1, (0, 0)), _gelu_tanh_mul)
define("add", OpDef(2, 1, (0, 0)), _add)
