"""MtpHeadReference: a family's multi-token-prediction head (the ``mtp`` section of its YAML) in
numpy, beside a ReferenceRunner, with its own paged KV cache.

``forward(tokens, hidden, start_pos, block_table)`` runs the MTP graph for T positions: row t reads
token t+1 and the hidden state of position t (the target's, or the head's own output for a
recursive draft), writes the head's attention KV at ``start_pos + t`` of its cache, and returns the
greedy draft of the last row (argmax of its logits), those logits and the hidden state it feeds
back (``hidden_out``). The ops are the reference's own (``engine.ops``), reading the target
runner's weights (it keeps the MTP tensors: ReferenceRunner._load_weights) and rope tables.
Must not import CUDA.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from engine.graph import Repeat
from engine.ops import REFERENCE, RefStep
from engine.types import MemraError


class MtpHeadReference:
    backend = "reference"

    def __init__(self, target: Any, num_blocks: int | None = None):
        model = target.model
        mtp = model.graph.mtp
        if mtp is None:
            raise MemraError(f"the {model.graph.family} family declares no MTP head", param="speculative")
        self.target = target
        self.mtp = mtp
        self.layers = int(model.dims[mtp.layers])
        self.block_size = int(target.block_size)
        self.num_blocks = int(num_blocks or target.num_blocks)
        self.max_model_len = int(target.max_model_len)
        shape = (self.layers, self.num_blocks, self.block_size, int(target.kv_heads), int(target.head_dim))
        self.k_cache = np.zeros(shape, np.float32)
        self.v_cache = np.zeros(shape, np.float32)
        self._schedule: list[tuple[Any, int | None]] = []
        for node in mtp.graph:
            if isinstance(node, Repeat):
                for layer in range(self.layers):
                    self._schedule.extend((op, layer) for op in node.body)
            else:
                self._schedule.append((node, None))
        missing = sorted(
            {f"{w}[{layer}]" if layer is not None else w for o, layer in self._schedule for w in o.weights
             if (w, layer) not in target._weights}
        )  # fmt: skip
        if missing:
            raise MemraError(
                f"--speculative mtp: the checkpoint lacks MTP tensors {', '.join(missing[:4])}", param="speculative"
            )

    def forward(
        self, tokens: Sequence[int], hidden: Any, start_pos: int, block_table: Sequence[int]
    ) -> tuple[int, np.ndarray, np.ndarray]:
        """(draft token, logits [vocab] of the last row, hidden_out [hidden] of the last row)."""
        hidden = np.asarray(hidden, np.float32).reshape(len(tokens), -1)
        end = start_pos + len(tokens)
        if not 0 <= start_pos or end > self.max_model_len or len(block_table) * self.block_size < end:
            raise MemraError(f"mtp head: positions {start_pos}..{end - 1} do not fit its cache", code="internal_error")
        env = {"tokens": np.asarray(tokens, np.int64), "hidden": hidden}
        step = RefStep(self.target, env, start_pos, block_table, self.k_cache, self.v_cache, False)
        for o, layer in self._schedule:
            REFERENCE[o.op](step, o, layer)
        logits = env["logits"][-1]
        return int(np.argmax(logits)), logits, env[self.mtp.hidden_out][-1]
