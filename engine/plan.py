"""Plan: a ModelGraph + dims + quant combo + device profile, lowered to weights, buffers and launches.

``build_plan`` works from dims alone (no weights, no GPU), so `memra warmup` can list every kernel
(``kernel_specs(plan)``) and golden tests can pin a plan's text (``describe(plan)``). The plan says
how weights are uploaded (q|k|v and gate|up fused into one matrix when their storage types agree;
raw GGUF blocks uploaded as-is), which activation values share which arena buffer, and for each
graph op the kernel launches of the two run modes:

- ``decode``: ``n`` rows, one token per sequence (replayed from a CUDA graph per batch bucket);
  ``decode1`` is the same at n = 1 with batch-1 GEMVs;
- ``prefill``: ``n`` tokens of one sequence (eager, chunked); the head (final norm, lm_head,
  sampling) then runs on the last row only, with the ``decode1`` kernels.

Launch arguments are symbolic (``Arg``) so the runner binds pointers once per bucket/chunk. Which
kernel serves an op comes from the kernel engineer's ``engine.kernel_catalog`` through the adapter
``_CatalogAdapter`` below; that is the only place that knows catalog function names.
Must not import CUDA or numpy.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from engine.graph import BLOCK_SIZES, ModelGraph, Op, QuantCombo, evaluate
from engine.kernel_spec import KernelSpec, entry_name
from engine.profile import DeviceProfile
from engine.quant import row_bytes
from engine.types import ConfigError

ACT_ITEMSIZE = {"f32": 4, "bf16": 2, "f16": 2, "i32": 4}
MODES = ("decode1", "decode", "prefill")
# the launches of a batch-1 short-context decode pass where they differ from both decode1's and
# short's (tuning decode_graph.pair_attention: the q|k|v pair that also runs the attention;
# attention_decode.trigger_b1: the direct attention with its early pdl_trigger())
SHORT1 = "short1"


def launch_key(launches: Mapping[str, Any], mode: str, short: bool) -> str:
    """The key of a step's ``launches`` that a pass in ``mode`` runs: in a short-context decode
    pass (every row's position below Plan.short_context), SHORT1 at batch 1 where the step has it,
    else "short" where it has that; otherwise the mode itself."""
    if short:
        if mode == "decode1" and SHORT1 in launches:
            return SHORT1
        if "short" in launches:
            return "short"
    return mode


def storage_nbytes(dtype: str, rows: int, cols: int) -> int:
    """Bytes of a row-major [rows, cols] tensor stored as ``dtype`` (cols a multiple of the block)."""
    if dtype not in BLOCK_SIZES:
        raise ConfigError(f"storage type {dtype!r} has no known block layout")
    elems, nbytes = BLOCK_SIZES[dtype]
    if cols % elems:
        raise ConfigError(f"a {dtype} row of {cols} values is not a whole number of {elems}-value blocks")
    return rows * row_bytes(dtype, cols)  # device layouts may pad rows (q6_kr)


@dataclass(frozen=True)
class WeightPlan:
    """One device allocation: ``parts`` (family tensor keys, in order) concatenated by rows."""

    key: str  # plan name: "embed", "L3.wq|wk|wv", "final_norm" ...
    layer: int | None
    parts: tuple[str, ...]
    dtype: str
    rows: int  # output features (sum over parts); vectors: 1
    cols: int  # input features; vectors: length
    part_rows: tuple[int, ...] = ()

    @property
    def nbytes(self) -> int:
        return storage_nbytes(self.dtype, self.rows, self.cols)


@dataclass(frozen=True)
class Value:
    """An activation: ``width`` elements per token at column ``offset`` of arena buffer ``buffer``
    (row stride ``ld`` elements), so fused q|k|v outputs are views into one buffer."""

    name: str
    buffer: str
    offset: int
    width: int
    ld: int
    dtype: str


@dataclass(frozen=True)
class BufferPlan:
    """An arena buffer of ``rows`` x ``width`` elements (``rows`` 0: the plan's ``max_tokens``;
    logits only ever hold the sampled rows, so they get the largest graph bucket)."""

    name: str
    dtype: str
    width: int  # elements per token
    rows: int = 0

    def nbytes(self, tokens: int) -> int:
        return self.width * (self.rows or tokens) * ACT_ITEMSIZE[self.dtype]


@dataclass(frozen=True)
class Arg:
    """A symbolic kernel argument the runner resolves to a pointer or number.

    kind: ``value`` (pointer to value ``ref`` row 0; ``row="last"`` -> row n-1), ``weight``,
    ``kv`` (``ref`` = "k"|"v", ``layer``), ``input`` (a per-step static input buffer: tokens,
    positions, slots, block_tables, temperature, top_p, top_k, min_p, seeds, counters, out_ids),
    ``scratch`` (a ``ScratchPlan`` buffer), ``shape`` (``ref`` = n, nseq, max_blocks, block_size,
    max_ctx, or ``splits:<split>`` = ceil(max_ctx / split)), ``const``, ``tmap`` (a device pointer
    to the TMA descriptor of a bf16 matrix: ``ref`` = ("value" | "weight", name, box rows) or
    ("scratch", name, box rows, rows, cols); a value's map spans its buffer's rows, a weight's its
    rows, boxes of 64 columns).
    """

    kind: str
    ref: Any
    ctype: str = "ptr"  # engine.cuda.ARG_FORMATS key
    layer: int | None = None
    row: str = "first"


@dataclass(frozen=True)
class ScratchPlan:
    """A runner-owned device buffer outside the arena: ``fixed`` bytes plus ``per_split`` bytes for
    every ``split`` tokens of max_model_len (attention partials). ``fill="iota"``: int32 0, 1, 2 ...;
    ``fill="zero"``: zeros (counters that the kernels using them reset themselves)."""

    name: str
    fixed: int = 0
    per_split: int = 0
    split: int = 1
    fill: str = ""

    def nbytes(self, max_model_len: int) -> int:
        return self.fixed + self.per_split * -(-max_model_len // self.split)


# a grid dimension: an int, an expression over the shape names (n, nseq, max_ctx ...), or a callable
GridDim = int | str | Callable[[Mapping[str, int]], int]


@dataclass(frozen=True)
class Launch:
    """One kernel launch of a step. ``min_rows`` / ``max_rows`` (0: no bound) limit it to passes of
    that many rows: a prefill linear may take one path for short chunks and another for long ones.
    ``fit_grid``: the kernel loops over its work (grid-stride), so the runner may shrink grid.x to
    the blocks that are resident at once (the driver's occupancy of the compiled kernel x SMs): a
    grid larger than that runs in waves, and the last wave's blocks finish late. ``concurrent``:
    the launch may run alongside the launches before it in its step (on a second stream, forked
    before the step's first launch and joined before the next step's): it reads only what they
    read, writes only its own output and uses no scratch (tuning decode_graph.fork_linears)."""

    spec: KernelSpec
    grid: tuple[GridDim, ...]
    block: tuple[int, ...]
    args: tuple[Arg, ...]
    smem: int = 0
    min_rows: int = 0
    max_rows: int = 0
    fit_grid: bool = False
    concurrent: bool = False

    def runs_at(self, rows: int) -> bool:
        return rows >= self.min_rows and (not self.max_rows or rows <= self.max_rows)

    def grid_for(self, shape: Mapping[str, int]) -> tuple[int, ...]:
        out = []
        for g in self.grid:
            if callable(g):
                out.append(int(g(shape)))
            elif isinstance(g, str):
                out.append(int(evaluate(g, dict(shape))))
            else:
                out.append(int(g))
        return tuple(out)


@dataclass(frozen=True)
class Step:
    """One graph op at one layer, with its launches per mode."""

    op: Op
    layer: int | None
    head: bool  # part of the head (after the last layer): runs on the last row in prefill
    launches: dict[str, tuple[Launch, ...]] = field(default_factory=dict)


@dataclass(frozen=True)
class Plan:
    family: str
    dims: dict[str, Any]
    quant: str
    profile: str
    rope_style: str
    weights: tuple[WeightPlan, ...]
    buffers: tuple[BufferPlan, ...]
    values: dict[str, Value]
    steps: tuple[Step, ...]
    sampling: dict[str, tuple[Launch, ...]]  # "greedy" / "sample" -> launches on logits
    scratch: tuple[ScratchPlan, ...]
    short_context: int  # decode rows all below this position use the ``short`` launches (attention, rope)
    max_tokens: int  # arena rows: max(prefill chunk, largest graph bucket)
    block_size: int
    graph_batch_sizes: tuple[int, ...]
    wide_rows: int = 0  # decode buckets of at least this many rows use the WIDE launches (0: none)

    def weight(self, key: str) -> WeightPlan:
        for w in self.weights:
            if w.key == key:
                return w
        raise KeyError(key)

    def buffer_offsets(self) -> dict[str, int]:
        """Byte offset of each buffer in the one activation arena (256-byte aligned)."""
        out, off = {}, 0
        for b in self.buffers:
            out[b.name] = off
            off += _align(b.nbytes(self.max_tokens))
        return out

    def arena_bytes(self) -> int:
        return sum(_align(b.nbytes(self.max_tokens)) for b in self.buffers)

    def weight_bytes(self) -> int:
        return sum(w.nbytes for w in self.weights)


def _align(n: int, a: int = 256) -> int:
    return (n + a - 1) // a * a


def kernel_specs(plan: Plan) -> list[KernelSpec]:
    """Every kernel the plan can launch, deduplicated, in first-use order (what warmup builds)."""
    seen: dict[KernelSpec, None] = {}
    for step in plan.steps:
        for launches in step.launches.values():
            for launch in launches:
                seen.setdefault(launch.spec, None)
    for launches in plan.sampling.values():
        for launch in launches:
            seen.setdefault(launch.spec, None)
    return list(seen)


# ---------------------------------------------------------------------------------------------
# building


def _full_dims(dims: Mapping[str, Any]) -> dict[str, Any]:
    d = dict(dims)
    for key in ("hidden", "layers", "heads", "intermediate", "vocab"):
        if key not in d:
            raise ConfigError(f"plan: dims lack {key!r} (have {', '.join(sorted(d))})")
    d.setdefault("kv_heads", d["heads"])
    d.setdefault("head_dim", d["hidden"] // d["heads"])
    d.setdefault("q_dim", d["heads"] * d["head_dim"])
    d.setdefault("kv_dim", d["kv_heads"] * d["head_dim"])
    d.setdefault("rope_dim", d["head_dim"])
    d.setdefault("rms_eps", 1e-5)
    d.setdefault("rope_theta", 10000.0)
    d.setdefault("rope_scaling", None)
    d.setdefault("tie_embeddings", False)
    if d.get("rope_dim") in (None, 0):
        d["rope_dim"] = d["head_dim"]
    return d


def _tensor_shape(graph: ModelGraph, key: str, dims: Mapping[str, Any]) -> tuple[int, ...]:
    spec = graph.tensors[key]
    if spec.shape is None:
        raise ConfigError(f"{graph.path}: tensors.{key}: a shape is needed to plan without weights")
    return tuple(int(evaluate(s, dict(dims))) for s in spec.shape)


def _dtype_of(
    graph: ModelGraph,
    quant: QuantCombo,
    key: str,
    layer: int | None,
    tensor_dtypes: Mapping[str, str] | None,
) -> str:
    spec = graph.tensors[key]
    if spec.kind == "vector":
        return "f32"  # norms are uploaded dequantised to f32 whatever the file holds
    if tensor_dtypes:
        name = f"{key}@{layer}" if layer is not None else key
        if name in tensor_dtypes:
            return tensor_dtypes[name]
        if key in tensor_dtypes:
            return tensor_dtypes[key]
    allowed = quant.allowed(key)
    return allowed[0]


def build_plan(
    graph: ModelGraph,
    dims: Mapping[str, Any],
    quant: QuantCombo,
    profile: DeviceProfile,
    tensor_dtypes: Mapping[str, str] | None = None,
    rope_style: str = "neox",
    catalog: Any = None,
    prefill_linear: str = "gemm",
) -> Plan:
    """Lower ``graph`` for ``profile``.

    ``tensor_dtypes`` maps ``"<tensor key>@<layer>"`` (or ``"<tensor key>"`` for all layers) to the
    storage type read from a file; without it each tensor takes its combo's first allowed type and
    vectors are f32. ``catalog`` replaces ``engine.kernel_catalog`` (tests). ``prefill_linear``:
    "gemm" (tensor cores; quantised weights dequantised to a bf16 scratch first) or "gemv" (the
    decode kernel over row groups; slower, a fallback). Raises ConfigError.
    """
    d = _full_dims(dims)
    chunk = profile.prefill_chunk_tokens
    max_tokens = max(chunk, max(profile.cuda_graph_batch_sizes))
    adapter = _CatalogAdapter(catalog, profile, d, rope_style, max_tokens, prefill_linear)
    ops = graph.ops()
    last_layer_index = max((i for i, (_, per) in enumerate(ops) if per), default=-1)

    weights: dict[str, WeightPlan] = {}
    buffers: dict[str, BufferPlan] = {}
    values: dict[str, Value] = {}
    steps: list[Step] = []

    def value_for(name: str, width: int, buffer: str | None = None, offset: int = 0, ld: int | None = None):
        dtype = adapter.act_dtype(name)
        buf = buffer or name
        if buf not in buffers:
            rows = max(profile.cuda_graph_batch_sizes) if name == "logits" else 0
            buffers[buf] = BufferPlan(buf, dtype, ld or width, rows)
        v = Value(name, buf, offset, width, ld or width, dtype)
        old = values.get(name)
        if old is not None and (old.width, old.buffer, old.offset, old.ld) != (
            v.width,
            v.buffer,
            v.offset,
            v.ld,
        ):
            # a name re-bound with another layout (e.g. q after a fused qkv then a norm) keeps
            # the first binding; kernels that write it use the first layout
            return old
        values.setdefault(name, v)
        return values[name]

    fuse_groups: dict[int, list[list[int]]] = {}

    def type_runs(op: Op, per_layer: bool) -> list[list[int]]:
        """op's weights as runs of consecutive ones that share one storage type in every layer (once
        per op): each run is fused into one allocation. A fusion is decided for all layers at once:
        the outputs are bound once, as column views of one buffer per run, so one layer's split
        q/k/v could not share the others' layout. A q4_k_m file whose attn_v is q6_k in some layers
        fuses q|k and keeps v apart."""
        if id(op) not in fuse_groups:
            layers = range(int(d["layers"])) if per_layer else [None]
            types = [[_dtype_of(graph, quant, w, lay, tensor_dtypes) for w in op.weights] for lay in layers]
            runs: list[list[int]] = [[0]]
            for i in range(1, len(op.weights)):
                if all(t[i] == t[runs[-1][0]] for t in types):
                    runs[-1].append(i)
                else:
                    runs.append([i])
            fuse_groups[id(op)] = runs
        return fuse_groups[id(op)]

    def plan_weight(op: Op, layer: int | None) -> list[WeightPlan]:
        """The weight allocations for an op (fused when the storage types agree)."""
        dts = [_dtype_of(graph, quant, w, layer, tensor_dtypes) for w in op.weights]
        shapes = [_tensor_shape(graph, w, d) for w in op.weights]
        groups: list[list[int]] = []
        if op.op == "linear" and len(op.weights) > 1 and len({s[1] for s in shapes}) == 1:
            groups = type_runs(op, layer is not None)
        else:
            groups = [[i] for i in range(len(op.weights))]
        out = []
        for g in groups:
            parts = tuple(op.weights[i] for i in g)
            resolved = [graph.tensors[p].tied_to if _tied(graph, p, d) else p for p in parts]
            base = "|".join(resolved if len(parts) == 1 else parts)
            key = f"L{layer}.{base}" if layer is not None else base
            shape = shapes[g[0]]
            if len(shape) == 1:
                rows, cols, prow = 1, shape[0], (1,)
            else:
                prow = tuple(shapes[i][0] for i in g)
                rows, cols = sum(prow), shape[1]
            if key not in weights:
                weights[key] = WeightPlan(
                    key, layer, tuple(resolved), adapter.upload_type(dts[g[0]], cols), rows, cols, prow
                )
            out.append(weights[key])
        return out

    schedule: list[tuple[Op, int | None, bool]] = []
    for index, (op, per_layer) in enumerate(ops):
        if not per_layer:
            schedule.append((op, None, index > last_layer_index))
        elif index == 0 or not ops[index - 1][1]:  # first op of a repeat body: expand layer-major
            body = [o for o, _ in _run_of_layer_ops(ops, index)]
            schedule.extend((o, layer, False) for layer in range(d["layers"]) for o in body)
    if _needs_freq_factors(graph, d, tensor_dtypes):
        half = int(d["rope_dim"]) // 2
        weights[ROPE_FREQ] = WeightPlan(ROPE_FREQ, None, (ROPE_FREQ,), "f32", 1, half, (1,))
        adapter.freq = weights[ROPE_FREQ]
    tg = profile.tune("gemv")
    kinds = {k for k, on in (("rmsnorm", tg.get("fuse_norm")), ("silu_mul", tg.get("fuse_silu"))) if on}
    readers: dict = {}
    fusable = _prologue_fusable(schedule, readers)
    adapter.fusable = {key for key, kind in fusable.items() if kind in kinds}
    if profile.tune("gemv_coop").get("q8x_fuse"):  # where every reader stages x itself anyway (batch 1)

        def q8x_reader(o: Op, lay: int | None) -> bool:
            for w in o.weights:
                w = graph.tensors[w].tied_to if _tied(graph, w, d) else w  # a tied lm_head reads embed
                cols = _tensor_shape(graph, w, d)[-1]
                dt = adapter.upload_type(_dtype_of(graph, quant, w, lay, tensor_dtypes), cols)
                if not adapter.q8x_decode(dt, cols):
                    return False
            return True

        adapter.fusable1 = {k for k in fusable if all(q8x_reader(o, lay) for o, lay in readers[k])}
    if tg.get("fuse_norm1"):  # batch 1 only: every reading GEMV applies the rmsnorm while loading x
        adapter.fusable1 |= {k for k, kind in fusable.items() if kind == "rmsnorm"}
    if tg.get("fuse_glu"):
        adapter.glu_ops = _glu_linears(schedule, fusable)
    wide_rows = _wide_decode_rows(graph, quant, d, profile, tensor_dtypes)
    for pos, (op, layer, head) in enumerate(schedule):
        if op.op == "rope":
            attn = next((o for o, lay, _ in schedule[pos:] if o.op == "attention" and lay == layer), None)
            if attn is not None and attn.inputs[2] in values:
                adapter.rope_v[layer] = values[attn.inputs[2]]
        ws = plan_weight(op, layer) if op.weights else []
        ins = [values[n] for n in op.inputs if n in values]
        outs = _bind_outputs(op, ws, ins, d, value_for)
        launches = {mode: tuple(adapter.launches(op, layer, mode, ins, outs, ws)) for mode in MODES}
        if wide_rows:
            launches[WIDE] = tuple(adapter.wide_launches(op, layer, ins, outs, ws))
        if op.op in ("attention", "rope", "head_rmsnorm"):  # decode variant for short contexts (every
            # row's position < split): direct attention, with the rope (and the q/k head norms it
            # applies) folded in where attention_decode.fuse_rope
            launches["short"] = tuple(adapter.launches(op, layer, "short", ins, outs, ws))
        steps.append(Step(op, layer, head, launches))

    adapter.fuse_pair_attention(steps, values)
    adapter.trigger_short1_attention(steps, weights)
    from engine import plan_l2  # (its passes import this module's types)

    plan_l2.apply(adapter, steps, weights)
    if "logits" not in values:
        raise ConfigError(f"{graph.path}: graph never produces logits")
    sampling = adapter.sampling(values["logits"])
    return Plan(
        family=graph.family,
        dims=d,
        quant=quant.name,
        profile=profile.name,
        rope_style=rope_style,
        weights=tuple(weights.values()),
        buffers=tuple(buffers.values()),
        values=values,
        steps=tuple(steps),
        sampling=sampling,
        scratch=tuple(adapter.scratch.values()),
        short_context=profile.tune("attention_decode")["split_kv_tokens"],
        max_tokens=max_tokens,
        block_size=profile.kv_block_size,
        graph_batch_sizes=profile.cuda_graph_batch_sizes,
        wide_rows=wide_rows,
    )


PROLOGUE_MODES = ("decode1", "decode")  # the modes whose GEMVs absorb rmsnorm / silu_mul


def _prologue_fusable(
    schedule: list[tuple[Op, int | None, bool]], readers: dict | None = None
) -> dict[tuple[int, int | None], str]:
    """(id(op), layer) of the rmsnorm / silu_mul ops whose output only linear layers read (as their
    x) before it is written again, in the same head/non-head part, while nothing rewrites the op's
    inputs in between, mapped to the op kind: in decode modes those get no launch when the profile's
    gemv tuning enables that kind (fuse_norm / fuse_silu), or gemv_coop.q8x_fuse and every reader
    is a q8x GEMV; the GEMVs compute them while loading x. ``readers``, when given, receives each
    key's reading (linear op, layer) pairs."""
    out: dict[tuple[int, int | None], str] = {}
    for i, (op, layer, head) in enumerate(schedule):
        if op.op not in ("rmsnorm", "silu_mul") or len(op.outputs) != 1:
            continue
        name = op.outputs[0]
        ok, src_changed, seen = True, False, []
        for o, lay, h in schedule[i + 1 :]:
            if name in o.inputs or o.attrs.get("residual") == name:
                ok = (
                    o.op == "linear"
                    and o.inputs[0] == name
                    and o.attrs.get("residual") != name
                    and h == head
                    and not src_changed
                )
                if not ok:
                    break
                seen.append((o, lay))
            if name in o.outputs:
                break  # redefined: later reads see the new value
            src_changed = src_changed or any(src in o.outputs for src in op.inputs)
        if ok and seen:
            out[(id(op), layer)] = op.op
            if readers is not None:
                readers[(id(op), layer)] = seen
    return out


def _glu_linears(
    schedule: list[tuple[Op, int | None, bool]], fusable: Mapping[tuple[int, int | None], str]
) -> set[tuple[int, int | None]]:
    """(id(op), layer) of the linear ops directly followed by a silu_mul of exactly their two outputs
    (gate, up) whose result only linear layers read as x (``_prologue_fusable``): their decode GEMV
    can store silu(gate) * up itself."""
    out = set()
    for (op, layer, _), (nxt, nlayer, _) in zip(schedule, schedule[1:], strict=False):
        if (
            op.op == "linear"
            and nxt.op == "silu_mul"
            and nlayer == layer
            and list(nxt.inputs) == list(op.outputs)
            and len(op.outputs) == 2
            and fusable.get((id(nxt), nlayer)) == "silu_mul"
        ):
            out.add((id(op), layer))
    return out


PENALTY_CAPACITY = 65536  # (row, token) penalty entries one step can upload; more -> host sampling
PENALTY_BLOCKS = 64  # engine.kernel_catalog.PENALTY_BLOCKS

WIDE = "decode_wide"  # the launches key of wide decode buckets: linear layers as tensor-core GEMMs


def _wide_decode_rows(
    graph: ModelGraph,
    quant: QuantCombo,
    d: Mapping[str, Any],
    profile: DeviceProfile,
    tensor_dtypes: Mapping[str, str] | None,
) -> int:
    """The smallest decode bucket that runs its linear layers as GEMMs (``tuning.gemm_decode
    .min_rows``), or 0 when no bucket that large exists or a matrix is not bf16 (quantised weights
    keep the GEMV, which reads them once per ``gemv.max_batch`` rows)."""
    rows = int(profile.tune("gemm_decode").get("min_rows", 0))
    if not rows or max(profile.cuda_graph_batch_sizes) < rows:
        return 0
    for op, _ in graph.ops():
        if op.op != "linear":
            continue
        for key in op.weights:
            for layer in range(int(d["layers"])):
                if _dtype_of(graph, quant, key, layer, tensor_dtypes) != "bf16":
                    return 0
    return rows


ROPE_FREQ = "rope_freq"  # a computed weight: per-pair divisors of theta^(-2i/rope_dim), f32 [rope_dim/2]


def _needs_freq_factors(
    graph: ModelGraph, d: Mapping[str, Any], tensor_dtypes: Mapping[str, str] | None
) -> bool:
    """Llama-3/linear ``rope_scaling`` (HF) or a GGUF ``rope_freqs`` tensor the file carries."""
    scaling = d.get("rope_scaling") or {}
    if scaling and scaling.get("rope_type", scaling.get("type", "default")) != "default":
        return True
    for op, _ in graph.ops():
        tensor = op.attrs.get("freq_factors") if op.op == "rope" else None
        if tensor and tensor_dtypes and tensor in tensor_dtypes:
            return True
    return False


def _run_of_layer_ops(ops: list[tuple[Op, bool]], start: int) -> list[tuple[Op, bool]]:
    end = start
    while end < len(ops) and ops[end][1]:
        end += 1
    return ops[start:end]


def _tied(graph: ModelGraph, key: str, d: Mapping[str, Any]) -> bool:
    spec = graph.tensors[key]
    return spec.tied_to is not None and bool(d.get("tie_embeddings"))


def _bind_outputs(
    op: Op, ws: list[WeightPlan], ins: list[Value], d: Mapping[str, Any], value_for
) -> list[Value]:
    if op.op == "embed":
        return [value_for(op.outputs[0], d["hidden"])]
    if op.op == "linear":
        outs, col = [], 0
        for w in ws:  # a fused allocation's outputs are column views of one buffer
            names = op.outputs[col : col + len(w.parts)]
            col += len(w.parts)
            if len(names) == 1:
                outs.append(value_for(names[0], w.rows))
                continue
            buf, off = "+".join(names), 0
            for name, rows in zip(names, w.part_rows, strict=True):
                outs.append(value_for(name, rows, buffer=buf, offset=off, ld=w.rows))
                off += rows
        if col != len(op.outputs):
            raise ConfigError(
                f"plan: the weights of linear {op.outputs} cover {col} of its {len(op.outputs)} outputs"
            )
        return outs
    if op.op in ("rmsnorm", "head_rmsnorm", "silu_mul", "attention"):
        return [value_for(op.outputs[0], ins[0].width)]
    if op.op == "rope":
        return list(ins)
    raise ConfigError(f"plan: op {op.op!r} is not supported by the CUDA plan")


# ---------------------------------------------------------------------------------------------
# lowering: ops -> launches


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _v(value: Value, row: str = "first") -> Arg:
    return Arg("value", value.name, "ptr", row=row)


def _w(weight: WeightPlan) -> Arg:
    return Arg("weight", weight.key)


NULL = Arg("const", 0, "ptr")
ROWS = Arg("shape", "n", "i32")


class _CatalogAdapter:
    """Lowers one graph op in one mode to ``Launch``es with the kernels' documented argument lists.

    KernelSpecs come from ``engine.kernel_catalog.spec(template, **params)`` (which validates the
    params and names the entry point); without a catalog ``_spec`` builds them directly. Argument
    orders follow each template's header comment and ``kernel_catalog.KERNELS``. Decode keeps
    split-KV attention + combine (parallel at batch 1 and long contexts); prefill uses the direct
    attention; ``decode1`` (batch 1, and the prefill head) uses bmax=1 GEMVs.
    """

    def __init__(
        self,
        catalog: Any,
        profile: DeviceProfile,
        dims: Mapping[str, Any],
        rope_style: str,
        max_tokens: int = 2048,
        prefill_linear: str = "gemm",
    ):
        if prefill_linear not in ("gemm", "gemv"):
            raise ConfigError(f"plan: prefill_linear must be gemm or gemv, got {prefill_linear!r}")
        self.max_tokens = max_tokens
        self.max_rows = max(profile.cuda_graph_batch_sizes)
        self.prefill_linear = prefill_linear
        self.scratch: dict[str, ScratchPlan] = {}
        self.freq: WeightPlan | None = None  # set by build_plan when RoPE frequencies are scaled
        if catalog is None:
            try:
                from engine import kernel_catalog as catalog  # type: ignore[no-redef]
            except ImportError:
                catalog = None
        self.cat = catalog
        self.profile = profile
        self.dims = dims
        self.rope_style = rope_style
        self.pending_norm: dict[tuple[Any, str, str], WeightPlan] = {}  # (layer, mode, value) -> norm
        # decode-mode GEMV prologues: (id(op), layer) of the fusable rmsnorm/silu_mul ops (build_plan
        # sets it) and (mode, value) -> ("norm", x, norm weight) | ("silu", gate, up offset)
        self.fusable: set[tuple[int, int | None]] = set()
        # ... and those fused in decode1 only (gemv_coop.q8x_fuse: every reader a batch-1 q8x GEMV;
        # at batch 8 each block's extra pass over its x rows costs more than the launch it saves)
        self.fusable1: set[tuple[int, int | None]] = set()
        self.prologue: dict[tuple[str, str], tuple] = {}
        self.rope_v: dict[int | None, Value] = {}  # set by build_plan: the v each rope writes to the cache
        # (id(op), layer) of the gate|up linears whose decode GEMV stores silu(gate) * up (build_plan)
        self.glu_ops: set[tuple[int, int | None]] = set()
        self.glu_done: set[tuple[str, str]] = set()  # (mode, gate value) whose GEMV ran glu
        # layer -> (attention spec params, extra args) of a decode rope folded into the attention
        self.rope_fused: dict[int | None, tuple[dict[str, Any], tuple[Arg, ...]]] = {}

    # -- specs

    def _spec(self, template: str, name_parts: dict[str, Any], **params: Any) -> KernelSpec:
        fn = getattr(self.cat, "spec", None) if self.cat is not None else None
        if fn is not None:  # the catalog validates params and names the entry point
            return fn(template, **params)
        return KernelSpec(template, entry_name(template, **name_parts), params)

    def tune(self, section: str) -> dict[str, Any]:
        return self.profile.tune(section)

    def o_window(self, steps: list[Step], i: int, weights: Mapping[str, WeightPlan]) -> bool:
        """Tuning decode_graph.o_window_min_kb / o_window_max_kb: whether the batch-1 changes in
        the attention's window (trigger_b1, the L2 prefetches of engine.plan_l2) apply to
        attention step ``i``: its layer's o projection (the next linear, one gemv launch at batch
        1) has a weight of at least / at most that many KB (0: no bound)."""
        lo = int(self._graph_value("o_window_min_kb") or 0) * 1024
        hi = int(self._graph_value("o_window_max_kb") or 0) * 1024
        if not (lo or hi):
            return True
        from engine import plan_l2  # (it imports this module)

        later = plan_l2.linears_after(steps, i)
        o = plan_l2.weight_of(self, later[0], weights) if later else None
        return o is not None and o.nbytes >= lo and (not hi or o.nbytes <= hi)

    def _graph_value(self, knob: str) -> Any:
        """A decode_graph tuning value (None where the profile's tuning has no such section)."""
        return (self.profile.tuning.get("decode_graph") or {}).get(knob)

    def _graph_knob(self, knob: str) -> bool:
        """A decode_graph tuning switch (off where the profile's tuning has no such section)."""
        return bool(self._graph_value(knob))

    def upload_type(self, dtype: str, cols: int) -> str:
        """The device layout of a matrix stored as ``dtype`` (kernel_catalog.upload_type)."""
        fn = getattr(self.cat, "upload_type", None) if self.cat is not None else None
        return fn(dtype, cols, self.profile.tuning) if fn is not None else dtype

    def q8x_decode(self, dtype: str, cols: int) -> bool:
        """Whether the decode1 GEMV on a [*, cols] weight uploaded as ``dtype`` is a coop q8x GEMV
        (kernel_catalog.q8x_applies at bmax 1)."""
        layout = getattr(self.cat, "gemv_layout", None) if self.cat is not None else None
        applies = getattr(self.cat, "q8x_applies", None) if self.cat is not None else None
        if layout is None or applies is None or not layout(dtype, self.profile.tuning).get("coop"):
            return False
        return bool(applies(self.profile.tuning, 1, cols, dtype))

    def _fused(self, op, layer, mode: str) -> bool:
        """Whether the rmsnorm / silu_mul op runs inside its readers' GEMVs in this decode mode."""
        key = (id(op), layer)
        return key in self.fusable or (mode == "decode1" and key in self.fusable1)

    def act_dtype(self, value: str) -> str:
        return "f32" if value == "logits" else "bf16"

    # -- ops

    def launches(self, op: Op, layer, mode: str, ins: list[Value], outs: list[Value], ws: list[WeightPlan]):
        fn = getattr(self, f"_op_{op.op}", None)
        if fn is None:
            raise ConfigError(f"plan: op {op.op!r} has no CUDA lowering")
        launches = fn(op, layer, mode, ins, outs, ws)
        if op.op not in ("rmsnorm", "silu_mul"):  # (those set or drop their own pending prologue)
            for o in outs:  # a value written again is no longer a pending GEMV prologue
                self.prologue.pop((mode, o.name), None)
        return launches

    def _op_embed(self, op, layer, mode, ins, outs, ws):
        w = ws[0]
        t = self.tune("elementwise")["threads"]
        spec = self._spec(
            "embed", {"q": w.dtype, "h": w.cols, "t": t}, quant=w.dtype, hidden=w.cols, threads=t
        )
        args = (_v(outs[0]), _w(w), Arg("input", "tokens"), ROWS)
        return [Launch(spec, ("n",), (t,), args)]

    def _op_rmsnorm(self, op, layer, mode, ins, outs, ws):
        w = ws[0]
        t = self.tune("norm")["threads"]
        eps = float(self.dims["rms_eps"])
        self.prologue.pop((mode, outs[0].name), None)
        x = ins[0]
        if (
            mode in PROLOGUE_MODES
            and self._fused(op, layer, mode)
            and w.dtype == "f32"
            and x.width == w.cols
            and x.ld % 8 == 0
            and x.offset % 8 == 0
        ):  # fused into the GEMVs that read the output (they normalise x while loading it)
            self.prologue[(mode, outs[0].name)] = ("norm", x, w)
            return []
        spec = self._spec(
            "rmsnorm",
            {"n": w.cols, "t": t, "e": f"{eps:g}"},
            n=w.cols,
            eps=repr(eps),
            threads=t,
            residual=False,
        )
        args = (_v(outs[0]), _v(ins[0]), NULL, _w(w), ROWS)
        return [Launch(spec, ("n",), (t,), args)]

    def _need_scratch(self, sp: ScratchPlan) -> None:
        old = self.scratch.get(sp.name)
        if old is None or sp.nbytes(1 << 20) > old.nbytes(1 << 20):
            self.scratch[sp.name] = sp

    def _op_linear(self, op, layer, mode, ins, outs, ws):
        if mode == "prefill" and self.prefill_linear == "gemm":
            return self._linear_gemm(op, mode, ins, outs, ws)
        return self._linear_gemv(op, mode, ins, outs, ws, layer)

    def _linear_gemm(self, op, mode, ins, outs, ws, section="gemm"):
        # section: the profile tuning ("gemm" for prefill, "gemm_decode" for wide decode buckets)
        tg = {"warps_m": 2, "split_k": 1, **self.tune(section)}
        res_name = op.attrs.get("residual")
        residual = res_name is not None
        launches = []
        col = 0
        for w in ws:
            out = outs[col]
            col += len(w.parts)
            out_dtype = self.act_dtype(out.name)
            # f32 outputs without a residual are the logits: the GEMV handles them (one row in prefill)
            if out_dtype != "bf16" and not residual:
                return self._linear_gemv(op, mode, ins, outs, ws)
            quant = w.dtype
            if section == "gemm" and quant == "bf16":
                wg = self._gemm_wgmma(w, ins[0], out, residual, out_dtype, res_name)
                if wg is not None:
                    launches.append(wg)
                    continue
            p = self._gemm_params(w, tg, residual, out_dtype, quant)  # bf16, or GGUF decoded in the GEMM
            wptr = _w(w)
            long_rows = self._dequant_wgmma_rows(w, section, quant)
            wg = None
            if long_rows:  # long chunks: the whole matrix dequantised to bf16, then the wgmma GEMM
                wg = self._gemm_wgmma(w, ins[0], out, residual, out_dtype, res_name, source="dequant")
            if wg is not None:
                if p is None or long_rows <= 1:  # (no fused decoder) the dequantised path at every length
                    launches += [self._dequantise(w), wg]
                    continue
                launches += [dataclasses.replace(la, min_rows=long_rows) for la in (self._dequantise(w), wg)]
            if p is None and section != "gemm":  # decode never dequantises a whole matrix per step
                return self._linear_gemv(op, mode, ins, outs, ws)
            if p is None and quant != "bf16":  # fallback: dequantise into a bf16 scratch (embed, ids 0..n-1)
                launches.append(self._dequantise(w))
                wptr = Arg("scratch", "dequant")
                quant = "bf16"
                p = self._gemm_params(w, tg, residual, out_dtype, quant)
            if p is None:  # odd k: the GEMV handles it
                return self._linear_gemv(op, mode, ins, outs, ws)
            name = {
                "q": quant,
                "n": w.rows,
                "k": w.cols,
                "m": p["tile_m"],
                "tn": p["tile_n"],
                "tk": p["tile_k"],
                "s": p["stages"],
                "w": p["warps"],
                "wm": p["warps_m"],
                "ks": p["split_k"],
                "r": int(residual),
                "o": out_dtype,
            }
            spec = self._spec("gemm", name, **p)
            max_rows = long_rows - 1 if wg is not None else 0  # the dequantised path above takes the rest
            smem_of = getattr(self.cat, "gemm_smem", None) if self.cat is not None else None
            smem = (
                smem_of(p)
                if smem_of is not None
                else max(  # a catalog without gemm_smem: the padded layout
                    p["stages"] * (p["tile_m"] + p["tile_n"]) * (p["tile_k"] + 8) * 2,
                    (p["split_k"] - 1) * p["tile_m"] * p["tile_n"] * 4,
                )
            )
            res = Arg("value", res_name) if residual else NULL
            args = (_v(out), _v(ins[0]), wptr, res, ROWS)
            grid = (_cdiv(w.rows, p["tile_n"]), f"(n + {p['tile_m'] - 1}) // {p['tile_m']}")
            launches.append(Launch(spec, grid, (32 * p["warps"],), args, smem, max_rows=max_rows))
        return launches

    def _dequant_wgmma_rows(self, w, section, quant) -> int:
        """The fewest prefill rows from which quantised weight ``w`` is dequantised to bf16 and
        multiplied by the wgmma GEMM (profile gemm_wgmma.dequant_min_rows; 0: never)."""
        if section != "gemm" or quant == "bf16" or getattr(self.cat, "gemm_wgmma_params", None) is None:
            return 0
        return int(self.tune("gemm_wgmma").get("dequant_min_rows") or 0)

    def _dequantise(self, w) -> Launch:
        """The whole of quantised weight ``w`` dequantised into the bf16 "dequant" scratch (the embed
        kernel gathering rows 0..rows-1)."""
        t = self.tune("elementwise")["threads"]
        deq = self._spec(
            "embed", {"q": w.dtype, "h": w.cols, "t": t}, quant=w.dtype, hidden=w.cols, threads=t
        )
        self._need_scratch(ScratchPlan("dequant", fixed=w.rows * w.cols * 2))
        self._need_scratch(ScratchPlan("iota", fixed=w.rows * 4, fill="iota"))
        dargs = (Arg("scratch", "dequant"), _w(w), Arg("scratch", "iota"), Arg("const", w.rows, "i32"))
        return Launch(deq, (w.rows,), (t,), dargs)

    def _gemm_wgmma(self, w, x, out, residual, out_dtype, res_name, source="weight"):
        """The Hopper TMA + wgmma GEMM launch for bf16 weight ``w`` (profile tuning gemm_wgmma), or
        None where it does not apply. A and W reach the kernel as device tensor maps (Arg kind
        "tmap": source, name, box rows), built by the runner at bind time."""
        params_of = getattr(self.cat, "gemm_wgmma_params", None) if self.cat is not None else None
        if params_of is None or x.width != w.cols:
            return None
        p = params_of(w.rows, w.cols, self.profile.tuning, residual=residual, out_dtype=out_dtype)
        if p is None:
            return None
        name = {
            "n": w.rows,
            "k": w.cols,
            "tn": p["tile_n"],
            "c": p["consumers"],
            "mf": p["m_frags"],
            "s": p["stages"],
            "r": int(residual),
            "o": out_dtype,
        }
        spec = self._spec("gemm_wgmma", name, **p)
        tile_m = self.cat.gemm_wgmma_tile_m(p)
        args = (
            _v(out),
            Arg("tmap", ("value", x.name, tile_m)),
            Arg("tmap", ("weight", w.key, p["tile_n"]))
            if source == "weight"
            else Arg("tmap", ("scratch", source, p["tile_n"], w.rows, w.cols)),
            Arg("value", res_name) if residual else NULL,
            ROWS,
        )
        grid = (_cdiv(w.rows, p["tile_n"]), f"(n + {tile_m - 1}) // {tile_m}")
        return Launch(spec, grid, (128 * (p["consumers"] + 1),), args, self.cat.gemm_wgmma_smem(p))

    def _gemm_params(self, w, tg, residual, out_dtype, quant):
        """The gemm params for weight ``w`` from tuning ``tg``, or None when no gemm variant fits
        (a storage type without a fused decoder, a k no tile divides: the caller falls back)."""
        gp = getattr(self.cat, "gemm_params", None) if self.cat is not None else None
        if gp is None:  # a catalog without gemm_params: the tuning as is, bf16 only
            if quant != "bf16" or w.cols % tg["tile_k"]:
                return None
            knobs = ("tile_m", "tile_n", "tile_k", "stages", "warps", "warps_m", "split_k")
            p = dict(n=w.rows, k=w.cols, residual=residual, out_dtype=out_dtype, quant=quant)
            return {**p, **{x: tg[x] for x in knobs}}
        if quant not in getattr(self.cat, "QUANTS", {"bf16": None}):
            return None
        try:
            p = gp(w.rows, w.cols, {"gemm": tg}, residual=residual, out_dtype=out_dtype, quant=quant)
            self.cat.spec("gemm", **p)
        except ConfigError:
            return None
        return p

    def _linear_gemv(self, op, mode, ins, outs, ws, layer=None):
        # one launch per weight allocation; a fused allocation writes its outputs' shared buffer
        launches, col = [], 0
        for w in ws:
            launches.append(self._gemv_launch(op, layer, mode, ins, outs[col], w))
            col += len(w.parts)
        pair = self._pair(op, layer, mode, ins, outs, ws, launches)
        return [pair] if pair is not None else self._fork(mode, launches)

    def _gemv_launch(self, op, layer, mode, ins, out, w, part_threads: int = 0) -> Launch:
        """The GEMV launch of weight allocation ``w`` writing ``out`` (``part_threads``: a coop q8x
        layout in blocks of that many threads, for a gemv_pair part; 0: the tuning's)."""
        tg = self.tune("gemv")
        res_name = op.attrs.get("residual")
        residual = res_name is not None
        out_dtype = self.act_dtype(out.name)
        bmax = 1 if mode == "decode1" else tg["max_batch"]
        rpb = tg["rows_per_block"]
        pro = self.prologue.get((mode, ins[0].name)) if mode in PROLOGUE_MODES else None
        xv, extra, pp = ins[0], (), {}
        if pro is not None and pro[0] == "glu" and pro[1].width == w.cols:
            xv = pro[1]  # the gate half of gate|up already holds silu(gate) * up
            pp = dict(x_stride=xv.ld)
        elif pro is not None and pro[1].width == w.cols:
            xv = pro[1]
            pp = dict(prologue=pro[0], x_stride=xv.ld)
            if pro[0] == "norm":
                pp["eps"] = repr(float(self.dims["rms_eps"]))
                extra = (_w(pro[2]),)
            else:
                pp["u_off"] = pro[2]
        elif pro is not None:
            raise ConfigError(
                f"plan: fused {pro[0]} of width {pro[1].width} feeds a linear of k={w.cols}"
            )
        opts: dict[str, Any] = {}
        gl = getattr(self.cat, "gemv_layout", None) if self.cat is not None else None
        layout = gl(w.dtype, self.profile.tuning, n=w.rows, bmax=bmax) if gl is not None else {}
        if layout.get("coop"):  # the warp-cooperative layout (tuning gemv_coop)
            rpb, threads, unroll = layout["rows_per_block"], layout["threads"], layout["unroll"]
            opts = dict(
                coop=True,
                stage=False,
                **self.cat.coop_options(
                    self.profile.tuning,
                    bmax,
                    w.cols,
                    w.dtype,
                    n=w.rows,
                    sm_count=self.profile.sm_count,
                    threads=part_threads,
                ),
            )
            threads, rpb = opts.pop("threads", threads), opts.pop("rows_per_block", rpb)  # q8x shape
            unroll = opts.pop("unroll", unroll)  # (q8x_b1_unroll)
            if mode not in PROLOGUE_MODES:  # the k split's scratch is sized for decode rows
                opts.pop("kparts", None)
            if pp.get("prologue") != "norm":  # early norm weights: only a norm prologue has them
                opts.pop("early_nw", None)
            if not residual:  # the early residual: only a GEMV that adds one
                opts.pop("early_res", None)
            if mode == "decode1" and self._graph_knob("early_trigger"):
                opts["trigger"] = True  # the next kernel may launch once the first loads are out
            if (
                mode == "decode1"
                and opts.get("q8x")
                and self.tune("gemv_coop").get("q8x_glu")
                and opts.get("ksplit", 1) == 1
                and opts.get("kparts", 1) == 1
                and not opts.get("wsm")
            ):  # the gate|up GEMV stores silu(gate) * up (a glu epilogue over its tile's row pairs)
                glu = self._glu_for(op, layer, mode, w, residual, out_dtype, rpb)
                if glu:
                    pp["glu"] = glu
        else:
            threads, unroll = layout.get("threads", tg["threads"]), tg.get("unroll", 2)
            glu = self._glu_for(op, layer, mode, w, residual, out_dtype)  # a classic-layout epilogue
            if glu:
                pp["glu"] = glu
            go = getattr(self.cat, "gemv_options", None) if self.cat is not None else None
            if go is not None:  # xsmem / prefetch from the tuning (off by default)
                staged = getattr(self.cat, "STAGED_DEFAULT", {}).get(w.dtype, False)
                opts = go({**tg, "threads": threads}, staged, bmax, w.cols, w.dtype)
        spec = self._spec(
            "gemv",
            {
                "q": w.dtype,
                "n": w.rows,
                "k": w.cols,
                "b": bmax,
                "t": threads,
                "r": int(residual),
                "o": out_dtype,
                "rp": rpb,
                "u": unroll,
                **({"p": pp["prologue"]} if pp.get("prologue") else {}),
                **({"c": 1} if layout.get("coop") else {}),
            },
            quant=w.dtype,
            n=w.rows,
            k=w.cols,
            bmax=bmax,
            threads=threads,
            rows_per_block=rpb,
            residual=residual,
            out_dtype=out_dtype,
            unroll=unroll,
            **pp,
            **opts,
        )
        res = Arg("value", res_name) if residual else NULL
        args = (_v(out), _w(w), _v(xv), res, ROWS) + extra
        gx = getattr(self.cat, "gemv_grid_x", None) if self.cat is not None else None
        grid: tuple = (gx(spec.params) if gx else _cdiv(w.rows, rpb), f"(n + {bmax - 1}) // {bmax}")
        parts = int(spec.params.get("kparts", 1))
        if parts > 1:  # k split over grid.z: partial sums and per-tile counters (zeroed once)
            row_groups = _cdiv(self.max_rows, bmax)
            self._need_scratch(ScratchPlan("kpart_sum", fixed=parts * self.max_rows * w.rows * 4))
            tiles = _cdiv(w.rows, spec.params["rows_per_block"])
            self._need_scratch(ScratchPlan("kpart_count", fixed=tiles * row_groups * 4, fill="zero"))
            args += (Arg("scratch", "kpart_sum"), Arg("scratch", "kpart_count"))
            grid += (parts,)
        if spec.params.get("glu"):
            self.glu_done.add((mode, out.name))
        smem = self.cat.gemv_smem(spec.params) if opts.get("xsmem") or opts.get("q8x") else 0
        # a capped coop grid loops over row tiles: the runner may fit it to the resident blocks
        fit = bool(spec.params.get("grid_cap")) and bool(
            self.profile.tune("gemv_coop").get("q8x_resident_grid")
        )
        return Launch(spec, grid, (threads,), args, smem, fit_grid=fit)

    def _pair(self, op, layer, mode, ins, outs, ws, launches: list[Launch]) -> Launch | None:
        """A batch-1 linear op's two GEMV launches as one gemv_pair launch (tuning
        decode_graph.pair_linears; kernels/gemv_pair.cu.j2), or None where they stay apart.

        The two separately stored weights of a q4_k_m layer's q|k and v read the same x: as one
        grid they stream side by side with no stream fork or join, and the next kernel launches
        early behind them. The second part is re-planned in the first's block shape. Pairs only
        coop q8x GEMVs without a residual, glu, a k split over blocks or a tile loop, and only where
        every block of the pair is resident at once when a part copies its row tile to shared
        memory (wsm: a block waiting for a slot would wait for its copy). decode_graph.
        pair_min_smem_kb may raise its shared memory so that its blocks spread over more SMs, and
        pair_min_blocks sets the kernel's __launch_bounds__ minimum of blocks per SM."""
        if mode != "decode1" or len(launches) != 2 or not self._graph_knob("pair_linears"):
            return None
        a = launches[0]
        if not hasattr(self.cat, "pair_with_min_blocks") or not self._pairable(a.spec.params):
            return None
        b = self._gemv_launch(op, layer, mode, ins, outs[len(ws[0].parts)], ws[1], part_threads=a.block[0])
        if not self._pairable(b.spec.params) or b.block != a.block or b.args[2] != a.args[2]:
            return None
        min_blocks = int(self.tune("decode_graph").get("pair_min_blocks") or 0)
        try:  # (the pair kernel's __launch_bounds__ minimum: both parts carry it)
            spec = self.cat.pair_with_min_blocks([a.spec, b.spec], min_blocks)
        except ConfigError:
            return None
        smem = self.cat.pair_smem(spec)
        blocks = spec.params["blocks_a"] + spec.params["blocks_b"]
        if (a.spec.params["wsm"] or b.spec.params["wsm"]) and not self.cat.one_round(
            self.profile.tuning, smem, blocks, self.profile.sm_count
        ):
            return None
        smem = self.cat.spread_smem(self.profile.tuning, smem, blocks, self.profile.sm_count)
        return Launch(spec, (blocks, a.grid[1]), a.block, a.args + b.args, smem)

    def fuse_pair_attention(self, steps: list[Step], values: Mapping[str, Value]) -> None:
        """Tuning decode_graph.pair_attention: give each layer whose batch-1 q|k|v linear is one
        gemv_pair launch and whose short-context attention is the direct rope-fused kernel a SHORT1
        launch of kernels/gemv_pair_attention.cu.j2 that runs both, and its attention step an empty
        SHORT1 (its rope step's short launches are already empty). The pair's q|k part must write
        q with k right after it and its v part v, the rows the attention reads. The kernel's
        __launch_bounds__ minimum is at least the blocks per SM its grid needs to run in one round
        (the attention part takes registers), and its unit counters are one zeroed scratch."""
        spec_of = getattr(self.cat, "pair_attention_spec", None) if self.cat is not None else None
        if spec_of is None or not self._graph_knob("pair_attention"):
            return
        d = self.dims
        for i, st in enumerate(steps):
            pair = st.launches.get("decode1", ())
            if st.op.op != "linear" or len(pair) != 1 or pair[0].spec.template != "gemv_pair":
                continue
            attn = next((s for s in steps[i + 1 :] if s.layer == st.layer and s.op.op == "attention"), None)
            short = attn.launches.get("short", ()) if attn is not None else ()
            if len(short) != 1 or not short[0].spec.params.get("rope") or not short[0].spec.params.get("direct"):
                continue
            la, at = pair[0], short[0]
            pa = dict(zip((n for n, _ in self.cat.kernel_args(la.spec)), la.args, strict=True))
            aa = dict(zip((n for n, _ in self.cat.kernel_args(at.spec)), at.args, strict=True))
            q, k = values.get(aa["q"].ref), values.get(aa["k_in"].ref)
            if (
                q is None
                or k is None
                or pa["a_out"] != aa["q"]
                or pa["b_out"] != aa["v_in"]
                or k.buffer != q.buffer
                or k.offset != q.offset + d["heads"] * d["head_dim"]
            ):
                continue
            parts = self.cat.pair_parts(la.spec)
            blocks = la.grid[0]
            floor = -(-blocks // self.profile.sm_count) if self.profile.sm_count else 0
            try:  # (both parts have one minimum: pair_spec's rule)
                pair = self.cat.pair_with_min_blocks(parts, max(floor, parts[0].params["min_blocks"]))
                spec = spec_of(pair, at.spec)
            except ConfigError:
                continue
            smem = la.smem + self.cat.attention_static_smem(at.spec.params)
            if not self.cat.one_round(self.profile.tuning, smem, blocks, self.profile.sm_count):
                continue
            units = d["kv_heads"] * at.spec.params["qsplit"]
            self._need_scratch(ScratchPlan("attn_count", fixed=units * 4, fill="zero"))
            args = la.args + at.args + (Arg("scratch", "attn_count"),)
            st.launches[SHORT1] = (Launch(spec, la.grid, la.block, args, la.smem),)
            attn.launches[SHORT1] = ()

    def trigger_short1_attention(self, steps: list[Step], weights: Mapping[str, WeightPlan]) -> None:
        """Tuning attention_decode.trigger_b1: each attention step whose short-context launch is
        the direct kernel gets a SHORT1 launch, the same kernel with ``trigger`` (pdl_trigger() at
        its start, so the o GEMV's blocks launch beside it and fetch their weights early); the
        other batch sizes keep the launch without it. Not where SHORT1 is already set (the
        pair_attention fusion runs the attention itself), nor outside the o window (o_window)."""
        if self.cat is None or not self.tune("attention_decode").get("trigger_b1"):
            return
        for i, st in enumerate(steps):
            short = st.launches.get("short", ())
            if st.op.op != "attention" or SHORT1 in st.launches or len(short) != 1:
                continue
            if not self.o_window(steps, i, weights):
                continue
            la = short[0]
            if not la.spec.params.get("direct") or la.spec.params.get("trigger"):
                continue
            spec = self._spec("attention", {}, **{**la.spec.params, "trigger": True})
            st.launches[SHORT1] = (dataclasses.replace(la, spec=spec),)

    @staticmethod
    def _pairable(p: dict) -> bool:
        """Whether a gemv spec's params allow it as a gemv_pair part (see _pair)."""
        return (
            bool(p.get("coop") and p.get("q8x"))
            and not p["residual"]
            and not p["glu"]
            and p["kparts"] == 1
        )

    def _fork(self, mode: str, launches: list[Launch]) -> list[Launch]:
        """A decode linear's launches after the first marked concurrent (tuning
        decode_graph.fork_linears): one per separately stored weight (q|k and v of a q4_k_m file),
        all reading the same x. Not where a launch uses scratch (the k split's partial sums are one
        buffer), nor in prefill."""
        on = self._graph_knob("fork_linears")
        if not on or mode == "prefill" or len(launches) < 2:
            return launches
        if any(a.kind == "scratch" for la in launches for a in la.args):
            return launches
        return [launches[0], *(dataclasses.replace(la, concurrent=True) for la in launches[1:])]

    def _glu_for(self, op, layer, mode, w, residual: bool, out_dtype: str, rpb: int = 0) -> int:
        """The glu epilogue width of a decode gate|up GEMV whose output only a fusable silu_mul reads
        (tuning gemv.fuse_glu; build_plan fills glu_ops): the intermediate size, else 0. ``rpb``:
        the GEMV's rows per block (default: gemv.rows_per_block), which must be even."""
        if mode not in PROLOGUE_MODES or (id(op), layer) not in self.glu_ops or residual:
            return 0
        if len(w.part_rows) != 2 or w.part_rows[0] != w.part_rows[1] or out_dtype != "bf16":
            return 0
        if (rpb or self.tune("gemv")["rows_per_block"]) % 2:
            return 0
        return w.part_rows[0]

    def _op_head_rmsnorm(self, op, layer, mode, ins, outs, ws):
        # fused into the rope kernel that follows (qk_norm); remember which value it normalises
        if outs[0].name != ins[0].name:
            raise ConfigError(
                "plan: head_rmsnorm must write its input in place (out == in) to fuse into rope"
            )
        self.pending_norm[(layer, mode, ins[0].name)] = ws[0]
        return []

    def _op_rope(self, op, layer, mode, ins, outs, ws):
        d = self.dims
        q, k = ins
        v = self.rope_v.get(layer)
        if v is None:
            raise ConfigError("plan: rope is not followed by an attention op (the KV write needs its v)")
        qn = self.pending_norm.pop((layer, mode, q.name), None)
        kn = self.pending_norm.pop((layer, mode, k.name), None)
        if (qn is None) != (kn is None):
            raise ConfigError("plan: head_rmsnorm on only one of q and k is not supported by the CUDA plan")
        t = self.tune("elementwise")["threads"]
        theta = float(d["rope_theta"])
        eps = float(d["rms_eps"])
        params = dict(
            heads=d["heads"],
            kv_heads=d["kv_heads"],
            head_dim=d["head_dim"],
            rope_dim=d["rope_dim"],
            theta=repr(theta),
            style=self.rope_style,
            q_stride=q.ld,
            kv_stride=k.ld,
            qk_norm=qn is not None,
            eps=repr(eps),
            freq_factors=self.freq is not None,
            kv_write=True,
            threads=t,
            **({"v_stride": v.ld} if v.ld != k.ld else {}),
        )
        name = {
            "h": d["heads"],
            "kv": d["kv_heads"],
            "d": d["head_dim"],
            "s": self.rope_style[0],
            "qs": q.ld,
            "ks": k.ld,
            "n": int(qn is not None),
            **({"vs": v.ld} if v.ld != k.ld else {}),
        }
        norms = (_w(qn) if qn else NULL, _w(kn) if kn else NULL)
        freq = _w(self.freq) if self.freq is not None else NULL
        if mode == "short" and self._rope_fuses(q, k) and v.ld % 8 == 0:
            # short-context decode: the direct attention kernel that follows rotates q / k itself
            # and writes the cache (the split kernels do not: every split block would redo the rope)
            fused = {
                key: params[key] for key in getattr(self.cat, "ATTENTION_ROPE_PARAMS", ()) if key in params
            }
            extra = (_v(k), _v(v), *norms, freq, Arg("input", "slots"))
            self.rope_fused[layer] = ({"rope": True, **fused}, extra)
            return []
        spec = self._spec("rope", name, **params)
        args = (
            _v(q),
            _v(k),
            _v(v),
            Arg("input", "positions"),
            *norms,
            freq,
            Arg("kv", "k", layer=layer),
            Arg("kv", "v", layer=layer),
            Arg("input", "slots"),
            ROWS,
        )
        blocks = getattr(self.cat, "rope_head_blocks", None)  # the kernel strides by grid.y: 1 works
        return [Launch(spec, ("n", blocks(params) if blocks else 1), (t,), args)]

    def _op_silu_mul(self, op, layer, mode, ins, outs, ws):
        g, u = ins
        t = self.tune("elementwise")["threads"]
        inter = g.width
        self.prologue.pop((mode, outs[0].name), None)
        off = u.offset - g.offset
        if mode in PROLOGUE_MODES and (mode, g.name) in self.glu_done:
            self.glu_done.discard((mode, g.name))
            # the gate|up GEMV stored silu(gate) * up in the gate half: the down GEMV reads it there
            self.prologue[(mode, outs[0].name)] = ("glu", g, 0)
            return []
        if (
            mode in PROLOGUE_MODES
            and self._fused(op, layer, mode)
            and g.buffer == u.buffer
            and g.ld == u.ld
            and u.width == inter
            and off >= inter
            and off + inter <= g.ld
            and off % 8 == 0
            and g.offset % 8 == 0
            and g.ld % 8 == 0
        ):  # fused into the down projection's GEMV (x = silu(gate) * up while loading)
            self.prologue[(mode, outs[0].name)] = ("silu", g, off)
            return []
        spec = self._spec("silu_mul", {"i": inter, "s": g.ld, "t": t}, inter=inter, in_stride=g.ld, threads=t)
        args = (_v(outs[0]), _v(g), _v(u), ROWS)
        return [Launch(spec, (_cdiv(inter, 8 * t), "n"), (t,), args)]

    def _vec16(self, q: Value) -> bool:
        """16-byte K/V loads in decode attention (profile attention_decode.vec16) for this q."""
        hd = self.dims["head_dim"]
        return bool(self.tune("attention_decode").get("vec16")) and hd in (32, 64, 128, 256) and q.ld % 8 == 0

    def _rope_fuses(self, q: Value, k: Value) -> bool:
        """Whether short-context decode rope folds into the direct attention kernel (tuning
        attention_decode.fuse_rope, on the vec16 path the fused kernel is written for)."""
        return bool(self.tune("attention_decode").get("fuse_rope")) and self._vec16(q) and k.ld % 8 == 0

    def _op_attention(self, op, layer, mode, ins, outs, ws):
        d = self.dims
        q, _k, _v_ = ins
        out = outs[0]
        heads, kvh, hd = d["heads"], d["kv_heads"], d["head_dim"]
        scale = float(hd) ** -0.5
        common = dict(
            heads=heads,
            kv_heads=kvh,
            head_dim=hd,
            block_size=self.profile.kv_block_size,
            scale=repr(scale),
            q_stride=q.ld,
            out_stride=out.ld,
        )
        cache = (
            Arg("kv", "k", layer=layer),
            Arg("kv", "v", layer=layer),
            Arg("input", "block_tables"),
            Arg("input", "positions"),
            Arg("shape", "max_blocks", "i32"),
        )
        vec16 = self._vec16(q)
        if mode == "prefill":
            # flash attention on tensor cores, varlen: grid (q tiles, heads, sequences of the pass)
            pt = self.tune("attention_prefill")
            bq, bkv, pw = pt["block_q"], pt["block_kv"], pt["warps"]
            spec = self._spec(
                "attention_prefill",
                {"h": heads, "kv": kvh, "d": hd, "bq": bq, "bkv": bkv, "w": pw, "qs": q.ld, "os": out.ld},
                block_q=bq,
                block_kv=bkv,
                warps=pw,
                **common,
            )
            args = (_v(out), _v(q)) + cache[:4] + (Arg("input", "seq_starts"), cache[4])
            grid = (f"(max_q + {bq - 1}) // {bq}", heads, "nseq")
            smem = (bq + 4 * bkv) * (hd + 8) * 2
            return [Launch(spec, grid, (32 * pw,), args, smem)]
        if mode == "short":
            # direct: one block per (row, kv head) covers the whole key range, no combine; the rope
            # before this op may be folded in (_op_rope set rope_fused)
            rope, rope_args = self.rope_fused.get(layer, ({}, ()))
            t = self.tune("attention_decode")
            warps = t.get("direct_warps") or t["warps"]
            dq = getattr(self.cat, "direct_qsplit", None) if self.cat is not None else None
            qsplit = dq(heads // kvh, self.profile.tuning) if dq is not None else 1
            kmode = "decode"
            spec = self._spec(
                "attention",
                {"m": kmode[0], "h": heads, "kv": kvh, "d": hd, "w": warps, "qs": q.ld},
                split=t["split_kv_tokens"],  # one staged table chunk
                mode=kmode,
                direct=True,
                warps=warps,
                vec16=vec16,
                qsplit=qsplit,
                **common,
                **rope,
                table_first=bool(t.get("table_first")),
                trigger=bool(t.get("trigger")),
            )
            args = (_v(out), NULL, NULL, _v(q)) + cache + (Arg("const", 1, "i32"),) + rope_args
            return [Launch(spec, ("n", kvh, qsplit), (32 * warps,), args)]
        tune = self.tune("attention_decode")
        warps, split = tune["warps"], tune["split_kv_tokens"]
        spec = self._spec(
            "attention",
            {"m": "d", "h": heads, "kv": kvh, "d": hd, "w": warps, "qs": q.ld, "s": split},
            split=split,
            mode="decode",
            direct=False,
            warps=warps,
            vec16=vec16,
            **common,
            table_first=bool(tune.get("table_first")),
        )
        rows = self.max_rows
        self._need_scratch(ScratchPlan("attn_o", per_split=rows * heads * hd * 4, split=split))
        self._need_scratch(ScratchPlan("attn_ml", per_split=rows * heads * 2 * 4, split=split))
        splits = Arg("shape", f"splits:{split}", "i32")
        part = (Arg("scratch", "attn_o"), Arg("scratch", "attn_ml"))
        args = (NULL,) + part + (_v(q),) + cache + (splits,)
        grid = ("n", kvh, f"(max_ctx + {split - 1}) // {split}")
        comb = self._spec(
            "attention_combine",
            {"h": heads, "d": hd, "s": split, "os": out.ld},
            heads=heads,
            head_dim=hd,
            split=split,
            out_stride=out.ld,
        )
        cargs = (_v(out),) + part + (Arg("input", "positions"), splits)
        return [Launch(spec, grid, (32 * warps,), args), Launch(comb, ("n", heads), (hd,), cargs)]

    def wide_launches(self, op, layer, ins, outs, ws):
        """The WIDE (large decode bucket) lowering: bf16 linear layers as gemm_decode GEMMs, the
        norms and SiLU-mul materialised as in prefill (the GEMMs read them), the rest as decode."""
        if op.op == "linear":
            return self._linear_gemm(op, WIDE, ins, outs, ws, section="gemm_decode")
        if op.op in ("rmsnorm", "silu_mul"):
            return self.launches(op, layer, "prefill", ins, outs, ws)
        return self.launches(op, layer, WIDE, ins, outs, ws)

    def sampling(self, logits: Value) -> dict[str, tuple[Launch, ...]]:
        t = self.tune("sampling")["threads"]
        vocab = logits.width
        if logits.ld != vocab or logits.dtype != "f32":
            raise ConfigError("plan: the sampler needs contiguous f32 logits")
        amax = self._spec("argmax", {"v": vocab, "t": t}, vocab=vocab, ld=logits.ld, threads=t)
        samp = self._spec("sample", {"v": vocab, "t": t}, vocab=vocab, ld=logits.ld, threads=t)
        out = Arg("input", "out_ids")
        greedy = Launch(amax, ("n",), (t,), (out, _v(logits), ROWS))
        inputs = tuple(
            Arg("input", n) for n in ("temperature", "top_k", "top_p", "min_p", "seeds", "counters")
        )
        sample = Launch(samp, ("n",), (t,), (out, _v(logits)) + inputs + (ROWS,))
        # penalised: the sparse penalties kernel (entries uploaded per step) in place, then sample
        et = self.tune("elementwise")["threads"]
        pen = self._spec("penalties", {"v": vocab, "t": et}, ld=logits.ld, threads=et)
        pargs = (
            (_v(logits), Arg("input", "pen_entries"))
            + tuple(Arg("input", n) for n in ("presence", "frequency", "repetition"))
            + (Arg("const", PENALTY_CAPACITY, "i32"),)
        )
        penalise = Launch(pen, (PENALTY_BLOCKS,), (et,), pargs)
        return {"greedy": (greedy,), "sample": (sample,), "penalised": (penalise, sample)}


def describe(plan: Plan) -> str:
    """A stable text rendering (golden tests, `memra plan`): weights, buffers, steps, kernels."""
    lines = [
        f"plan {plan.family} {plan.quant} on {plan.profile}: max_tokens={plan.max_tokens} block={plan.block_size}"
        + (f" wide_rows={plan.wide_rows}" if plan.wide_rows else "")
    ]
    for w in plan.weights:
        lines.append(f"weight {w.key} {w.dtype} [{w.rows}, {w.cols}] {w.nbytes} B")
    for b in plan.buffers:
        lines.append(f"buffer {b.name} {b.dtype} x{b.width}")
    for s in plan.steps:
        where = f"L{s.layer}" if s.layer is not None else ("head" if s.head else "pre")
        for mode in MODES + ((WIDE,) if plan.wide_rows else ()):
            names = ",".join(launch.spec.entry for launch in s.launches.get(mode, ()))
            lines.append(f"step {where} {s.op.op} {mode}: {names}")
    for kind, launches in plan.sampling.items():
        lines.append(f"sampling {kind}: {','.join(launch.spec.entry for launch in launches)}")
    return "\n".join(lines)
