"""Stacked tensors over a WeightSource: a MoE layer's per-expert tensors presented as one [E, out, in].

HF checkpoints store each expert's projection apart (``model.layers.3.mlp.experts.17.gate_proj.weight``);
GGUF stores them stacked (``blk.3.ffn_gate_exps.weight``, [E, out, in] in row-major order). The
backends read one layout: ``StackedSource.add_stack(name, members)`` registers a virtual tensor
``name`` whose info, raw bytes and dequantised values are the members' concatenated along a new
axis 0 (expert e's rows follow expert e-1's, so any block format stays whole rows); its
``file_ranges`` are the members' in order and ``evict`` evicts every member. The source behaves
like the one it wraps for every other name.

Must not import CUDA, the model graph or the tokenizer; only numpy and engine.weights.source/types.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from engine.types import MemraError
from engine.weights.source import TensorInfo, WeightSource


class StackedSource(WeightSource):
    """``base`` plus virtual stacked tensors. Reads of a stack copy (np.concatenate) its members' bytes."""

    def __init__(self, base: WeightSource):
        self.base = base
        self.format = base.format
        self.path = base.path
        self.files = base.files
        self.metadata = base.metadata
        self._infos = base._infos  # the base's names stay visible; stacks are looked up first
        self._stacks: dict[str, tuple[str, ...]] = {}
        self._stack_infos: dict[str, TensorInfo] = {}

    def add_stack(self, name: str, members: Sequence[str]) -> None:
        """Register ``name`` as the stack of ``members`` (in order). Nothing is registered when no
        member exists (the stacked tensor is then simply absent); a partial set, or members that
        differ in type or shape, is a MemraError naming the file and the offending tensor."""
        members = tuple(members)
        present = [m for m in members if self.base.has(m)]
        if not present:
            return
        if len(present) != len(members):
            missing = next(m for m in members if not self.base.has(m))
            raise MemraError(
                f"{self.base.file_of(present[0])}: tensor {missing!r} is missing "
                f"({name} stacks {len(members)} tensors, {len(present)} are present)",
                code="invalid_model",
            )
        first = self.base.info(members[0])
        for m in members[1:]:
            info = self.base.info(m)
            if (info.dtype, info.shape) != (first.dtype, first.shape):
                raise MemraError(
                    f"{self.base.file_of(m)}: tensor {m!r} is {info.dtype} {tuple(info.shape)} but "
                    f"{members[0]!r} is {first.dtype} {tuple(first.shape)} (members of {name})",
                    code="invalid_model",
                )
        nbytes = sum(self.base.info(m).nbytes for m in members)
        self._stacks[name] = members
        self._stack_infos[name] = TensorInfo(name, first.dtype, (len(members), *first.shape), nbytes)

    def members(self, name: str) -> tuple[str, ...]:
        """The file tensors behind ``name`` (itself when it is not a stack)."""
        return self._stacks.get(name, (name,))

    def tensor_names(self) -> list[str]:
        return list(self._infos) + list(self._stack_infos)

    def has(self, name: str) -> bool:
        return name in self._stack_infos or self.base.has(name)

    def info(self, name: str) -> TensorInfo:
        if name in self._stack_infos:
            return self._stack_infos[name]
        return self.base.info(name)

    def file_of(self, name: str) -> Path:
        return self.base.file_of(self.members(name)[0])

    def raw(self, name: str) -> np.ndarray:
        if name in self._stacks:
            return np.concatenate([self.base.raw(m) for m in self._stacks[name]])
        return self.base.raw(name)

    def file_ranges(self, name: str) -> list[tuple[Path, int, int]]:
        """A stack's ranges are its members' in order (expert e's bytes follow expert e-1's, as in
        ``raw``), so an upload reads each member straight from its file."""
        return [r for m in self.members(name) for r in self.base.file_ranges(m)]

    def evict(self, name: str) -> None:
        for m in self.members(name):
            self.base.evict(m)

    def close(self) -> None:
        self.base.close()
