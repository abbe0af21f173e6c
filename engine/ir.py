"""The plan IR: what lowering produces and the CUDA runner executes (no GPU, no numpy).

``Plan`` holds weights (``WeightPlan``: one device allocation, parts fused by rows), arena buffers
(``BufferPlan``), activation values (``Value``: a column view of a buffer), runner scratch
(``ScratchPlan``) and ``Step``s: one graph op at one layer with its ``Launch``es per mode. A launch
is a ``KernelSpec`` plus grid, block, shared memory and symbolic ``Arg``s the runner binds once per
bucket/chunk. Modes: ``decode1`` (batch 1, and the prefill head), ``decode`` (n rows, one token per
sequence), ``prefill`` (n tokens of one sequence), ``short`` / ``short1`` (decode passes whose rows
all sit below ``Plan.short_context``), ``decode_wide`` (large decode buckets as GEMMs),
``vshort`` (a speculative verify pass's short-context launches, where a plan has them), ``tail``
(the attention of a prompt tail's decode pass past short_context, where a plan has it).
Imports only the DSL (engine.graph), KernelSpec and quant row sizes; everything above it
(engine.lowering, engine.plan, engine.runner_cuda) imports it. Must not import CUDA or numpy.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from engine.dsl_expr import evaluate
from engine.graph import Op
from engine.kernel_spec import KernelSpec
from engine.storage import BLOCK_SIZES, row_bytes
from engine.types import ConfigError

ACT_ITEMSIZE = {"f32": 4, "bf16": 2, "f16": 2, "i32": 4}
MODES = ("decode1", "decode", "prefill")
# the launches of a batch-1 short-context decode pass where they differ from both decode1's and
# short's (attention_decode.trigger_b1: the direct attention with its early pdl_trigger(); the L2
# prefetches of engine.lowering.l2_prefetch)
SHORT1 = "short1"
# the short-context launches of a speculative verify pass (rows of one sequence) where the plan's
# "short" rope is folded into the attention kernel (attention_decode.fuse_rope), whose blocks would
# race on the rows' KV: the rope-fused direct attention with vfresh (kernels/attention.cu.j2: each
# block also writes the keys of its sequence's earlier rows of the pass, then reads them), no rope
VSHORT = "vshort"
# the attention launches of a prompt tail's decode pass past short_context (engine.runner_tail; a
# dense plan with the prefill key split): the prefill flash attention's per-span partial launch on
# the decode pass's rows (each sequence's K/V read once for all of its tail rows, not once a row)
# + attention_combine's fold; never an ordinary decode or verify pass's
TAIL = "tail"
# the sequences (tails) one TAIL pass holds at most: its partial launch's grid has this many per span
# (a decode pass's rows bound as min(n, TAIL_SEQS) sequences; engine.runner_tail packs up to it)
TAIL_SEQS = 4


def launch_key(launches: Mapping[str, Any], mode: str, short: bool, verify: bool = False, tail: bool = False) -> str:
    """The key of a step's ``launches`` that a pass in ``mode`` runs: in a short-context decode
    pass (every row's position below Plan.short_context), SHORT1 at batch 1 where the step has it,
    VSHORT in a decode-mode verify pass (``verify``; lowered for the decode GEMVs' value layouts,
    not a wide pass's) where it has that, else "short" where it has that; in a prompt tail's pass
    past short_context (``tail``) TAIL where the step has it; otherwise the mode itself (a verify
    pass's GEMVs and norms are plain decode's launches)."""
    if tail and not short and TAIL in launches:
        return TAIL
    if short:
        if mode == "decode1" and SHORT1 in launches:
            return SHORT1
        if verify and mode == "decode" and VSHORT in launches:
            return VSHORT
        if "short" in launches:
            return "short"
    return mode


def pass_key(
    step: Any, mode: str, n: int, short: bool, verify: bool = False, b1_rows: int = 0, tail: bool = False
) -> str:
    """The launches key a decode pass of ``n`` rows in ``mode`` runs for ``step``: ``launch_key``,
    except that a pass of 2 .. ``b1_rows`` rows (Plan.b1_rows) runs a layer step's batch-1
    launches (decode1: one grid row per decode row, so each row gets the bits it gets alone) where
    it would run the bucket's; its short / verify / tail attention (and the head) stay as they are."""
    key = launch_key(step.launches, mode, short, verify, tail)
    if key == "decode" and 1 < n <= b1_rows and not step.head and "decode1" in step.launches:
        return "decode1"
    return key


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
    # added to a vector's values at upload (f32): a norm op's weight ``offset`` (Gemma's (1 + w))
    # folded into its weight once, so every kernel reading it (rmsnorm, the GEMV norm prologue, the
    # rope's q/k norms) multiplies by offset + w without knowing of it
    offset: float = 0.0

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
    ``kv`` (``ref`` = "k"|"v", ``layer``), ``state`` (the slot-0 address of ``StatePlan`` ``ref``),
    ``input`` (a per-step static input buffer: tokens,
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


@dataclass(frozen=True)
class StatePlan:
    """The recurrent state of one stateful op at one layer (a hybrid's conv window, its delta-rule
    matrix): ``slot_bytes`` f32 bytes per state slot; the runner allocates one array of
    [state slots + 1 sink, slot_bytes] (the sink takes the padding rows' writes)."""

    name: str  # "L3.causal_conv1d"
    layer: int
    slot_bytes: int


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
    sampling: dict[str, tuple[Launch, ...]]  # "greedy" / "sample" / "masked_greedy"... -> launches on logits
    scratch: tuple[ScratchPlan, ...]
    short_context: int  # decode rows all below this position use the ``short`` launches (attention, rope)
    max_tokens: int  # arena rows: max(prefill chunk, largest graph bucket)
    block_size: int
    graph_batch_sizes: tuple[int, ...]
    wide_rows: int = 0  # decode buckets of at least this many rows use the WIDE launches (0: none)
    # decode passes of 2 .. b1_rows rows run the layers' decode1 launches (pass_key; 0: none)
    b1_rows: int = 0
    states: tuple[StatePlan, ...] = ()  # per-slot recurrent state of the stateful ops (hybrids)

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


WIDE = "decode_wide"  # the launches key of wide decode buckets: linear layers as tensor-core GEMMs
ROPE_FREQ = "rope_freq"  # a computed weight: per-pair divisors of theta^(-2i/rope_dim), f32 [rope_dim/2]
PENALTY_CAPACITY = 65536  # (row, token) penalty entries one step can upload; more -> host sampling
BIAS_CAPACITY = 4096  # (token, value) logit-bias entries one step can upload; more -> host sampling
MASKED = "masked_"  # prefix of the sampling kinds that run the token_mask kernel first
LOGPROBS = "_lp"  # suffix of the masked kinds that end with the logprobs kernel
LP_SLOTS = 16  # rows per step whose logprobs the device computes; more -> those rows on the host


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def val(value: Value, row: str = "first") -> Arg:
    """A pointer to ``value`` (row 0, or the last row)."""
    return Arg("value", value.name, "ptr", row=row)


def wgt(weight: WeightPlan) -> Arg:
    """A pointer to ``weight``."""
    return Arg("weight", weight.key)


NULL = Arg("const", 0, "ptr")
ROWS = Arg("shape", "n", "i32")
