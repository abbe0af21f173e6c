"""Reference (numpy, float32) math of the mixture-of-experts ops: routing and the expert FFNs.

The oracle for the MoE kernels, beside ``engine.ops_ref`` (the dense ops). Activations are
``[tokens, hidden]`` float32; stacked expert weights are ``[experts, out, in]`` float32 (the layout
``engine.weights.StackedSource`` and GGUF ``*_exps`` tensors present). Pure functions, no state.

Must not import CUDA or any engine module other than ``engine.ops_ref`` and ``engine.types``.
"""

from __future__ import annotations

import numpy as np

from engine import ops_ref

F32 = np.float32


def sigmoid(x: np.ndarray) -> np.ndarray:
    """``1 / (1 + exp(-x))`` in float32, written with tanh so it never overflows."""
    x = np.asarray(x, dtype=F32)
    return F32(0.5) * (F32(1.0) + np.tanh(F32(0.5) * x))


def moe_route(
    h: np.ndarray, w_router: np.ndarray, top_k: int, normalize: bool
) -> tuple[np.ndarray, np.ndarray]:
    """Top-k softmax routing (Qwen2/3-MoE, Qwen3-Next, Qwen3.5-MoE, Mixtral-style).

    ``logits = h @ w_router.T`` [T, E]; ``p = softmax(logits)`` over all E experts; the k largest
    ``p`` per token, in descending order (equal probabilities: the lower expert id first);
    ``normalize`` divides the k weights by their sum (HF ``norm_topk_prob``). Returns
    ``ids`` [T, k] int32 and ``weights`` [T, k] float32.
    """
    logits = np.asarray(h, dtype=F32) @ np.asarray(w_router, dtype=F32).T
    if not 0 < top_k <= logits.shape[1]:
        raise ValueError(f"moe_route: top_k {top_k} is outside 1..{logits.shape[1]} experts")
    p = np.exp(logits - logits.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    ids = np.argsort(-p, axis=-1, kind="stable")[:, :top_k]
    weights = np.take_along_axis(p, ids, axis=-1)
    if normalize:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    return ids.astype(np.int32), weights.astype(F32)


def swiglu_ffn(x: np.ndarray, w_gate: np.ndarray, w_up: np.ndarray, w_down: np.ndarray) -> np.ndarray:
    """``down(silu(x @ gate.T) * (x @ up.T))``: one expert (or the shared expert) on rows ``x``."""
    return ops_ref.linear(ops_ref.silu_mul(ops_ref.linear(x, w_gate), ops_ref.linear(x, w_up)), w_down)


def moe_experts(
    h: np.ndarray,
    ids: np.ndarray,
    weights: np.ndarray,
    gate_exps: np.ndarray,
    up_exps: np.ndarray,
    down_exps: np.ndarray,
    shared: tuple[np.ndarray, ...] | None = None,
    residual: np.ndarray | None = None,
) -> np.ndarray:
    """The routed experts' weighted sum, plus an optional gated shared expert and a residual.

    ``out[t] = sum_j weights[t, j] * swiglu_ffn(h[t], experts ids[t, j])``
    ``      (+ sigmoid(h[t] . shared_gate_inp) * swiglu_ffn(h[t], shared gate/up/down))``
    ``      (+ residual[t])``.
    ``gate_exps``/``up_exps`` are [E, I, H], ``down_exps`` [E, H, I]; ``shared`` is
    ``(gate [Is, H], up [Is, H], down [H, Is], gate_inp [H] or [1, H] or None)`` (Qwen2-MoE,
    Qwen3-Next and Qwen3.5-MoE gate their shared expert with a sigmoid; None there means ungated).
    Tokens are grouped by expert, so each expert's weights are read once per call.
    """
    h = np.asarray(h, dtype=F32)
    out = np.zeros((h.shape[0], down_exps.shape[1]), dtype=F32)
    for e in np.unique(ids):
        rows, slot = np.nonzero(ids == e)
        y = swiglu_ffn(h[rows], gate_exps[e], up_exps[e], down_exps[e])
        np.add.at(out, rows, y * weights[rows, slot, None])
    if shared is not None:
        s_gate, s_up, s_down, s_gate_inp = shared
        y = swiglu_ffn(h, s_gate, s_up, s_down)
        if s_gate_inp is not None:
            y = y * sigmoid(h @ np.asarray(s_gate_inp, dtype=F32).reshape(-1))[:, None]
        out += y
    if residual is not None:
        out += residual
    return out.astype(F32, copy=False)


def shared_gate(h: np.ndarray, y: np.ndarray, gate_inp: np.ndarray, residual: np.ndarray | None = None) -> np.ndarray:
    """``sigmoid(h[t] . gate_inp) * y[t]`` (+ ``residual[t]``): a shared expert's output ``y`` (its
    SwiGLU run as plain linear / silu_mul ops) gated as ``moe_experts`` gates its ``shared`` term;
    ``gate_inp`` [H] or [1, H]."""
    h = np.asarray(h, dtype=F32)
    out = np.asarray(y, dtype=F32) * sigmoid(h @ np.asarray(gate_inp, dtype=F32).reshape(-1))[:, None]
    if residual is not None:
        out = out + np.asarray(residual, dtype=F32)
    return out.astype(F32, copy=False)
