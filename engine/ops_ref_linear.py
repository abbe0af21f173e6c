"""Reference (numpy) math of the hybrid families' linear-attention and gated-attention layers
(Qwen3.5 / Qwen3-Next: Gated DeltaNet beside gated full attention): the oracle for their kernels.

Activations are ``[tokens, features]`` float32 in token order. The recurrent state of one sequence
is passed in and returned (never kept here): the causal conv1d keeps the last ``K - 1`` inputs
``[channels, K - 1]`` (oldest first), the delta rule keeps ``S`` ``[v_heads, k_dim, v_dim]``.
Every function follows transformers' ``modeling_qwen3_5`` (torch_chunk_gated_delta_rule,
torch_recurrent_gated_delta_rule, causal_conv1d, l2norm, Qwen3_5RMSNormGated, the sigmoid gate of
Qwen3_5Attention) in float32 at the seams and float64 inside the delta rule.

Must not import CUDA or any engine module (kernel tests import it with and without a GPU).
"""

from __future__ import annotations

import numpy as np

F32 = np.float32


def sigmoid(x: np.ndarray) -> np.ndarray:
    """Overflow-free logistic function, in x's float type."""
    x = np.asarray(x)
    return 0.5 * (1.0 + np.tanh(0.5 * x))


def softplus(x: np.ndarray) -> np.ndarray:
    """``log(1 + exp(x))`` without overflow."""
    return np.logaddexp(0.0, x)


def l2norm(x: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """``x / sqrt(sum(x^2) + eps)`` over the last axis (the q/k norm of the delta rule, FLA's form)."""
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + eps)


def causal_conv1d(
    x: np.ndarray, w: np.ndarray, state: np.ndarray, *, silu: bool = True
) -> tuple[np.ndarray, np.ndarray]:
    """Depthwise causal convolution with state, then SiLU.

    ``x`` [T, C], ``w`` [C, K], ``state`` [C, K-1] (the K-1 inputs before x[0], oldest first; zeros
    for a new sequence). ``out[t, c] = sum_j w[c, j] * xs[t + j, c]`` over ``xs = state.T ++ x``.
    Returns (out [T, C] f32, new state [C, K-1]).
    """
    x = np.asarray(x, dtype=F32)
    t, c = x.shape
    k = w.shape[-1]
    w = np.asarray(w, dtype=F32).reshape(c, k)
    xs = np.concatenate([np.asarray(state, dtype=F32).T, x], axis=0)  # [K-1+T, C]
    out = np.zeros((t, c), dtype=F32)
    for j in range(k):
        out += xs[j : j + t] * w[:, j]
    if silu:
        out = (out * sigmoid(out)).astype(F32)
    return out, conv_state_at(xs, t, k)


def conv_state_at(xs: np.ndarray, n: int, k: int) -> np.ndarray:
    """The conv state after the first ``n`` new tokens, from ``xs = old_state.T ++ x`` [K-1+T, C]."""
    return np.ascontiguousarray(xs[n : n + k - 1].T, dtype=F32)


def delta_gates(a: np.ndarray, b: np.ndarray, A: np.ndarray, dt_bias: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The delta rule's per-token, per-v-head gates from the a/b projections [T, v_heads].

    ``g = A * softplus(a + dt_bias)`` (log decay, <= 0; ``A = -exp(A_log)``) and ``beta = sigmoid(b)``.
    """
    g = np.asarray(A, np.float64) * softplus(np.asarray(a, np.float64) + np.asarray(dt_bias, np.float64))
    beta = sigmoid(np.asarray(b, np.float64))
    return g, beta


def split_qkv(
    qkv: np.ndarray, *, k_heads: int, v_heads: int, k_dim: int, v_dim: int, v_tiled: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Split the conv output [T, 2*k_heads*k_dim + v_heads*v_dim] into per-v-head q, k, v.

    Returns q, k [T, v_heads, k_dim] (each k head repeated for its v heads) and v [T, v_heads, v_dim],
    float64. V head ``h`` reads k head ``h // (v_heads / k_heads)`` in HF's grouped order and
    ``h % k_heads`` in the tiled order llama.cpp's converter writes (``v_tiled``).
    """
    t = qkv.shape[0]
    kd = k_heads * k_dim
    q = qkv[:, :kd].reshape(t, k_heads, k_dim).astype(np.float64)
    k = qkv[:, kd : 2 * kd].reshape(t, k_heads, k_dim).astype(np.float64)
    v = qkv[:, 2 * kd :].reshape(t, v_heads, v_dim).astype(np.float64)
    heads = v_head_to_k_head(k_heads, v_heads, v_tiled)
    return q[:, heads], k[:, heads], v


def unpack_qkvz_ba(
    qkvz: np.ndarray, ba: np.ndarray, *, k_heads: int, v_heads: int, k_dim: int, v_dim: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Qwen3-Next's fused projections -> Qwen3.5's layout.

    ``qkvz`` [T, k_heads * (2 k_dim + 2 r v_dim)] holds per k head ``[q | k | v (r heads) | z (r heads)]``
    and ``ba`` [T, k_heads * 2r] per k head ``[b (r) | a (r)]`` (r = v_heads / k_heads). Returns
    qkv [T, 2 k_heads k_dim + v_heads v_dim] = [all q | all k | all v], z [T, v_heads v_dim],
    b and a [T, v_heads] (transformers' ``fix_query_key_value_ordering``).
    """
    t = qkvz.shape[0]
    r = v_heads // k_heads
    g = np.asarray(qkvz, F32).reshape(t, k_heads, 2 * k_dim + 2 * r * v_dim)
    q, k = g[..., :k_dim], g[..., k_dim : 2 * k_dim]
    v, z = g[..., 2 * k_dim : 2 * k_dim + r * v_dim], g[..., 2 * k_dim + r * v_dim :]
    qkv = np.concatenate([x.reshape(t, -1) for x in (q, k, v)], axis=1)
    bag = np.asarray(ba, F32).reshape(t, k_heads, 2 * r)
    return (
        np.ascontiguousarray(qkv),
        np.ascontiguousarray(z.reshape(t, -1)),
        np.ascontiguousarray(bag[..., :r].reshape(t, v_heads)),
        np.ascontiguousarray(bag[..., r:].reshape(t, v_heads)),
    )


def v_head_to_k_head(k_heads: int, v_heads: int, v_tiled: bool) -> np.ndarray:
    """Index of the k head each v head reads (grouped: h // ratio; tiled: h % k_heads)."""
    if v_heads % k_heads:
        raise ValueError(f"v_heads {v_heads} is not a multiple of k_heads {k_heads}")
    h = np.arange(v_heads)
    return h % k_heads if v_tiled else h // (v_heads // k_heads)


def delta_rule_recurrent(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray, state: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The gated delta rule one token at a time (the decode form).

    q, k [T, H, dk] (L2-normalised here, q scaled by dk^-0.5), v [T, H, dv], g / beta [T, H],
    state S [H, dk, dv]. Per token: ``S *= exp(g)``; ``S += k (beta (v - S^T k))^T``; ``o = S^T q``.
    Returns (o [T, H, dv] float64, S float64).
    """
    q = l2norm(q) * q.shape[-1] ** -0.5
    k = l2norm(k)
    s = np.array(state, dtype=np.float64)
    out = np.empty(v.shape, dtype=np.float64)
    for t in range(q.shape[0]):
        s *= np.exp(g[t])[:, None, None]
        mem = np.einsum("hkv,hk->hv", s, k[t])
        delta = (v[t] - mem) * beta[t][:, None]
        s += k[t][:, :, None] * delta[:, None, :]
        out[t] = np.einsum("hkv,hk->hv", s, q[t])
    return out, s


def delta_rule_chunked(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    g: np.ndarray,
    beta: np.ndarray,
    state: np.ndarray,
    chunk: int = 64,
) -> tuple[np.ndarray, np.ndarray]:
    """The same rule over chunks of ``chunk`` tokens (the prefill form, as a kernel would tile it).

    Within a chunk the delta-rule updates are condensed by the UT transform: with ``c`` the
    cumulative log decay, ``A[i, j] = beta_i (k_i . k_j) exp(c_i - c_j)`` for j < i, the unit lower
    triangular ``T = I + A`` gives ``U = T^-1 (beta v)`` and ``W = T^-1 (beta exp(c) k)``; then
    ``v' = U - W S``, ``o = (q exp(c)) S + (q k^T * decay, causal) v'`` and
    ``S' = exp(c_last) S + (k exp(c_last - c))^T v'``. Same arguments and result as
    ``delta_rule_recurrent`` up to rounding.
    """
    q = l2norm(q) * q.shape[-1] ** -0.5
    k = l2norm(k)
    s = np.array(state, dtype=np.float64)
    n = q.shape[0]
    out = np.empty(v.shape, dtype=np.float64)
    for lo in range(0, n, chunk):
        hi = min(n, lo + chunk)
        # [H, C, d] per head
        qc, kc, vc = (x[lo:hi].transpose(1, 0, 2) for x in (q, k, v))
        bc = beta[lo:hi].T  # [H, C]
        cum = np.cumsum(g[lo:hi].T, axis=1)  # [H, C]
        c = hi - lo
        diff = cum[:, :, None] - cum[:, None, :]  # c_i - c_j
        causal = np.tril(np.ones((c, c), dtype=bool))
        decay = np.where(causal, np.exp(np.where(causal, diff, 0.0)), 0.0)
        strict = np.tril(np.ones((c, c), dtype=bool), -1)
        a = np.where(strict, (bc[:, :, None] * (kc @ kc.transpose(0, 2, 1))) * decay, 0.0)
        t_mat = a + np.eye(c)
        u = np.linalg.solve(t_mat, bc[:, :, None] * vc)
        w = np.linalg.solve(t_mat, (bc * np.exp(cum))[:, :, None] * kc)
        v_new = u - w @ s
        attn = (qc @ kc.transpose(0, 2, 1)) * decay
        o = (qc * np.exp(cum)[:, :, None]) @ s + attn @ v_new
        out[lo:hi] = o.transpose(1, 0, 2)
        last = cum[:, -1]
        k_dec = kc * np.exp(last[:, None] - cum)[:, :, None]
        s = s * np.exp(last)[:, None, None] + k_dec.transpose(0, 2, 1) @ v_new
    return out, s


def delta_rule_varlen(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    g: np.ndarray,
    beta: np.ndarray,
    states: np.ndarray,
    seq_starts: np.ndarray,
    state_in: np.ndarray,
    state_out: np.ndarray,
    state_snap: np.ndarray,
    chunk: int = 64,
    positions: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """The delta-rule kernels' whole contract (gated_delta_rule / gated_delta_chunk) in the chunked form.

    q, k, v, g, beta as ``delta_rule_recurrent`` over the tokens of every sequence; ``states``
    [slots, H, dk, dv]. Sequence s owns tokens seq_starts[s] .. seq_starts[s+1]-1, starts from slot
    state_in[s] (-1: zeros) and ends in slot state_out[s]; a token t with state_snap[t] >= 0 also
    stores the state after it in that slot. Each sequence is cut into chunks that end at the
    absolute positions that are multiples of ``chunk`` (``positions`` [T]: each token's; None:
    each sequence starts at 0) and after every snapshot token (as gated_delta_chunk cuts them), so
    each snapshot is an exact chunk-boundary state. Returns (out [T, H, dv], new states), float64.
    """
    states = np.array(states, dtype=np.float64)
    out = np.empty(v.shape, dtype=np.float64)
    snap = np.asarray(state_snap)
    for s in range(len(seq_starts) - 1):
        lo, hi = int(seq_starts[s]), int(seq_starts[s + 1])
        cur = states[state_in[s]].copy() if state_in[s] >= 0 else np.zeros(states.shape[1:])
        t = lo
        p0 = (int(positions[lo]) if positions is not None and hi > lo else 0) - lo  # token t at p0 + t
        while t < hi:
            end = min(hi, t + chunk - (p0 + t) % chunk)
            marks = np.nonzero(snap[t:end] >= 0)[0]
            end = t + int(marks[0]) + 1 if len(marks) else end
            out[t:end], cur = delta_rule_chunked(q[t:end], k[t:end], v[t:end], g[t:end], beta[t:end], cur, chunk)
            if snap[end - 1] >= 0:
                states[snap[end - 1]] = cur
            t = end
        states[state_out[s]] = cur
    return out, states


def gated_rmsnorm(x: np.ndarray, gate: np.ndarray, w: np.ndarray, eps: float, head_dim: int) -> np.ndarray:
    """Qwen3_5RMSNormGated per ``head_dim`` slice: ``x / sqrt(mean(x^2) + eps) * w * silu(gate)``.

    x, gate [T, n * head_dim], w [head_dim] -> [T, n * head_dim] f32.
    """
    t, width = x.shape
    xs = np.asarray(x, F32).reshape(t, width // head_dim, head_dim)
    ms = np.mean(np.square(xs), axis=-1, keepdims=True, dtype=F32)
    y = (xs * (F32(1.0) / np.sqrt(ms + F32(eps)))).astype(F32) * np.asarray(w, F32)
    z = np.asarray(gate, F32).reshape(y.shape)
    return (y * (z * sigmoid(z))).astype(F32).reshape(t, width)


def split_heads(x: np.ndarray, head_dim: int, parts: int) -> list[np.ndarray]:
    """Split each head's ``parts * head_dim`` slice into ``parts`` tensors [T, heads * head_dim].

    Qwen3.5's q_proj rows hold, per head, the query then its output gate: [q_h | gate_h].
    """
    t, width = x.shape
    heads = width // (parts * head_dim)
    xs = np.asarray(x, F32).reshape(t, heads, parts, head_dim)
    return [np.ascontiguousarray(xs[:, :, i].reshape(t, heads * head_dim)) for i in range(parts)]


def sigmoid_mul(x: np.ndarray, gate: np.ndarray) -> np.ndarray:
    """``x * sigmoid(gate)``: the gated attention output (same shapes)."""
    return (np.asarray(x, F32) * sigmoid(np.asarray(gate, F32))).astype(F32)
