"""HeadWeights: what MtpHeadReference reads from its target (dims, the head's tensors as float32,
rope tables) for a target that is not a ReferenceRunner: the CUDA runner, whose weights live on the
device. It loads only the tensors the ``mtp`` graph runs (or only ``names``) from the checkpoint:
the numpy head on the host beside a GPU target where the head's graph does not fit
engine.spec.mtp_cuda's split, and the CUDA head's host-side input rows (docs/speculative.md).
Must not import CUDA.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from engine.graph import Repeat
from engine.ops import OPS
from engine.reference import ReferenceRunner

HOST_HEAD_BLOCKS = 1024  # KV blocks of the host head's own cache (drafts stop where they run out)


class HeadWeights:
    backend = "host"

    def __init__(
        self,
        model: Any,
        block_size: int,
        max_model_len: int,
        num_blocks: int = HOST_HEAD_BLOCKS,
        names: frozenset[str] | None = None,
    ):
        d = model.dims
        self.model = model
        self.heads, self.kv_heads, self.head_dim = int(d["heads"]), int(d["kv_heads"]), int(d["head_dim"])
        self.eps = float(d["rms_eps"])
        self.block_size, self.max_model_len = int(block_size), int(max_model_len)
        self.num_blocks = int(num_blocks)
        self._weights: dict[tuple[str, int | None], np.ndarray] = {}
        self._rope: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}
        mtp = model.graph.mtp
        layers = int(d[mtp.layers]) if mtp is not None else 0
        by_file: dict[str, np.ndarray] = {}  # tied tensors (lm_head = embed) share one array
        for node in mtp.graph if mtp is not None else ():
            for op, layer in ((o, i) for o in node.body for i in range(layers)) if isinstance(node, Repeat) else ((node, None),):
                tensors = list(op.weights) + [
                    op.attrs[a] for a, kind in OPS[op.op].attrs.items() if kind == "tensor" and op.attrs.get(a)
                ]
                for name in tensors:
                    if (name, layer) in self._weights or not model.has(name, layer) or (names and name not in names):
                        continue
                    fname = model.file_name(name, layer)
                    if fname not in by_file:
                        by_file[fname] = np.ascontiguousarray(np.asarray(model.dequantize(name, layer), np.float32))
                    self._weights[(name, layer)] = by_file[fname]

    # the reference runner's own lookups (they read only the attributes set above)
    weight = ReferenceRunner.weight
    rope_tables = ReferenceRunner.rope_tables
