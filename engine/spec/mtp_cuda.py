"""MtpHeadCuda: a family's multi-token-prediction head on the GPU beside a CUDA target, with its
own plan, weights, KV cache and decode graphs (a second CudaRunner in the same primary context).

The ``mtp`` graph is split at its ``concat``: the few vector ops before it run on the host and
their ``eh`` rows are written into the head runner's input value (``CudaRunner.write_value``);
everything after it is lowered by the ordinary units (docs/speculative.md, "MTP on the cuda
backend"). ``forward`` has MtpHeadReference's contract (the draft token, None for the logits, which
the proposer never reads, and the hidden output). Must not import CUDA directly (the head runner
is a CudaRunner).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from engine import ops_ref
from engine.graph import Repeat
from engine.spec.mtp_host import HeadWeights
from engine.types import ConfigError, MemraError, SamplingParams, StepItem

HEAD_BLOCKS = 1024  # KV blocks of the head's own cache (one attention layer)
_GREEDY = SamplingParams(temperature=0.0)


class _HeadModel:
    """The target's LoadedModel with the head's graph and dims (everything else delegated)."""

    def __init__(self, model: Any, graph: Any, dims: dict[str, Any]):
        self._model, self.graph, self.dims = model, graph, dims

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


def host_part(mtp: Any) -> tuple[int, dict[str, Any]]:
    """(index of the concat in the mtp graph, the host ops' parameters): the graph must open with
    embed(tokens) -> e, rmsnorm(e), rmsnorm(hidden) -> hh and concat(e, hh) -> eh, in any order of
    the two norms; else a ConfigError naming what differs."""
    nodes = list(mtp.graph)
    cut = next((i for i, n in enumerate(nodes) if not isinstance(n, Repeat) and n.op == "concat"), None)
    if cut is None or any(isinstance(n, Repeat) for n in nodes[:cut]):
        raise ConfigError("--speculative mtp: the cuda head splits its graph at a concat before the layers; none found")
    cat = nodes[cut]
    ops = nodes[:cut]
    embed = [o for o in ops if o.op == "embed"]
    norms = {o.inputs[0]: o for o in ops if o.op == "rmsnorm"}
    if len(cat.inputs) != 2 or len(embed) != 1 or len(ops) != 3 or len(norms) != 2:
        raise ConfigError(f"--speculative mtp: the cuda head's host part must be embed, two rmsnorms, concat; got {[o.op for o in ops]}")
    e, hh = cat.inputs
    emb = embed[0]
    ne = norms.get(emb.outputs[0])
    nh = norms.get("hidden")
    if ne is None or nh is None or ne.outputs[0] != e or nh.outputs[0] != hh:
        raise ConfigError("--speculative mtp: the cuda head's concat must read the normed embedding and the normed hidden state")
    return cut, {"embed": emb.weights[0], "norm_embed": ne.weights[0], "norm_hidden": nh.weights[0], "eh": cat.outputs[0]}


class MtpHeadCuda:
    backend = "cuda"

    def __init__(self, target: Any, num_blocks: int = HEAD_BLOCKS):
        from engine.runner_cuda import CudaRunner  # (the head is a CudaRunner beside the target)

        model = target.model
        mtp = model.graph.mtp
        if mtp is None:
            raise MemraError(f"the {model.graph.family} family declares no MTP head", param="speculative")
        cut, part = host_part(mtp)
        self.mtp = mtp
        self.layers = int(model.dims[mtp.layers])
        d = model.dims
        hidden = int(d["hidden"])
        graph = dataclasses.replace(
            model.graph, graph=tuple(mtp.graph[cut + 1 :]), mtp=None, inputs={part["eh"]: "2 * hidden"}
        )
        self.eps = float(d["rms_eps"])
        # the host part's tensors: the embedding (kept as bf16, as the GPU's embed kernel gives it) and the two norms
        host = HeadWeights(model, target.block_size, target.max_model_len, 1, frozenset(
            (part["embed"], part["norm_embed"], part["norm_hidden"])))  # fmt: skip
        table = host.weight(part["embed"], None)
        self._embed = ops_ref.bf16_bits(table)
        self._w_e = host.weight(part["norm_embed"], None)
        self._w_h = host.weight(part["norm_hidden"], None)
        self._eh = part["eh"]
        self._hidden = hidden
        self.runner = CudaRunner(
            _HeadModel(model, graph, {**d, "layers": self.layers}),
            profile=target.profile,
            device=getattr(target.ctx, "ordinal", 0),
            max_model_len=target.max_model_len,
            num_blocks=num_blocks,
        )
        # the head's hidden output: its final norm's input, normalised on the host
        from engine.spec.hidden_tap import HiddenTap

        self.runner.hidden_tap = HiddenTap(mtp.hidden_out)
        self._out_norm = self.runner._tap_source()
        self.runner.hidden_tap = None
        self.block_size = self.runner.block_size
        self.num_blocks = self.runner.num_blocks
        self.max_model_len = self.runner.max_model_len

    def _rows(self, tokens: Sequence[int], hidden: np.ndarray) -> np.ndarray:
        """The eh rows [T, 2 * hidden]: [rmsnorm(embedding of token) | rmsnorm(hidden)]."""
        e = (self._embed[np.asarray(tokens, np.int64)].astype(np.uint32) << 16).view(np.float32)
        return np.concatenate(
            [ops_ref.rmsnorm(e, self._w_e, self.eps), ops_ref.rmsnorm(hidden, self._w_h, self.eps)], axis=1
        )

    def forward(
        self, tokens: Sequence[int], hidden: Any, start_pos: int, block_table: Sequence[int]
    ) -> tuple[int, None, np.ndarray]:
        """(draft token, None, hidden_out [hidden] of the last row): the head over T positions."""
        hidden = np.asarray(hidden, np.float32).reshape(len(tokens), self._hidden)
        end = start_pos + len(tokens)
        if start_pos < 0 or end > self.max_model_len or len(block_table) * self.block_size < end:
            raise MemraError(f"mtp head: positions {start_pos}..{end - 1} do not fit its cache", code="internal_error")
        r = self.runner
        r._ensure_context()
        rows, table = self._rows(tokens, hidden), list(block_table)
        step = r.profile.prefill_chunk_tokens  # (one pass each: eh holds one pass's rows)
        for lo in range(0, len(tokens), step):
            hi = min(lo + step, len(tokens))
            r.write_value(self._eh, rows[lo:hi])
            tok = r.step([StepItem(0, list(tokens[lo:hi]), start_pos + lo, table, hi == len(tokens), _GREEDY)])[0]
        name, w, eps = self._out_norm
        # (a prefill pass moved its last row to row 0 for the head; a decode row is row 0)
        out = ops_ref.rmsnorm(r.read_value(name, 1), w, eps)[0]
        return int(tok), None, out

    def close(self) -> None:
        self.runner.close()
