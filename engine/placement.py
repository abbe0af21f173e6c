"""Placement of one model over N devices: pipeline (PP, contiguous layer ranges) or tensor parallel (TP).

``plan_placement(graph, dims, split, devices, ...)`` decides, from the family graph, dims and quant
alone, what every device holds and how many weight and KV bytes that is:

- ``pp``: layers in contiguous ranges balanced by bytes (each layer's weights plus its KV bytes for
  ``kv_tokens`` tokens); the embedding on the first device, the final norm and head on the last (a
  tied head: a copy of the embedding there). Activations pass from stage to stage.
- ``tp``: in every layer q/k/v are split by heads (column-parallel; K/V heads split when N divides
  them, replicated when ``kv_heads < N`` and ``N % kv_heads == 0``, else an error), o and down are
  split by their input columns (row-parallel: an all-reduce sums the partial outputs), gate/up by
  rows; MoE experts by expert (``moe="ep"``) or by the expert FFN's columns (``moe="cols"``); the
  head by vocabulary rows (``head="vocab"``, logits gathered) or replicated; the embedding, norms
  and router are replicated.

``Placement.shard(key, rank)`` gives the (axis, start, stop) slice of a tensor a rank holds (None:
the whole tensor), which engine.sharded_reference uses to run the graph per the placement, and
``Placement.check_fits(free)`` raises one line naming the device that cannot hold its part.

Must not import numpy, CUDA or anything above engine.weight_memory.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine import quant as quant_mod
from engine.graph import ModelGraph, QuantCombo
from engine.types import MemraError
from engine.weight_memory import GIB, TensorBytes, tensor_bytes

SPLITS = ("pp", "tp")
MOE_SPLITS = ("ep", "cols")
HEAD_SPLITS = ("vocab", "replicated")

# Under TP (_plan_tp's slices) "rows" splits a matrix's output features (column-parallel), "cols"
# its input features (row-parallel: the op's output is a partial sum). Vectors and these keys are
# replicated; any other matrix without a slice is an error (no TP rule), never a silent copy.
REPLICATED = ("embed", "router")
# ops whose output is a partial sum under TP (their weights are split by input columns / by expert)
REDUCE_WEIGHTS = ("wo", "w_down", "exp_down")
# ops a TP split knows how to shard (what engine.sharded_reference runs per rank)
TP_OPS = ("embed", "rmsnorm", "head_rmsnorm", "linear", "rope", "attention", "silu_mul", "moe_router", "moe_experts")


@dataclass(frozen=True)
class DevicePart:
    """What one device holds: its rank, device id, layers, and bytes (weights, KV per token)."""

    rank: int
    device: int
    layers: tuple[int, ...]
    embed: bool
    head: bool
    weight_bytes: int
    kv_bytes_per_token: int
    kv_heads: int  # K/V heads of each of its layers


@dataclass(frozen=True)
class Placement:
    split: str
    devices: tuple[int, ...]
    parts: tuple[DevicePart, ...]
    dims: Mapping[str, Any]
    moe: str = "ep"
    head: str = "vocab"
    # TP: per tensor key, "rows"/"cols"/"experts" and the (start, stop) per rank along that axis
    slices: dict[str, tuple[str, tuple[tuple[int, int], ...]]] = field(default_factory=dict)

    @property
    def n(self) -> int:
        return len(self.devices)

    def shard(self, key: str, rank: int) -> tuple[int, int, int] | None:
        """(axis, start, stop) of tensor ``key`` that ``rank`` holds, in the tensor's own axes
        (stacked expert tensors [E, out, in]: axis 0 experts, 1 out, 2 in); None: all of it."""
        if key not in self.slices:
            return None
        how, bounds = self.slices[key]
        lo, hi = bounds[rank]
        stacked = key.startswith("exp_")
        axis = {"experts": 0, "rows": 1 if stacked else 0, "cols": 2 if stacked else 1}[how]
        return axis, lo, hi

    def reduces(self, weights: Sequence[str]) -> bool:
        """Whether an op reading ``weights`` yields a partial sum on each rank (TP all-reduce)."""
        return self.split == "tp" and any(w in REDUCE_WEIGHTS for w in weights)

    def describe(self) -> str:
        rows = []
        for p in self.parts:
            span = f"layers {p.layers[0]}-{p.layers[-1]}" if p.layers else "no layers"
            extra = (" +embed" if p.embed else "") + (" +head" if p.head else "")
            rows.append(
                f"rank {p.rank} (device {p.device}): {span}{extra}, weights {p.weight_bytes / GIB:.2f} GiB, "
                f"KV {p.kv_bytes_per_token} B/token ({p.kv_heads} kv heads)"
            )
        return f"{self.split} over {self.n} devices\n  " + "\n  ".join(rows)

    def check_fits(self, free: Sequence[int], kv_tokens: int = 0, reserve: int = 0) -> None:
        """Raise MemraError (``out_of_memory``) naming the first device whose weights, KV for
        ``kv_tokens`` tokens and ``reserve`` bytes exceed its ``free`` bytes (one per rank)."""
        if len(free) != self.n:
            raise MemraError(f"placement: {len(free)} free-byte counts for {self.n} devices")
        for p, f in zip(self.parts, free, strict=True):
            need = p.weight_bytes + p.kv_bytes_per_token * kv_tokens + reserve
            if need > f:
                raise MemraError(
                    f"device {p.device} (rank {p.rank} of {self.split}-{self.n}): needs {need / GIB:.2f} GiB "
                    f"(weights {p.weight_bytes / GIB:.2f} GiB + KV {p.kv_bytes_per_token * kv_tokens / GIB:.2f} GiB "
                    f"for {kv_tokens} tokens + {reserve / GIB:.2f} GiB reserve), only {f / GIB:.2f} GiB free",
                    code="out_of_memory",
                )


def even_bounds(total: int, n: int) -> tuple[tuple[int, int], ...]:
    """``total`` items in ``n`` contiguous ranges whose sizes differ by at most one."""
    q, r = divmod(total, n)
    out, lo = [], 0
    for i in range(n):
        hi = lo + q + (1 if i < r else 0)
        out.append((lo, hi))
        lo = hi
    return tuple(out)


def parse_devices(text: str) -> tuple[int, ...]:
    """``"0,1"`` -> (0, 1); a clear error for anything else (empty, negative, repeated ids)."""
    try:
        ids = tuple(int(t) for t in text.split(","))
    except ValueError:
        raise MemraError(f"--devices {text!r}: expected a comma list of device ids such as 0,1", param="devices") from None
    if not ids or any(i < 0 for i in ids) or len(set(ids)) != len(ids):
        raise MemraError(f"--devices {text!r}: device ids must be distinct and >= 0", param="devices")
    return ids


def _kv_bytes(dims: Mapping[str, Any], layers: int, kv_heads: int, kv_dtype_bytes: int) -> int:
    return 2 * layers * kv_heads * int(dims["head_dim"]) * kv_dtype_bytes


def _attention_layers(graph: ModelGraph, dims: Mapping[str, Any]) -> set[int]:
    return {i for i in range(int(dims["layers"])) if any(o.op == "attention" for o in graph.layer_ops(dict(dims), i))}


def _partition(costs: Sequence[int], n: int, first: int, last: int) -> list[tuple[int, int]]:
    """Contiguous non-empty ranges of ``costs`` over ``n`` parts minimising the largest part, the
    first part also carrying ``first`` bytes and the last ``last`` (exact DP; L and n are small)."""
    L = len(costs)
    if n > L:
        raise MemraError(f"placement pp: {n} devices but the model has only {L} layers")
    pre = [0]
    for c in costs:
        pre.append(pre[-1] + c)
    INF = float("inf")
    # best[k][j]: the smallest max over the first j layers in k parts; cut[k][j]: the last part's start
    best = [[INF] * (L + 1) for _ in range(n + 1)]
    cut = [[0] * (L + 1) for _ in range(n + 1)]
    best[0][0] = 0
    for k in range(1, n + 1):
        for j in range(k, L - (n - k) + 1):
            for i in range(k - 1, j):
                part = pre[j] - pre[i] + (first if k == 1 else 0) + (last if k == n else 0)
                v = max(best[k - 1][i], part)
                if v < best[k][j]:
                    best[k][j], cut[k][j] = v, i
    ranges, j = [], L
    for k in range(n, 0, -1):
        i = cut[k][j]
        ranges.append((i, j))
        j = i
    return ranges[::-1]


def plan_placement(
    graph: ModelGraph,
    dims: Mapping[str, Any],
    split: str,
    devices: Sequence[int],
    combo: QuantCombo | None = None,
    tensor_dtypes: Mapping[str, str] | None = None,
    kv_tokens: int | None = None,
    kv_dtype_bytes: int = 2,
    moe: str = "ep",
    head: str = "vocab",
) -> Placement:
    """Split the model over ``devices`` (see the module docstring). ``kv_tokens`` (default the
    context) weighs each layer's KV bytes into the PP balance. Raises MemraError naming what does
    not divide or has no rule."""
    if split not in SPLITS:
        raise MemraError(f"--split {split!r}: choose one of {', '.join(SPLITS)}", param="split")
    if moe not in MOE_SPLITS or head not in HEAD_SPLITS:
        raise MemraError(f"placement: moe must be one of {MOE_SPLITS}, head one of {HEAD_SPLITS}")
    devices = tuple(devices)
    n = len(devices)
    if n < 2:
        raise MemraError(f"--split {split} needs at least 2 devices, got {n} (--devices {','.join(map(str, devices))})", param="devices")
    entries = tensor_bytes(graph, dims, combo, tensor_dtypes)
    kv_heads = int(dims["kv_heads"])
    attn = _attention_layers(graph, dims)
    if split == "pp":
        return _plan_pp(graph, dims, devices, entries, attn, kv_tokens, kv_dtype_bytes)
    return _plan_tp(graph, dims, devices, entries, attn, kv_heads, kv_dtype_bytes, moe, head)


def _plan_pp(graph, dims, devices, entries, attn, kv_tokens, kv_dtype_bytes) -> Placement:
    n, L = len(devices), int(dims["layers"])
    tokens = int(kv_tokens if kv_tokens is not None else dims["context"])
    per_layer = [0] * L
    first = last = 0
    for t in entries:
        if t.layer is not None:
            per_layer[t.layer] += t.nbytes
        elif t.group == "embedding":
            first += t.nbytes
            if dims.get("tie_embeddings") and "lm_head" in graph.tensors:
                last += t.nbytes  # the tied head reads the embedding on the last device too
        else:
            last += t.nbytes
    kv_layer = _kv_bytes(dims, 1, int(dims["kv_heads"]), kv_dtype_bytes)
    costs = [per_layer[i] + (kv_layer * tokens if i in attn else 0) for i in range(L)]
    parts = []
    for rank, (lo, hi) in enumerate(_partition(costs, n, first, last)):
        w = sum(per_layer[lo:hi]) + (first if rank == 0 else 0) + (last if rank == n - 1 else 0)
        kv = kv_layer * sum(1 for i in range(lo, hi) if i in attn)
        parts.append(DevicePart(rank, devices[rank], tuple(range(lo, hi)), rank == 0, rank == n - 1, w, kv, int(dims["kv_heads"])))
    return Placement("pp", devices, tuple(parts), dict(dims))


def _divisible(what: str, total: int, n: int, family: str) -> None:
    if total % n:
        raise MemraError(f"--split tp over {n} devices: {family} {what} = {total} is not divisible by {n}", param="split")


def _plan_tp(graph, dims, devices, entries, attn, kv_heads, kv_dtype_bytes, moe, head) -> Placement:
    n, fam = len(devices), graph.family
    heads, head_dim = int(dims["heads"]), int(dims["head_dim"])
    _divisible("heads", heads, n, fam)
    for o, _ in graph.ops():
        if o.op not in TP_OPS:
            raise MemraError(f"--split tp: family {fam} has op {o.op!r}, which has no tensor-parallel rule yet; use --split pp")
    if kv_heads % n == 0:
        kv_bounds = even_bounds(kv_heads, n)
        kv_local = kv_heads // n
    elif n % kv_heads == 0:
        per = n // kv_heads  # ranks sharing one K/V head (replicated)
        kv_bounds = tuple((r // per, r // per + 1) for r in range(n))
        kv_local = 1
    else:
        raise MemraError(
            f"--split tp over {n} devices: {fam} has {kv_heads} K/V heads; they must divide by {n}, or {n} "
            f"by them (replicated K/V heads)",
            param="split",
        )
    slices: dict[str, tuple[str, tuple[tuple[int, int], ...]]] = {}
    q_b = even_bounds(heads, n)
    slices["wq"] = ("rows", tuple((lo * head_dim, hi * head_dim) for lo, hi in q_b))
    slices["wo"] = ("cols", slices["wq"][1])
    for k in ("wk", "wv"):
        slices[k] = ("rows", tuple((lo * head_dim, hi * head_dim) for lo, hi in kv_bounds))
    if "intermediate" in dims and int(dims["intermediate"] or 0):
        inter = int(dims["intermediate"])
        _divisible("intermediate", inter, n, fam)
        b = even_bounds(inter, n)
        slices["w_gate"] = slices["w_up"] = ("rows", b)
        slices["w_down"] = ("cols", b)
    if int(dims.get("experts") or 0):
        if moe == "ep":
            _divisible("experts", int(dims["experts"]), n, fam)
            b = even_bounds(int(dims["experts"]), n)
            for k in ("exp_gate", "exp_up", "exp_down"):
                slices[k] = ("experts", b)
        else:
            _divisible("moe_intermediate", int(dims["moe_intermediate"]), n, fam)
            b = even_bounds(int(dims["moe_intermediate"]), n)
            slices["exp_gate"] = slices["exp_up"] = ("rows", b)
            slices["exp_down"] = ("cols", b)
    if head == "vocab":
        slices["lm_head"] = ("rows", even_bounds(int(dims["vocab"]), n))
    weight = [0] * n  # a tied vocab-parallel head is a row slice of the replicated embedding
    for t in entries:
        for r in range(n):
            weight[r] += _shard_bytes(t, slices, r, fam)
    kv = _kv_bytes(dims, len(attn), kv_local, kv_dtype_bytes)
    L = tuple(range(int(dims["layers"])))
    parts = tuple(DevicePart(r, devices[r], L, True, True, weight[r], kv, kv_local) for r in range(n))
    return Placement("tp", tuple(devices), parts, dict(dims), moe, head, slices)


def _shard_bytes(t: TensorBytes, slices, rank: int, family: str) -> int:
    if t.key not in slices:
        if t.group in ("vectors", "embedding") or t.key in REPLICATED or t.key == "lm_head":
            return t.nbytes
        raise MemraError(f"--split tp: family {family} tensor {t.key!r} has no tensor-parallel rule; use --split pp")
    how, bounds = slices[t.key]
    lo, hi = bounds[rank]
    stacked = t.group == "experts"
    rows_axis, cols = (1 if stacked else 0), t.shape[-1]
    if how == "experts":
        return t.nbytes * (hi - lo) // t.shape[0]
    if how == "rows":
        return t.nbytes * (hi - lo) // t.shape[rows_axis]
    # cols: each rank's rows are (hi - lo) elements of the input; quantised blocks must not straddle
    try:
        row = quant_mod.row_bytes(t.dtype, hi - lo)
    except MemraError:
        raise MemraError(
            f"--split tp: {t.key} ({t.dtype}) would be split at {hi - lo} of {cols} input columns per device, "
            f"not a whole number of {t.dtype} blocks; use fewer devices or --split pp",
            param="split",
        ) from None
    return t.nbytes // quant_mod.row_bytes(t.dtype, cols) * row
