"""ShardedReference: the numpy reference run as an engine.placement says, one ReferenceRunner per rank.

The CPU model of what N GPUs do, and the oracle the multi-GPU runner is checked against:

- TP: each rank holds its slice of every split tensor (``Placement.shard``) and its own KV cache
  (its K/V heads); every op runs on every rank with the rank's weights; an op whose weights are
  split by input columns or by expert (o, down, the experts) yields a partial sum per rank, and
  the all-reduce is their sum (plus the residual, once); a vocab-parallel head's logits are
  gathered (concatenated). Expert parallelism hands each rank the router's choices with the other
  ranks' experts weighted 0.
- PP: rank r runs only its layers (the embedding on the first, the tail on the last) over its own
  KV cache; between ranks pass exactly the activations the next rank reads before writing (the
  residual stream ``x`` in a decoder), as point-to-point sends would.

Implements the Runner protocol (``step``) so ``memra serve --backend reference --devices 0,1
--split tp`` serves through it. Must not import CUDA.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from engine.ops import OPS, REFERENCE, RefStep
from engine.placement import Placement
from engine.reference import DEFAULT_STATE_BYTES, ReferenceRunner, ScratchRuns
from engine.types import MemraError, StepItem


class _ShardModel:
    """A LoadedModel as one TP rank sees it: its heads and K/V heads in ``dims``, its slice of each
    split tensor from ``dequantize`` (full tensors are dequantised once, shared by every rank)."""

    def __init__(self, model: Any, placement: Placement, rank: int, full: dict):
        self._model, self._placement, self._rank, self._full = model, placement, rank, full
        self.dims = dict(model.dims)
        self.dims["heads"] = int(model.dims["heads"]) // placement.n
        self.dims["kv_heads"] = placement.parts[rank].kv_heads

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def file_name(self, tensor: str, layer: int | None = None) -> str:
        name = self._model.file_name(tensor, layer)
        # a sliced tensor is its own array (a tied head's slice is not the embedding)
        return name if self._placement.shard(tensor, self._rank) is None else f"{name}#{tensor}@{self._rank}"

    def dequantize(self, tensor: str, layer: int | None = None) -> np.ndarray:
        key = self._model.file_name(tensor, layer)
        if key not in self._full:
            self._full[key] = np.asarray(self._model.dequantize(tensor, layer), dtype=np.float32)
        arr = self._full[key]
        sh = self._placement.shard(tensor, self._rank)
        if sh is None:
            return arr
        axis, lo, hi = sh
        return np.ascontiguousarray(np.take(arr, np.arange(lo, hi), axis=axis))


class _StageRunner(ReferenceRunner):
    """A PP rank: the reference runner restricted to ``layers`` (and the ops before the layers when
    ``first``, after them when ``last``); only those weights are loaded."""

    def __init__(self, model: Any, layers: Sequence[int], first: bool, last: bool, **kw: Any):
        self.stage_layers, self.first, self.last = frozenset(layers), first, last
        super().__init__(model, **kw)

    def _build_schedule(self) -> list[tuple[Any, int | None]]:
        out, seen_layer = [], False
        for op, layer in super()._build_schedule():
            if layer is not None:
                seen_layer = True
                if layer in self.stage_layers:
                    out.append((op, layer))
            elif (self.last if seen_layer else self.first):
                out.append((op, layer))
        return out


def _state_slots(model: Any) -> int | None:
    """The recurrent-state slot count the unsharded reference would pick (None: no state)."""
    total = 0
    for op, per in model.graph.ops():
        shape_of = OPS[op.op].state
        if per and shape_of is not None:
            n = sum(1 for i in range(int(model.dims["layers"])) if model.graph.op_runs(op, model.dims, i))
            total += n * 4 * int(np.prod(shape_of(model.dims)))
    return max(4, min(1024, DEFAULT_STATE_BYTES // total)) if total else None


def _live_in(schedule: Sequence[tuple[Any, int | None]]) -> list[str]:
    """Values a schedule reads before writing them (what an earlier stage must send), in order."""
    written: set[str] = {"tokens"}
    need: list[str] = []
    for op, _ in schedule:
        for name in [*op.inputs, *([op.attrs["residual"]] if "residual" in op.attrs else [])]:
            if name not in written and name not in need:
                need.append(name)
        written.update(op.outputs)
    return need


class ShardedReference(ScratchRuns):
    """Runner protocol over a Placement: ``ranks`` are ReferenceRunners (TP shards or PP stages)."""

    backend = "reference"

    def __init__(
        self,
        model: Any,
        placement: Placement,
        num_blocks: int | None = None,
        block_size: int = 16,
        max_model_len: int | None = None,
    ):
        self.model, self.placement = model, placement
        kw: dict[str, Any] = {"block_size": block_size, "max_model_len": max_model_len, "num_blocks": num_blocks}
        if placement.split == "pp":
            kw["state_slots"] = _state_slots(model)  # every stage hands out the same slot ids
        self.ranks: list[ReferenceRunner] = []
        full: dict = {}
        for part in placement.parts:
            if placement.split == "tp":
                runner: ReferenceRunner = ReferenceRunner(_ShardModel(model, placement, part.rank, full), **kw)
            else:
                runner = _StageRunner(model, part.layers, part.embed, part.head, **kw)
            kw["num_blocks"] = runner.num_blocks  # every rank pages the same block ids
            self.ranks.append(runner)
        first = self.ranks[0]
        self.block_size, self.num_blocks, self.max_model_len = first.block_size, first.num_blocks, first.max_model_len
        self.num_state_slots = first.num_state_slots if placement.split == "tp" else max(r.num_state_slots for r in self.ranks)
        if placement.split == "tp" and first.num_state_slots:
            raise MemraError("--split tp: a model with recurrent state has no tensor-parallel rule; use --split pp")
        # PP: the activations each stage receives from the one before it
        self.sends = [_live_in(r._schedule) for r in self.ranks] if placement.split == "pp" else []

    # -- execution ----------------------------------------------------------------------------

    def _forward(self, tokens, start_pos, block_table, caches, all_logits, states=None) -> np.ndarray:
        toks = np.asarray(tokens, dtype=np.int64)
        if self.placement.split == "pp":
            return self._forward_pp(toks, start_pos, block_table, caches, all_logits, states)
        return self._forward_tp(toks, start_pos, block_table, caches, all_logits)

    def _forward_pp(self, toks, start_pos, block_table, caches, all_logits, states) -> np.ndarray:
        carry: dict[str, np.ndarray] = {}
        env: dict[str, np.ndarray] = {}
        for r, stage in enumerate(self.ranks):
            env = {"tokens": toks, **{k: carry[k] for k in self.sends[r]}}  # recv from rank r - 1
            st = (states[r] if states else None) or {}
            step = RefStep(stage, env, start_pos, block_table, caches[r][0], caches[r][1], all_logits, **st)
            for o, layer in stage._schedule:
                REFERENCE[o.op](step, o, layer)
            carry = env
        return env["logits"]

    def _forward_tp(self, toks, start_pos, block_table, caches, all_logits) -> np.ndarray:
        pl = self.placement
        envs = [{"tokens": toks} for _ in self.ranks]
        steps = [
            RefStep(rk, envs[r], start_pos, block_table, caches[r][0], caches[r][1], all_logits)
            for r, rk in enumerate(self.ranks)
        ]
        for o, layer in self.ranks[0]._schedule:
            if o.op == "moe_experts" or pl.reduces(o.weights):
                res = envs[0][o.attrs["residual"]] if "residual" in o.attrs else None
                partial = replace(o, attrs={k: v for k, v in o.attrs.items() if k != "residual"})
                for r, step in enumerate(steps):
                    if o.op == "moe_experts" and pl.moe == "ep":
                        self._local_experts(step, o, r)
                    REFERENCE[o.op](step, partial, layer)
                total = sum(env[o.outputs[0]] for env in envs[1:]) + envs[0][o.outputs[0]]  # all-reduce
                if res is not None:
                    total = total + res
                for env in envs:
                    env[o.outputs[0]] = total
                    if o.op == "moe_experts" and pl.moe == "ep":
                        env[o.inputs[1]], env[o.inputs[2]] = env.pop("_ids"), env.pop("_w")
            elif o.outputs == ("logits",) and pl.shard(o.weights[0], 0) is not None:
                for step in steps:
                    REFERENCE[o.op](step, o, layer)
                logits = np.concatenate([env["logits"] for env in envs], axis=-1)  # all-gather
                for env in envs:
                    env["logits"] = logits
            else:
                for step in steps:
                    REFERENCE[o.op](step, o, layer)
        return envs[0]["logits"]

    def _local_experts(self, step: RefStep, o: Any, rank: int) -> None:
        """Expert parallelism: rank ``rank`` sees the router's picks as local ids, the other ranks'
        experts weighted 0 (the full ids/weights are restored after the all-reduce)."""
        sh = self.placement.shard(o.weights[0], rank)
        assert sh is not None
        _, lo, hi = sh
        ids, w = step.env[o.inputs[1]], step.env[o.inputs[2]]
        step.env["_ids"], step.env["_w"] = ids, w
        mine = (ids >= lo) & (ids < hi)
        step.env[o.inputs[1]] = np.where(mine, ids - lo, 0).astype(ids.dtype)
        step.env[o.inputs[2]] = np.where(mine, w, 0).astype(w.dtype)

    def _caches(self) -> list[tuple[np.ndarray, np.ndarray]]:
        return [(r.k_cache, r.v_cache) for r in self.ranks]

    def _states(self, item: StepItem | None) -> list[dict[str, Any]] | None:
        if not self.num_state_slots:
            return None
        if item is None:
            return [{"states": r._new_states(1), "slot": 0} if r.num_state_slots else {} for r in self.ranks]
        return [r._item_state(item) if r.num_state_slots else {} for r in self.ranks]

    # -- the Runner protocol (ScratchRuns.step) and conveniences ------------------------------

    def _check_item(self, item: StepItem) -> None:
        self.ranks[0]._check_item(item)

    def _run_item(self, item: StepItem) -> np.ndarray:
        return self._forward(item.token_ids, item.start_pos, item.block_table, self._caches(), False, self._states(item))

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """CopyingRunner.copy_blocks on every rank's cache."""
        for r in self.ranks:
            r.copy_blocks(pairs)

    def copy_state(self, src: int, dst: int) -> None:
        for r in self.ranks:
            if r.num_state_slots:
                r.copy_state(src, dst)

    def _scratch_run(self, length: int) -> Callable[[list[int], int, bool], np.ndarray]:
        nb = max(1, -(-length // self.block_size))
        caches, table, states = [r._new_cache(nb) for r in self.ranks], list(range(nb)), self._states(None)
        return lambda tokens, pos, all_logits: self._forward(tokens, pos, table, caches, all_logits, states)


__all__ = ["ShardedReference"]
