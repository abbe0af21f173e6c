"""KernelSpec builders for the hybrid families' kernels (Qwen3.5 / Qwen3-Next), with each kernel's
launch contract.

``conv1d_kernel``: kernels/causal_conv1d.cu.j2, the depthwise causal conv with state + SiLU.
``delta_rule_kernel``: kernels/gated_delta_rule.cu.j2, the gated delta rule (L2-normalised q/k, the
gates from a/b, the state update and the output) one token at a time per (sequence, v head): the
recurrent form, used for decode and (as a sequential loop over each sequence's tokens) for prefill.
``delta_chunk_kernel``: kernels/gated_delta_chunk.cu.j2, the same rule and arguments in the chunked
(WY / UT-transform) form for prefill: chunks of up to ``chunk`` tokens, the snapshots inside a
chunk computed there (mma form) or ending it (FMA form). The lowering picks the prefill form (``DELTA_PREFILL_FORMS``; engine.lowering.linear_attention).
``gated_rmsnorm_kernel`` (per-head RMSNorm times silu(z)), ``split_heads_kernel`` (the gated
attention's [q_h | gate_h] rows into q and gate), ``sigmoid_mul_kernel`` (the attention output gate)
and ``unpack_kernel`` (Qwen3-Next's fused projections into Qwen3.5's layout).

The two stateful kernels read and write per-slot f32 state ``[slots, ...]`` addressed by the step
inputs ``state_in`` (per sequence: the slot the state starts from, -1 for zeros), ``state_out``
(per sequence: its live slot) and ``state_snap`` (per token: -1, or a slot that also receives the
state after that token: a prefix-cache snapshot), so decode stays inside the replayed CUDA graph.
``varlen`` (prefill): sequence s owns tokens seq_starts[s] .. seq_starts[s+1]-1; otherwise (decode)
sequence s is token s. Each builder returns a ``HybridKernel`` (spec, args, grid(rows), block), the
shape of ``engine.kernel_catalog.KernelChoice``. Must not import CUDA.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from engine.kernel_spec import KernelSpec, entry_name
from engine.types import ConfigError

KERNELS = {
    "causal_conv1d": "depthwise causal conv1d with per-slot state, then SiLU (decode step or a prefill chunk)",
    "gated_delta_rule": "the gated delta rule per (sequence, v head), token by token, with per-slot f32 state",
    "gated_delta_chunk": "the gated delta rule per (sequence, v head), in chunks (WY form, prefill), same arguments",
    "gated_rmsnorm": "per-head RMSNorm of x times w times silu(z)",
    "split_heads": "per head [a_h | b_h] rows split into a and b",
    "sigmoid_mul": "out = x * sigmoid(gate)",
    "unpack_qkvz_ba": "Qwen3-Next's per-k-head fused qkvz / ba projections into qkv, z, b, a",
}
# gated_delta_rule threads per block: decode spreads each 32-column slice's k rows over 8 warps (16
# state rows per thread: many loads in flight for a step that reads and writes the state once);
# prefill over 4 warps (32 rows per thread): a token's work is issued by the SM's four schedulers
# instead of one warp's, at the cost of the barriers of the two k reductions per token
DELTA_DECODE_THREADS = 256
DELTA_PREFILL_THREADS = 128
# the prefill form of gated_delta_rule: "recurrent" (token by token) or "chunked" (gated_delta_chunk,
# where its head shape fits: delta_chunk_fits). Chunked by default: its prefill is faster
# (docs/PERFORMANCE.md), its output the bf16-rounded exact one as the recurrent kernel's
# (tests/test_delta_chunk.py); its chunks end at absolute positions that are multiples of the chunk,
# so a prefix hit resumed at a block boundary computes the cold run's bits (state_align,
# tests/test_delta_chunk_warm.py)
DELTA_PREFILL_FORMS = ("recurrent", "chunked")
DELTA_PREFILL_DEFAULT = "chunked"
DELTA_CHUNKS = (64, 32, 16)  # tokens per chunk gated_delta_chunk takes: the longest that fits
DELTA_CHUNK_SMEM = 99 * 1024  # its shared memory bound on every profile (sm_86 / sm_89 / sm_120: 99 KB)
DELTA_CHUNK_THREADS = 256
STATE_ARGS = (("state", "ptr"), ("state_in", "ptr"), ("state_out", "ptr"), ("state_snap", "ptr"), ("seq_starts", "ptr"))
# the arguments of both delta-rule kernels (gated_delta_rule and gated_delta_chunk take the same)
DELTA_ARGS = (("out", "ptr"), ("qkv", "ptr"), ("b", "ptr"), ("a", "ptr"), ("A", "ptr"), ("dt_bias", "ptr"),
              *STATE_ARGS, ("rows", "i32"))
# gated_delta_rule's fused forms add, before rows: the conv (``conv``: its weight, state, per-(row,
# k head) counter), then the gated norm (``norm``: its output, z, weight, per-(row, v head) counter)
CONV_ARGS = (("cw", "ptr"), ("cstate", "ptr"), ("ccnt", "ptr"))
NORM_ARGS = (("nout", "ptr"), ("z", "ptr"), ("nw", "ptr"), ("cnt", "ptr"))
DELTA_NORM_ARGS = (*DELTA_ARGS[:-1], *NORM_ARGS, DELTA_ARGS[-1])
# gated_delta_chunk also reads each token's position (its chunks end at multiples of the chunk)
CHUNK_ARGS = (*DELTA_ARGS[:-1], ("positions", "ptr"), ("rows", "i32"))


def _check_qkv_stride(kernel: str, qkv_stride: int, k_heads: int, k_dim: int, v_heads: int, v_dim: int) -> None:
    if qkv_stride < 2 * k_heads * k_dim + v_heads * v_dim:
        raise ConfigError(f"{kernel}: qkv stride {qkv_stride} is narrower than q|k|v")


@dataclass(frozen=True)
class HybridKernel:
    """A spec plus how to launch it (``grid(rows)`` -> 3-tuple; rows = tokens, or sequences for
    the stateful kernels)."""

    spec: KernelSpec
    args: tuple[tuple[str, str], ...]
    grid: Callable[..., tuple[int, int, int]]
    block: tuple[int, int, int]
    smem: int = 0


def _threads_ok(t: int) -> bool:
    return t in (32, 64, 128, 256, 512, 1024)


def delta_prefill_form(choice: str = "") -> str:
    """The gated delta rule's prefill form: ``choice`` (build_plan's delta_prefill, a test's or a
    bench's comparison) if given, else DELTA_PREFILL_DEFAULT; ConfigError if it is not one of
    DELTA_PREFILL_FORMS."""
    form = (choice or DELTA_PREFILL_DEFAULT).strip().lower()
    if form not in DELTA_PREFILL_FORMS:
        raise ConfigError(f"delta_prefill={form!r}: expected one of {', '.join(DELTA_PREFILL_FORMS)}")
    return form


def state_align(launches: Iterable[Any]) -> int:
    """The token grid a hybrid's prefill passes must be cut on for warm == cold bits: the least
    common multiple of the chunks of the ``gated_delta_chunk`` launches among ``launches`` (1 when
    there are none: the recurrent form and the conv are token by token). A pass that does not end
    its item must end at an absolute position on this grid (engine.scheduler, the runner's
    passes), as must every prefix-cache snapshot (the block size is a multiple of it)."""
    align = 1
    for la in launches:
        if la.spec.template == "gated_delta_chunk":
            align = math.lcm(align, int(la.spec.params["chunk"]))
    return align


def conv1d_kernel(
    channels: int, kernel: int, x_stride: int, out_stride: int, varlen: bool, threads: int = 128, chunks: int = 0
) -> HybridKernel:
    """causal_conv1d over ``channels`` channels, ``kernel`` taps (state: kernel - 1 inputs);
    ``threads`` per block, split into ``chunks`` token chunks of cpb = threads / chunks channels
    (0: 8 chunks in prefill, where one sequence's tokens are many, 1 in decode)."""
    chunks = chunks or (8 if varlen else 1)
    if not 2 <= kernel <= 8 or channels < 1 or x_stride < channels or out_stride < channels or not _threads_ok(threads):
        raise ConfigError(f"causal_conv1d: bad shape channels={channels} kernel={kernel} strides={x_stride},{out_stride} threads={threads}")
    if threads % chunks or (chunks > 1 and not varlen):
        raise ConfigError(f"causal_conv1d: {threads} threads do not split into {chunks} token chunks (varlen only)")
    cpb = threads // chunks
    params = {"channels": channels, "kernel": kernel, "x_stride": x_stride, "out_stride": out_stride,
              "varlen": bool(varlen), "cpb": cpb, "chunks": chunks, "unroll": 8 if varlen else 1}
    name = entry_name("causal_conv1d", c=channels, k=kernel, xs=x_stride, os=out_stride, vl=int(varlen), cpb=cpb, ch=chunks)
    args = (("out", "ptr"), ("x", "ptr"), ("w", "ptr"), *STATE_ARGS, ("rows", "i32"))
    return HybridKernel(
        KernelSpec("causal_conv1d", name, params, pdl=True),
        args,
        lambda rows, **_: (-(-channels // cpb), rows, 1),
        (threads, 1, 1),
    )


def delta_rule_kernel(
    k_heads: int,
    v_heads: int,
    k_dim: int,
    v_dim: int,
    qkv_stride: int,
    b_stride: int,
    a_stride: int,
    out_stride: int,
    v_tiled: bool,
    varlen: bool,
    max_threads: int = DELTA_DECODE_THREADS,
    norm: tuple[int, int, float] | None = None,
    conv: int = 0,
    trigger: bool = False,
) -> HybridKernel:
    """gated_delta_rule: one block per (sequence, v head, slice of ``v_block`` state columns) with
    v_block * ksplit threads, thread (j, s) holding column j's rows s * k_dim/ksplit .. in
    registers (the columns are independent: slicing them spreads a batch-1 step over more SMs).
    ``norm`` (z_stride, nout_stride, eps), decode only: the gated_rmsnorm after it fused in (the
    last block of each head applies it; args DELTA_NORM_ARGS, a zeroed int32 counter per (row, v head)).
    ``conv`` (its taps), decode only: the causal_conv1d before it fused in (three more args after
    seq_starts, CONV_ARGS: its weight, its state, a zeroed int32 counter per (row, k head)).
    ``trigger``: pdl_trigger() once the first loads are out (batch 1, decode_graph.early_trigger)."""
    if v_heads % k_heads or k_dim % 32 and k_dim not in (8, 16) or v_dim < 1 or v_dim > 1024:
        raise ConfigError(f"gated_delta_rule: bad head shape k_heads={k_heads} v_heads={v_heads} k_dim={k_dim} v_dim={v_dim}")
    v_block = 32 if v_dim % 32 == 0 else v_dim
    ksplit = 1
    while v_block * ksplit * 2 <= max_threads and k_dim % (ksplit * 2) == 0:
        ksplit *= 2
    threads = v_block * ksplit
    if threads % 32 or threads > 1024:
        raise ConfigError(f"gated_delta_rule: v_block {v_block} x ksplit {ksplit} = {threads} threads is not a whole number of warps up to 1024")
    _check_qkv_stride("gated_delta_rule", qkv_stride, k_heads, k_dim, v_heads, v_dim)
    params = {"k_heads": k_heads, "v_heads": v_heads, "k_dim": k_dim, "v_dim": v_dim, "v_block": v_block, "ksplit": ksplit,
              "qkv_stride": qkv_stride, "b_stride": b_stride, "a_stride": a_stride, "out_stride": out_stride,
              "v_tiled": bool(v_tiled), "varlen": bool(varlen), "norm": norm is not None, "conv": int(conv),
              "trigger": bool(trigger)}
    extra = {}
    if conv:
        if varlen or not 2 <= conv <= 8:
            raise ConfigError(f"gated_delta_rule: the fused conv is for decode, 2..8 taps (varlen {varlen}, taps {conv})")
        extra["cv"] = int(conv)
    if norm is not None:
        if varlen:
            raise ConfigError("gated_delta_rule: the fused gated norm is for decode (one token per sequence)")
        z_stride, nout_stride, eps = norm
        if z_stride < v_heads * v_dim or nout_stride < v_heads * v_dim:
            raise ConfigError(f"gated_delta_rule: norm strides z {z_stride}, out {nout_stride} narrower than {v_heads} x {v_dim}")
        params.update(z_stride=int(z_stride), nout_stride=int(nout_stride), eps=repr(float(eps)))
        extra.update(zs=int(z_stride), ns=int(nout_stride), eps=repr(float(eps)))
    if trigger:
        extra["tr"] = 1
    name = entry_name("gated_delta_rule", kh=k_heads, vh=v_heads, kd=k_dim, vd=v_dim, qs=qkv_stride,
                      bs=b_stride, as_=a_stride, os=out_stride, ti=int(v_tiled), vl=int(varlen), **extra)
    return HybridKernel(
        KernelSpec("gated_delta_rule", name, params, pdl=True),
        (*DELTA_ARGS[:-1], *(CONV_ARGS if conv else ()), *(NORM_ARGS if norm is not None else ()), DELTA_ARGS[-1]),
        lambda rows, **_: (rows, v_heads, v_dim // v_block),
        (threads, 1, 1),
    )


def delta_chunk_smem(chunk: int, k_dim: int, v_block: int, mma: bool = True) -> int:
    """gated_delta_chunk's dynamic shared memory in bytes (its layout: see the template): f32 A
    [chunk][chunk+1], v / X / V' (and with mma S^T q) [chunk][v_block], per-token gates and scales;
    with mma the raw bf16 q, k [chunk][k_dim+8], S^T in two bf16 terms [v_block][k_dim+8], V'^T, the
    update's and a snapshot's factor in two terms each [v_block][chunk+8], P in two terms
    [chunk][chunk+8];
    without, f32 P [chunk][chunk+1], q, k [chunk][k_dim+1] and S."""
    small = chunk * (chunk + 1) + 8 * chunk + DELTA_CHUNK_THREADS  # A and the per-token arrays
    if mma:
        f32 = small + 2 * chunk * v_block
        b16 = 2 * (k_dim + 8) * (chunk + v_block) + 2 * (chunk + 8) * (3 * v_block + chunk)
        return 4 * f32 + 2 * b16
    return 4 * (small + chunk * (chunk + 1) + 2 * chunk * (k_dim + 1) + chunk * v_block + k_dim * v_block)


def _chunk_shape(
    k_heads: int, v_heads: int, k_dim: int, v_dim: int, chunk: int, v_block: int, mma: bool, block: int = 0
) -> tuple[int, int]:
    """gated_delta_chunk's (chunk, v_block) for a head shape (0: the defaults, see
    delta_chunk_kernel; ``block``: the default chunk divides it); ConfigError if the kernel cannot
    take it."""
    t = DELTA_CHUNK_THREADS
    v_block = v_block or (32 if v_dim % 32 == 0 else v_dim)
    if v_heads % k_heads or k_heads < 1 or k_dim < 1 or v_dim < 1:
        raise ConfigError(f"gated_delta_chunk: bad head shape k_heads={k_heads} v_heads={v_heads} k_dim={k_dim} v_dim={v_dim}")
    if not chunk:
        fits = [c for c in DELTA_CHUNKS if delta_chunk_smem(c, k_dim, v_block, mma) <= DELTA_CHUNK_SMEM
                and not (block and block % c)]
        chunk = fits[0] if fits else DELTA_CHUNKS[-1]
    if chunk not in DELTA_CHUNKS:
        raise ConfigError(f"gated_delta_chunk: chunk must be 16, 32 or 64 tokens, got {chunk}")
    groups = t // v_block if v_block and t % v_block == 0 else 0
    if not groups or v_dim % v_block or chunk % groups or k_dim % groups:
        raise ConfigError(
            f"gated_delta_chunk: v_block {v_block} must divide v_dim {v_dim} and {t} threads into row groups "
            f"that divide chunk {chunk} and k_dim {k_dim}"
        )
    if mma and (k_dim % 16 or v_block % 8):
        raise ConfigError(f"gated_delta_chunk: the mma form needs k_dim % 16 == 0 and v_block % 8 == 0 (k_dim {k_dim}, v_block {v_block})")
    return chunk, v_block


def delta_chunk_fits(k_heads: int, v_heads: int, k_dim: int, v_dim: int, block: int = 0) -> bool:
    """Whether gated_delta_chunk (its default chunk, v_block and mma form) takes this head shape,
    with a chunk that divides the KV block size ``block`` (0: any); where it does not, the
    lowering runs the recurrent prefill instead."""
    try:
        chunk, _ = _chunk_shape(k_heads, v_heads, k_dim, v_dim, 0, 0, True, block)
    except ConfigError:
        return False
    return not (block and block % chunk)


def delta_chunk_kernel(
    k_heads: int,
    v_heads: int,
    k_dim: int,
    v_dim: int,
    qkv_stride: int,
    b_stride: int,
    a_stride: int,
    out_stride: int,
    v_tiled: bool,
    varlen: bool,
    chunk: int = 0,
    v_block: int = 0,
    mma: bool = True,
    block: int = 0,
) -> HybridKernel:
    """gated_delta_chunk: delta_rule_kernel's arguments plus ``positions`` (CHUNK_ARGS) and its
    grid (rows, v_heads, v_dim / v_block), 256 threads, chunks of ``chunk`` tokens (0: the longest
    of DELTA_CHUNKS whose shared memory fits DELTA_CHUNK_SMEM and that divides the KV block size
    ``block``, if given: the prefix cache's snapshots then end chunks); ``v_block`` state columns per block (0: 32 when v_dim is a multiple of 32,
    else v_dim); ``mma``: the k_dim products on bf16 tensor cores (exact: f32 operands split into
    two bf16 terms; k_dim a multiple of 16, v_block of 8), else f32 FMA. Shared memory at k_dim 128,
    v_block 32: mma 57 KB at chunk 32, 112 KB at 64; FMA 63 KB at 32, 124 KB at 64."""
    chunk, v_block = _chunk_shape(k_heads, v_heads, k_dim, v_dim, chunk, v_block, mma, block)
    _check_qkv_stride("gated_delta_chunk", qkv_stride, k_heads, k_dim, v_heads, v_dim)
    smem = delta_chunk_smem(chunk, k_dim, v_block, mma)
    params = {"k_heads": k_heads, "v_heads": v_heads, "k_dim": k_dim, "v_dim": v_dim, "v_block": v_block, "chunk": chunk,
              "qkv_stride": qkv_stride, "b_stride": b_stride, "a_stride": a_stride, "out_stride": out_stride,
              "v_tiled": bool(v_tiled), "varlen": bool(varlen), "mma": bool(mma),
              "vec": qkv_stride % 8 == 0 and k_dim % 8 == 0}
    name = entry_name("gated_delta_chunk", kh=k_heads, vh=v_heads, kd=k_dim, vd=v_dim, vb=v_block, c=chunk,
                      qs=qkv_stride, bs=b_stride, as_=a_stride, os=out_stride, ti=int(v_tiled), vl=int(varlen),
                      mma=int(mma))
    return HybridKernel(
        KernelSpec("gated_delta_chunk", name, params, pdl=True),
        CHUNK_ARGS,
        lambda rows, **_: (rows, v_heads, v_dim // v_block),
        (DELTA_CHUNK_THREADS, 1, 1),
        smem,
    )


def gated_rmsnorm_kernel(
    heads: int, head_dim: int, x_stride: int, z_stride: int, out_stride: int, eps: float, warps: int = 4
) -> HybridKernel:
    """gated_rmsnorm: one warp per (token, head)."""
    if heads < 1 or head_dim < 1 or warps not in (1, 2, 4, 8):
        raise ConfigError(f"gated_rmsnorm: bad shape heads={heads} head_dim={head_dim} warps={warps}")
    params = {"heads": heads, "head_dim": head_dim, "x_stride": x_stride, "z_stride": z_stride,
              "out_stride": out_stride, "eps": repr(float(eps)), "warps": warps}
    name = entry_name("gated_rmsnorm", h=heads, d=head_dim, xs=x_stride, zs=z_stride, os=out_stride, w=warps)
    return HybridKernel(
        KernelSpec("gated_rmsnorm", name, params, pdl=True),
        (("out", "ptr"), ("x", "ptr"), ("z", "ptr"), ("w", "ptr"), ("rows", "i32")),
        lambda rows, **_: (rows, -(-heads // warps), 1),
        (32 * warps, 1, 1),
    )


def split_heads_kernel(
    heads: int, head_dim: int, in_stride: int, a_stride: int, b_stride: int, threads: int = 256, trigger: bool = False
) -> HybridKernel:
    """split_heads: x [T, heads * 2 * head_dim] (per head [a_h | b_h]) -> a, b [T, heads * head_dim];
    ``trigger``: pdl_trigger() at once (batch 1)."""
    if heads < 1 or head_dim < 1 or not _threads_ok(threads):
        raise ConfigError(f"split_heads: bad shape heads={heads} head_dim={head_dim} threads={threads}")
    params = {"heads": heads, "head_dim": head_dim, "in_stride": in_stride, "a_stride": a_stride,
              "b_stride": b_stride, "threads": threads, "trigger": bool(trigger)}
    name = entry_name("split_heads", h=heads, d=head_dim, xs=in_stride, as_=a_stride, bs=b_stride, t=threads,
                      **({"tr": 1} if trigger else {}))
    n = heads * head_dim
    return HybridKernel(
        KernelSpec("split_heads", name, params, pdl=True),
        (("a", "ptr"), ("b", "ptr"), ("x", "ptr"), ("rows", "i32")),
        lambda rows, **_: (-(-n // threads), rows, 1),
        (threads, 1, 1),
    )


def sigmoid_mul_kernel(
    n: int, x_stride: int, g_stride: int, out_stride: int, threads: int = 256, trigger: bool = False
) -> HybridKernel:
    """sigmoid_mul: out [T, n] = x * sigmoid(gate) (out may alias x); ``trigger``: pdl_trigger() at
    once (batch 1)."""
    if n < 1 or not _threads_ok(threads):
        raise ConfigError(f"sigmoid_mul: bad shape n={n} threads={threads}")
    params = {"n": n, "x_stride": x_stride, "g_stride": g_stride, "out_stride": out_stride, "threads": threads,
              "trigger": bool(trigger)}
    name = entry_name("sigmoid_mul", n=n, xs=x_stride, gs=g_stride, os=out_stride, t=threads, **({"tr": 1} if trigger else {}))
    return HybridKernel(
        KernelSpec("sigmoid_mul", name, params, pdl=True),
        (("out", "ptr"), ("x", "ptr"), ("gate", "ptr"), ("rows", "i32")),
        lambda rows, **_: (-(-n // threads), rows, 1),
        (threads, 1, 1),
    )


def unpack_kernel(
    k_heads: int, v_heads: int, k_dim: int, v_dim: int, strides: dict[str, int], threads: int = 256
) -> HybridKernel:
    """unpack_qkvz_ba: ``strides`` has the row strides qkvz, ba, qkv, z, b, a (elements)."""
    if v_heads % k_heads or not _threads_ok(threads):
        raise ConfigError(f"unpack_qkvz_ba: bad shape k_heads={k_heads} v_heads={v_heads} threads={threads}")
    keys = ("qkvz", "ba", "qkv", "z", "b", "a")
    params: dict[str, Any] = {"k_heads": k_heads, "v_heads": v_heads, "k_dim": k_dim, "v_dim": v_dim, "threads": threads}
    params.update({f"{k}_stride": int(strides[k]) for k in keys})
    name = entry_name("unpack_qkvz_ba", kh=k_heads, vh=v_heads, kd=k_dim, vd=v_dim,
                      **{k: int(strides[k]) for k in keys}, t=threads)
    width = k_heads * (2 * k_dim + 2 * (v_heads // k_heads) * v_dim)
    return HybridKernel(
        KernelSpec("unpack_qkvz_ba", name, params, pdl=True),
        (("qkv", "ptr"), ("z", "ptr"), ("b", "ptr"), ("a", "ptr"), ("qkvz", "ptr"), ("ba", "ptr"), ("rows", "i32")),
        lambda rows, **_: (-(-width // threads), rows, 1),
        (threads, 1, 1),
    )
