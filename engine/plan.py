"""Plan: a ModelGraph + dims + quant combo + device profile, lowered to weights, buffers and launches.

``build_plan`` works from dims alone (no weights, no GPU), so `memra warmup` can list every kernel
(``engine.ir.kernel_specs``) and golden tests can pin a plan (tools/plan_golden.py). It decides how
weights are uploaded (q|k|v and gate|up fused into one matrix when their storage types agree; raw
GGUF blocks uploaded as-is), which activation values share which arena buffer, which decode
rmsnorm / silu_mul ops fold into the GEMVs that read them, and the schedule (layer-major); then
each op is lowered by its unit of ``engine.lowering`` (registered by the YAML op name) in every
mode (``engine.ir``), and the registered post-passes run; last, up to how many rows a decode pass
runs the layers' batch-1 launches (``Plan.b1_rows``). Must not import CUDA or numpy.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import engine.lowering  # noqa: F401  (registers every lowering unit)
from engine.dsl_expr import evaluate
from engine.graph import ModelGraph, Op, QuantCombo
from engine.ir import (
    MODES,
    ROPE_FREQ,
    VSHORT,
    WIDE,
    BufferPlan,
    Plan,
    Step,
    Value,
    WeightPlan,
)
from engine.kernel_catalog import GEMM_DECODE_MIN_ROWS, QUANTS
from engine.lowering.context import Lowerer
from engine.lowering.registry import POST_PASSES, lowering_for
from engine.lowering.sampling import lower_sampling
from engine.profile import DeviceProfile
from engine.types import ConfigError

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
    d.setdefault("rms_eps", 1e-5)
    d.setdefault("rope_theta", 10000.0)
    d.setdefault("rope_scaling", None)
    d.setdefault("tie_embeddings", False)
    if d.get("rope_dim") in (None, 0):  # (missing, or null in the config)
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
    delta_prefill: str = "",
) -> Plan:
    """Lower ``graph`` for ``profile``.

    ``tensor_dtypes`` maps ``"<tensor key>@<layer>"`` (or ``"<tensor key>"`` for all layers) to the
    storage type read from a file; without it each tensor takes its combo's first allowed type and
    vectors are f32. ``delta_prefill``: the hybrids' gated delta
    rule in prefill, "recurrent" or "chunked" ("": engine.linear_attn_kernels.DELTA_PREFILL_DEFAULT). The graph's ``inputs`` (activation values
    it reads but no op writes, {name: width expression}) get values of their own buffers: the
    runner writes their rows before a pass (the MTP head's ``eh``, engine.spec.mtp_cuda). Raises
    ConfigError.
    """
    d = _full_dims(dims)
    chunk = profile.prefill_chunk_tokens
    max_tokens = max(chunk, max(profile.cuda_graph_batch_sizes))
    lowerer = Lowerer(profile, d, rope_style, max_tokens, delta_prefill)
    ops = graph.ops()
    last_layer_index = max((i for i, (_, per) in enumerate(ops) if per), default=-1)

    weights: dict[str, WeightPlan] = {}
    buffers: dict[str, BufferPlan] = {}
    values: dict[str, Value] = {}
    steps: list[Step] = []

    def value_for(
        name: str, width: int, buffer: str | None = None, offset: int = 0, ld: int | None = None, dtype: str = ""
    ):
        if dtype:  # a unit's non-bf16 value (MoE expert ids i32, router weights f32)
            lowerer.value_dtypes[name] = dtype
        dtype = lowerer.act_dtype(name)
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

    # numerics.f32_values: activation values stored in f32 (Gemma's residual stream); only the ops
    # whose units have an f32 form may touch them (each unit checks its side: embed writes one,
    # rmsnorm reads one, add reads and writes one with a bf16 second input)
    f32_values = set(graph.numerics.get("f32_values", ()))
    written = {n for o, _ in ops for n in o.outputs}
    for name in sorted(f32_values):
        if name not in written:
            raise ConfigError(f"{graph.path}: numerics.f32_values: no op writes a value {name!r}")
        lowerer.value_dtypes[name] = "f32"
    for o, _ in ops:
        touched = f32_values & {*o.inputs, *o.outputs, o.attrs.get("residual")}
        if touched and o.op not in ("embed", "rmsnorm", "add"):
            raise ConfigError(
                f"{graph.path}: numerics.f32_values: op {o.op} reads or writes {sorted(touched)[0]!r}, "
                "which has no f32 form there (only embed, rmsnorm, add)"
            )
    for name, width in graph.inputs.items():
        value_for(name, int(evaluate(width, dict(d))))
    fuse_groups: dict[int, list[list[int]]] = {}

    def type_runs(op: Op, per_layer: bool) -> list[list[int]]:
        """op's weights as runs of consecutive ones that share one storage type in every layer (once
        per op): each run is fused into one allocation. A fusion is decided for all layers at once:
        the outputs are bound once, as column views of one buffer per run, so one layer's split
        q/k/v could not share the others' layout. A q4_k_m file whose attn_v is q6_k in some layers
        fuses q|k and keeps v apart."""
        if id(op) not in fuse_groups:
            layers = [lay for lay in range(int(d["layers"])) if graph.op_runs(op, d, lay)] if per_layer else [None]
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
            elif len(shape) == 3:  # stacked experts [E, N, K]: E * N rows of K, experts back to back
                prow = (shape[0] * shape[1],)
                rows, cols = prow[0], shape[2]
            else:
                prow = tuple(shapes[i][0] for i in g)
                rows, cols = sum(prow), shape[1]
            offset = _norm_offset(op, d) if len(shape) == 1 else 0.0
            if key not in weights:  # (the expert kernels read a stack's file blocks as they are)
                dtype = dts[g[0]] if len(shape) == 3 else lowerer.upload_type(dts[g[0]], cols, rows)
                weights[key] = WeightPlan(key, layer, tuple(resolved), dtype, rows, cols, prow, offset)
            elif weights[key].offset != offset:
                raise ConfigError(f"{graph.path}: vector {key} is read with norm offsets {weights[key].offset} and {offset}")
            out.append(weights[key])
        return out

    schedule: list[tuple[Op, int | None, bool]] = []
    for index, (op, per_layer) in enumerate(ops):
        if not per_layer:
            schedule.append((op, None, index > last_layer_index))
        elif index == 0 or not ops[index - 1][1]:  # first op of a repeat body: expand layer-major
            body = [o for o, _ in _run_of_layer_ops(ops, index)]
            schedule.extend(
                (o, layer, False) for layer in range(d["layers"]) for o in body if graph.op_runs(o, d, layer)
            )
    if _needs_freq_factors(graph, d, tensor_dtypes):
        half = int(d["rope_dim"]) // 2
        weights[ROPE_FREQ] = WeightPlan(ROPE_FREQ, None, (ROPE_FREQ,), "f32", 1, half, (1,))
        lowerer.freq = weights[ROPE_FREQ]
    # numerics.exact_x: those matrices' linears are lowered with the int8-x (q8x) GEMV path off
    exact = set(graph.numerics.get("exact_x", ()))
    exact_ids = {id(o) for o, _, _ in schedule if o.op == "linear" and exact & set(o.weights)}
    exact_profile = _without_q8x(profile) if exact_ids else profile
    readers: dict = {}
    fusable = _prologue_fusable(schedule, readers)
    if profile.tune("gemv_coop").get("q8x_fuse"):  # where every reader stages x itself anyway (batch 1)

        def q8x_reader(o: Op, lay: int | None) -> bool:
            for w in o.weights:
                w = graph.tensors[w].tied_to if _tied(graph, w, d) else w  # a tied lm_head reads embed
                shape = _tensor_shape(graph, w, d)
                cols, rows = shape[-1], (shape[0] if len(shape) == 2 else 0)
                dt = lowerer.upload_type(_dtype_of(graph, quant, w, lay, tensor_dtypes), cols, rows)
                if id(o) in exact_ids or not lowerer.q8x_decode(dt, cols):
                    return False
            return True

        lowerer.fusable1 = {k for k in fusable if all(q8x_reader(o, lay) for o, lay in readers[k])}
    if profile.tune("gemv").get("fuse_glu"):
        lowerer.glu_ops = _glu_linears(schedule, fusable)
    wide_rows = _wide_decode_rows(graph, quant, d, profile, tensor_dtypes)
    for pos, (op, layer, head) in enumerate(schedule):
        if op.op == "rope":
            attn = next((o for o, lay, _ in schedule[pos:] if o.op == "attention" and lay == layer), None)
            if attn is not None and attn.inputs[2] in values:
                lowerer.rope_v[layer] = values[attn.inputs[2]]
            if attn is not None:
                lowerer.rope_window[layer] = int(d.get(attn.attrs.get("window", ""), 0) or 0)
        lowerer.profile = exact_profile if id(op) in exact_ids else profile
        ws = plan_weight(op, layer) if op.weights else []
        ins = [values[n] for n in op.inputs if n in values]
        unit = lowering_for(op.op, op.attrs)
        outs = unit.bind(op, ws, ins, d, value_for)
        launches = {mode: tuple(lowerer.launches(op, layer, mode, ins, outs, ws)) for mode in MODES}
        if wide_rows:
            launches[WIDE] = tuple(lowerer.wide_launches(op, layer, ins, outs, ws))
        if unit.short:  # decode variant for short contexts (every row's position < split): direct
            # attention, with the rope (and the q/k head norms it applies) folded in where
            # attention_decode.fuse_rope
            launches["short"] = tuple(lowerer.launches(op, layer, "short", ins, outs, ws))
            if profile.tune("attention_decode").get("fuse_rope"):  # (the verify pass's, unfused)
                launches[VSHORT] = tuple(lowerer.launches(op, layer, VSHORT, ins, outs, ws))
        steps.append(Step(op, layer, head, launches))
    lowerer.profile = profile

    for _, post in POST_PASSES:
        post(lowerer, steps, weights, values)
    if "logits" not in values:
        raise ConfigError(f"{graph.path}: graph never produces logits")
    b1_rows = _b1_rows(profile, steps, weights, lowerer.states, wide_rows)
    sampling = lower_sampling(lowerer, values["logits"])
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
        scratch=tuple(lowerer.scratch.values()),
        short_context=profile.tune("attention_decode")["split_kv_tokens"],
        max_tokens=max_tokens,
        block_size=profile.kv_block_size,
        graph_batch_sizes=profile.cuda_graph_batch_sizes,
        wide_rows=wide_rows,
        b1_rows=b1_rows,
        states=tuple(lowerer.states.values()),
    )




def _prologue_fusable(
    schedule: list[tuple[Op, int | None, bool]], readers: dict | None = None
) -> dict[tuple[int, int | None], str]:
    """(id(op), layer) of the rmsnorm / silu_mul ops whose output only linear layers read (as their
    x) before it is written again, in the same head/non-head part, while nothing rewrites the op's
    inputs in between, mapped to the op kind: in decode modes those get no launch when the profile's
    gemv_coop.q8x_fuse is on and every reader
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


# the kernels whose batch-1 launches take n decode rows as n grid rows (engine.ir.pass_key)
_B1_ROWS_KERNELS = frozenset(
    ("embed", "rmsnorm", "gemv", "gemv_pair", "rope", "attention", "attention_combine", "silu_mul", "add")
)


def _b1_rows(
    profile: DeviceProfile, steps: list[Step], weights: Mapping[str, WeightPlan], states: Mapping, wide_rows: int
) -> int:
    """Plan.b1_rows: decode_graph.b1_rows where every layer matrix holds at most
    decode_graph.b1_rows_kb KB and every layer launch of the batch-1 pass is one of
    _B1_ROWS_KERNELS (no recurrent state, no experts), below the wide buckets; else 0."""
    rows, kb = int(profile.tune("decode_graph").get("b1_rows") or 0), int(profile.tune("decode_graph").get("b1_rows_kb") or 0)
    if rows < 2 or states:
        return 0
    if any(w.layer is not None and w.rows > 1 and w.nbytes > kb * 1024 for w in weights.values()):
        return 0
    for st in steps:
        if not st.head and any(la.spec.template not in _B1_ROWS_KERNELS for la in st.launches.get("decode1", ())):
            return 0
    return min(rows, wide_rows - 1) if wide_rows else rows


def _wide_decode_rows(
    graph: ModelGraph,
    quant: QuantCombo,
    d: Mapping[str, Any],
    profile: DeviceProfile,
    tensor_dtypes: Mapping[str, str] | None,
) -> int:
    """The smallest decode bucket that runs its linear layers as GEMMs, or 0 for none: a plan of bf16
    weights from ``GEMM_DECODE_MIN_ROWS`` rows, one with quantised weights (every one a storage type
    the gemm decodes) from tuning ``gemm_decode.quant_min_rows`` (0: they keep the GEMV, which reads
    them once per ``GEMV_MAX_BATCH`` rows); 0 too when no bucket that large exists."""
    rows = GEMM_DECODE_MIN_ROWS
    q_rows = int(profile.tune("gemm_decode").get("quant_min_rows") or 0)
    for op, _ in graph.ops():
        if op.op != "linear":
            continue
        for key in op.weights:
            for layer in (lay for lay in range(int(d["layers"])) if graph.op_runs(op, d, lay)):
                dtype = _dtype_of(graph, quant, key, layer, tensor_dtypes)
                if dtype == "bf16":
                    continue
                if not q_rows or dtype not in QUANTS:
                    return 0
                rows = q_rows
    return rows if max(profile.cuda_graph_batch_sizes) >= rows else 0


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


def _norm_offset(op: Op, d: Mapping[str, Any]) -> float:
    """A norm op's ``offset`` attribute (the dim it names: Gemma's 1 for HF files, 0 for GGUF ones,
    whose converter stored 1 + w), which the weight upload adds to the norm vector; 0 elsewhere."""
    name = op.attrs.get("offset") if op.op in ("rmsnorm", "head_rmsnorm") else None
    if name is None:
        return 0.0
    if name not in d:
        raise ConfigError(f"plan: op {op.op} attribute offset={name!r} names no dim")
    return float(d[name] or 0.0)


def _run_of_layer_ops(ops: list[tuple[Op, bool]], start: int) -> list[tuple[Op, bool]]:
    end = start
    while end < len(ops) and ops[end][1]:
        end += 1
    return ops[start:end]


def _without_q8x(profile: DeviceProfile) -> DeviceProfile:
    """``profile`` with the coop GEMV's int8-x path off (gemv_coop.q8x false): the lowering of a
    family's ``numerics.exact_x`` matrices, whose x the decode GEMVs read as it is (bf16 -> f32)."""
    tuning = dict(profile.tuning)
    tuning["gemv_coop"] = dataclasses.replace(tuning["gemv_coop"], q8x=False)
    return dataclasses.replace(profile, tuning=tuning)


def _tied(graph: ModelGraph, key: str, d: Mapping[str, Any]) -> bool:
    spec = graph.tensors[key]
    return spec.tied_to is not None and bool(d.get("tie_embeddings"))
