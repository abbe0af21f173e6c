"""The lowering context: what every unit of engine.lowering shares while one plan is lowered.

A ``Lowerer`` holds the profile and dims, the scratch buffers the launches need, and the state that
one op leaves for a later one (a decode rmsnorm / silu_mul folded into the GEMVs that read its
output, a head_rmsnorm into the rope, a rope into the direct attention). ``launches`` dispatches an
op to its registered unit. Kernel specs come from ``engine.kernel_catalog.spec`` (it validates the
params and names the entry point). Imports engine.ir, engine.kernel_catalog and the registry,
never a unit. Must not import CUDA or numpy.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from engine import kernel_catalog as kc
from engine.graph import Op
from engine.ir import WIDE, Launch, ScratchPlan, StatePlan, Step, Value, WeightPlan
from engine.kernel_spec import KernelSpec
from engine.lowering.registry import lowering_for
from engine.profile import DeviceProfile
from engine.types import ConfigError

PROLOGUE_MODES = ("decode1", "decode")  # the modes whose GEMVs absorb rmsnorm / silu_mul


class Lowerer:
    """Lowers one graph op in one mode to ``Launch``es with the kernels' documented argument lists.
    Decode keeps split-KV attention + combine (parallel at batch 1 and long contexts); prefill uses
    the flash attention; ``decode1`` (batch 1, and the prefill head) uses bmax=1 GEMVs."""

    def __init__(
        self,
        profile: DeviceProfile,
        dims: Mapping[str, Any],
        rope_style: str,
        max_tokens: int = 2048,
        delta_prefill: str = "",
    ):
        self.max_tokens = max_tokens
        self.max_rows = max(profile.cuda_graph_batch_sizes)
        # the gated delta rule's prefill form ("" = the default; the unit resolves it through
        # engine.linear_attn_kernels.delta_prefill_form)
        self.delta_prefill = delta_prefill
        self.scratch: dict[str, ScratchPlan] = {}
        self.states: dict[str, StatePlan] = {}  # per-slot recurrent state (hybrid layers)
        self.value_dtypes: dict[str, str] = {}  # values a unit binds as other than bf16 (i32 ids, f32)
        self.freq: WeightPlan | None = None  # set by build_plan when RoPE frequencies are scaled
        self.profile = profile
        self.dims = dims
        self.rope_style = rope_style
        self.pending_norm: dict[tuple[Any, str, str], WeightPlan] = {}  # (layer, mode, value) -> norm
        # decode1 GEMV prologues: (id(op), layer) of the rmsnorm/silu_mul ops folded into their
        # readers (gemv_coop.q8x_fuse: every reader a batch-1 q8x GEMV; build_plan sets it) and
        # (mode, value) -> ("norm", x, norm weight) | ("silu", gate, up offset) | ("glu", gate, 0)
        self.fusable1: set[tuple[int, int | None]] = set()
        self.prologue: dict[tuple[str, str], tuple] = {}
        self.rope_v: dict[int | None, Value] = {}  # set by build_plan: the v each rope writes to the cache
        # set by build_plan: the sliding window of the attention each rope writes the cache for (0:
        # none); a window layer's KV write goes through the window slots (engine.runner_kv)
        self.rope_window: dict[int | None, int] = {}
        # (id(op), layer) of the gate|up linears whose decode GEMV stores silu(gate) * up (build_plan)
        self.glu_ops: set[tuple[int, int | None]] = set()
        self.glu_done: set[tuple[str, str]] = set()  # (mode, gate value) whose GEMV ran glu
        # layer -> (attention spec params, extra args) of a decode rope folded into the attention
        self.rope_fused: dict[int | None, tuple[dict[str, Any], tuple]] = {}

    # -- shared helpers

    def spec(self, template: str, **params: Any) -> KernelSpec:
        return kc.spec(template, **params)

    def attr_dim(self, op: Op, attr: str, default: Any = None) -> Any:
        """The value of the dim that ``op``'s attribute ``attr`` names (``default`` when unset), as
        the reference's RefStep.attr_dim reads it."""
        name = op.attrs.get(attr)
        if name is None:
            return default
        if name not in self.dims:
            raise ConfigError(f"plan: op {op.op} attribute {attr}={name!r} names no dim")
        return self.dims[name]

    def tune(self, section: str) -> dict[str, Any]:
        return self.profile.tune(section)

    def graph_value(self, knob: str) -> Any:
        """A decode_graph tuning value (None where the profile's tuning has no such section)."""
        return (self.profile.tuning.get("decode_graph") or {}).get(knob)

    def graph_knob(self, knob: str) -> bool:
        """A decode_graph tuning switch (off where the profile's tuning has no such section)."""
        return bool(self.graph_value(knob))

    def need_scratch(self, sp: ScratchPlan) -> None:
        old = self.scratch.get(sp.name)
        if old is None or sp.nbytes(1 << 20) > old.nbytes(1 << 20):
            self.scratch[sp.name] = sp

    def need_state(self, sp: StatePlan) -> None:
        old = self.states.get(sp.name)
        if old is not None and old != sp:
            raise ConfigError(f"plan: state {sp.name} declared with {old.slot_bytes} and {sp.slot_bytes} bytes per slot")
        self.states[sp.name] = sp

    def upload_type(self, dtype: str, cols: int, rows: int = 0) -> str:
        """The device layout of a [rows, cols] matrix stored as ``dtype`` (kernel_catalog.upload_type)."""
        return kc.upload_type(dtype, cols, self.profile.tuning, rows)

    def q8x_decode(self, dtype: str, cols: int) -> bool:
        """Whether the decode1 GEMV on a [*, cols] weight uploaded as ``dtype`` is a coop q8x GEMV
        (kernel_catalog.q8x_applies at bmax 1)."""
        if not kc.gemv_layout(dtype, self.profile.tuning).get("coop"):
            return False
        return bool(kc.q8x_applies(self.profile.tuning, 1, cols, dtype))

    def fused(self, op: Op, layer: int | None, mode: str) -> bool:
        """Whether the rmsnorm / silu_mul op runs inside its readers' GEMVs in this decode mode."""
        return mode == "decode1" and (id(op), layer) in self.fusable1

    def act_dtype(self, value: str) -> str:
        return self.value_dtypes.get(value) or ("f32" if value == "logits" else "bf16")

    def o_window(self, steps: list[Step], i: int, weights: Mapping[str, WeightPlan]) -> bool:
        """Tuning decode_graph.o_window_min_kb / o_window_max_kb: whether the batch-1 changes in
        the attention's window (trigger_b1, the L2 prefetches of engine.lowering.l2_prefetch) apply
        to attention step ``i``: its layer's o projection (the next linear, one gemv launch at batch
        1) has a weight of at least / at most that many KB (0: no bound)."""
        lo = int(self.graph_value("o_window_min_kb") or 0) * 1024
        hi = int(self.graph_value("o_window_max_kb") or 0) * 1024
        if not (lo or hi):
            return True
        later = linears_after(steps, i)
        o = weight_of(later[0], weights) if later else None
        return o is not None and o.nbytes >= lo and (not hi or o.nbytes <= hi)

    # -- dispatch

    def launches(self, op: Op, layer, mode: str, ins: list[Value], outs: list[Value], ws: list[WeightPlan]):
        unit = lowering_for(op.op)
        launches = unit.lower(self, op, layer, mode, ins, outs, ws)
        if op.op not in ("rmsnorm", "silu_mul"):  # (those set or drop their own pending prologue)
            for o in outs:  # a value written again is no longer a pending GEMV prologue
                self.prologue.pop((mode, o.name), None)
        return launches

    def wide_launches(self, op: Op, layer, ins, outs, ws) -> list[Launch]:
        """The WIDE (large decode bucket) lowering: bf16 linear layers as gemm_decode GEMMs, the
        norms and SiLU-mul materialised as in prefill (the GEMMs read them), the rest as decode."""
        return self.launches(op, layer, lowering_for(op.op).wide or WIDE, ins, outs, ws)


def linears_after(steps: list[Step], i: int) -> list[Step]:
    """The linear steps of step ``i``'s layer after it (for an attention step: o, gate|up, down)."""
    return [s for s in steps[i + 1 :] if s.layer == steps[i].layer and s.op.op == "linear"]


def weight_of(step: Step, weights: Mapping[str, WeightPlan]) -> WeightPlan | None:
    """The matrix a linear step's batch-1 GEMV reads (its arg ``w``; None where the step is not
    one gemv launch, as a q4_k_m q|k beside its v)."""
    launches = step.launches.get("decode1", ())
    if len(launches) != 1 or launches[0].spec.template != "gemv":
        return None
    named = dict(zip((n for n, _ in kc.kernel_args(launches[0].spec)), launches[0].args, strict=True))
    w = named.get("w")
    return weights.get(w.ref) if w is not None and w.kind == "weight" else None
