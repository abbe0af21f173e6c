"""ReferenceRunner: executes a model's op graph in numpy float32 over a paged KV cache (CPU backend).

It is the oracle every CUDA kernel and the CUDA runner are checked against, and the backend CI
serves with. Weights are dequantised to float32 once at construction; each op of
``model.graph.ops()`` runs through its numpy reference in ``engine.ops`` (registered by op name;
built from ``engine.ops_ref``); nothing is fused. Items of a step run one
after another, so an item's output never depends on the other items of the step.

Must not import CUDA (no ``engine.cuda``, ``engine.nvrtc``, ``cuda.*``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from engine import ops_ref
from engine.ops import OPS, REFERENCE, RefStep
from engine.ops.base import MODEL_SCALING
from engine.progress import bar
from engine.sampling import sample, sample_item, validate_sampling
from engine.spec.accept import accept
from engine.step_check import bad_item, check_step_item
from engine.types import MemraError, SamplingParams, StepItem

# Default KV budget when num_blocks is not given; np.zeros pages are only committed when touched.
DEFAULT_KV_BYTES = 512 * 1024 * 1024
# Default recurrent-state budget of a hybrid model (live sequences + prefix-cache snapshots).
DEFAULT_STATE_BYTES = 256 * 1024 * 1024


class ScratchRuns:
    """What the reference runners share: ``step`` over their ``_check_item`` and ``_run_item``, and
    ``forward_logits`` and ``generate`` in a private cache that the runner's ``_scratch_run(length)``
    builds: a function (tokens, start_pos, all_logits) -> logits."""

    max_model_len: int
    _scratch_run: Callable[[int], Callable[[list[int], int, bool], np.ndarray]]
    _check_item: Callable[[StepItem], None]
    _run_item: Callable[[StepItem], np.ndarray]

    def step(self, items: Sequence[StepItem]) -> list[int | None]:
        """Run every item (prefill chunk or decode token), all checked first; sample the last token
        where asked."""
        for item in items:
            self._check_item(item)
        out: list[int | None] = []
        for item in items:
            logits = self._run_item(item)  # (every item runs: a prefill chunk fills the KV cache)
            out.append(sample_item(logits[-1], item) if item.sample else None)
        return out

    def forward_logits(self, token_ids: Sequence[int]) -> np.ndarray:
        """Logits [len, vocab] f32 of every position of ``token_ids`` in a fresh cache (no sampling)."""
        n = len(token_ids)
        if not 0 < n <= self.max_model_len:
            raise MemraError(f"forward_logits needs 1..{self.max_model_len} tokens, got {n}")
        return self._scratch_run(n)(list(token_ids), 0, True)

    def generate(
        self,
        prompt_ids: Sequence[int],
        max_tokens: int,
        sampling: SamplingParams | None = None,
        stop_token_ids: Sequence[int] = (),
    ) -> list[int]:
        """Generate up to ``max_tokens`` ids after ``prompt_ids`` (prefill, then one token per pass).

        Stops early after emitting a token in ``stop_token_ids`` (it is included) or at
        ``max_model_len``. Sampling uses seed ``sampling.seed`` (0 when None).
        """
        sampling = sampling or SamplingParams(temperature=0.0)
        validate_sampling(sampling)
        prompt = list(prompt_ids)
        if not prompt:
            raise MemraError("generate needs a non-empty prompt", param="prompt")
        if len(prompt) >= self.max_model_len:
            raise MemraError(
                f"prompt of {len(prompt)} tokens leaves no room in the context ({self.max_model_len})",
                code="context_length_exceeded",
            )
        total = min(len(prompt) + max(0, max_tokens), self.max_model_len)
        run = self._scratch_run(total)
        seed = sampling.seed if sampling.seed is not None else 0
        history = list(prompt)
        out: list[int] = []
        chunk, pos = prompt, 0
        stops = set(stop_token_ids)
        while len(out) < max_tokens and pos + len(chunk) <= total:
            logits = run(chunk, pos, False)
            pos += len(chunk)
            tok = sample(logits[-1], sampling, history, len(prompt), len(out), seed)
            out.append(tok)
            history.append(tok)
            if tok in stops or pos >= total:
                break
            chunk = [tok]
        return out


class ReferenceRunner(ScratchRuns):
    """Runner protocol implementation in numpy (``backend = "reference"``).

    ``model`` is an ``engine.model.LoadedModel`` (anything with ``graph``, ``dims``, ``rope_style``,
    ``has(tensor, layer)`` and ``dequantize(tensor, layer)``). ``max_model_len`` defaults to the
    model's context; ``num_blocks`` to at least one full-length sequence or DEFAULT_KV_BYTES of
    cache, whichever is more. The KV cache is ``k_cache``/``v_cache``:
    [layers, num_blocks, block_size, kv_heads, head_dim] float32. A model with sliding-window
    attention layers (one window for all of them) also gets a window pool ``k_window``/``v_window``
    of ``window_kv_blocks`` blocks (default num_blocks; 0: none) that those layers use for items
    carrying a ``window_table`` (engine.kv_groups releases its blocks behind the window).
    """

    backend = "reference"

    def __init__(
        self,
        model: Any,
        num_blocks: int | None = None,
        block_size: int = 16,
        max_model_len: int | None = None,
        state_slots: int | None = None,
        window_kv_blocks: int | None = None,
    ):
        d = model.dims
        self.model = model
        self.layers = int(d["layers"])
        self.heads = int(d["heads"])
        self.kv_heads = int(d["kv_heads"])
        self.head_dim = int(d["head_dim"])
        self.vocab = int(d["vocab"])
        self.eps = float(d["rms_eps"])
        if block_size < 1:
            raise MemraError(f"block_size must be >= 1, got {block_size}", param="block_size")
        self.block_size = int(block_size)
        self.max_model_len = int(max_model_len or d["context"])
        if self.max_model_len < 1:
            raise MemraError(f"max_model_len must be >= 1, got {self.max_model_len}", param="max_model_len")
        block_bytes = 2 * self.layers * self.block_size * self.kv_heads * self.head_dim * 4
        if num_blocks is None:
            num_blocks = max(-(-self.max_model_len // self.block_size), DEFAULT_KV_BYTES // block_bytes)
        if num_blocks < 1:
            raise MemraError(f"num_blocks must be >= 1, got {num_blocks}", param="num_blocks")
        self.num_blocks = int(num_blocks)
        self.k_cache, self.v_cache = self._new_cache(self.num_blocks)
        self.ops = model.graph.ops()
        self._schedule = self._build_schedule()
        self.kv_window, self.window_kv_blocks = self._window_pool(window_kv_blocks)
        self.k_window, self.v_window = self._new_cache(self.window_kv_blocks) if self.window_kv_blocks else (None, None)
        # recurrent state of a hybrid model: one array per (stateful op, layer), [slots, *shape]
        self._state_shapes = {
            (o.op, layer): OPS[o.op].state(d)  # type: ignore[misc]
            for o, layer in self._schedule
            if OPS[o.op].state is not None and layer is not None
        }
        self.state_bytes = sum(4 * int(np.prod(shape)) for shape in self._state_shapes.values())
        if not self._state_shapes:
            state_slots = 0
        elif state_slots is None:
            state_slots = max(4, min(1024, DEFAULT_STATE_BYTES // max(1, self.state_bytes)))
        if state_slots < 0 or (self._state_shapes and state_slots < 1):
            raise MemraError(f"state_slots must be >= 1 for a hybrid model, got {state_slots}", param="state_slots")
        self.num_state_slots = int(state_slots)
        self.states = self._new_states(self.num_state_slots)
        self._weights: dict[tuple[str, int | None], np.ndarray] = {}
        self._load_weights()
        self._rope: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}
        # engine.spec.hidden_tap.HiddenTap set by the MTP proposer: per-position hidden rows kept
        self.hidden_tap: Any = None

    # -- construction -----------------------------------------------------------------------

    def _window_pool(self, requested: int | None) -> tuple[int, int]:
        """(window, window pool blocks): the one window of the model's sliding-window attention
        layers, and the pool size (``requested``, default num_blocks; (0, 0) without such layers,
        with several windows, or when 0 is requested)."""
        dims = self.model.dims
        windows = {
            int(dims[o.attrs["window"]] or 0) for o, layer in self._schedule if o.op == "attention" and "window" in o.attrs
        } - {0}
        if requested == 0 or len(windows) != 1:
            if requested and len(windows) != 1:
                raise MemraError(
                    f"window_kv_blocks {requested} (--window-kv-blocks) needs one sliding window in the model, "
                    f"it has {sorted(windows)}",
                    param="window_kv_blocks",
                )
            return 0, 0
        blocks = self.num_blocks if requested is None else int(requested)
        if blocks < 1:
            raise MemraError(f"window_kv_blocks must be >= 0, got {blocks}", param="window_kv_blocks")
        return windows.pop(), blocks

    def _new_cache(self, num_blocks: int) -> tuple[np.ndarray, np.ndarray]:
        shape = (self.layers, num_blocks, self.block_size, self.kv_heads, self.head_dim)
        return np.zeros(shape, np.float32), np.zeros(shape, np.float32)

    def _new_states(self, slots: int) -> dict[tuple[str, int], np.ndarray]:
        return {key: np.zeros((slots, *shape), np.float32) for key, shape in self._state_shapes.items()}

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """CopyingRunner.copy_blocks: each destination block's K and V (every layer) from its source's, in order."""
        for src, dst in pairs:
            self.k_cache[:, dst] = self.k_cache[:, src]
            self.v_cache[:, dst] = self.v_cache[:, src]

    def copy_state(self, src: int, dst: int) -> None:
        """Copy every layer's recurrent state of slot ``src`` into slot ``dst``."""
        for arr in self.states.values():
            arr[dst] = arr[src]

    def _load_weights(self) -> None:
        by_file: dict[str, np.ndarray] = {}  # tied tensors (lm_head = embed) share one array

        def load(tensor: str, layer: int | None) -> None:
            key = (tensor, layer)
            if key in self._weights:
                return
            fname = self.model.file_name(tensor, layer) if hasattr(self.model, "file_name") else repr(key)
            if fname not in by_file:
                arr = np.asarray(self.model.dequantize(tensor, layer), dtype=np.float32)
                by_file[fname] = np.ascontiguousarray(arr)
            self._weights[key] = by_file[fname]

        for op, layer in bar(self._schedule, "memra: loading weights", unit="op"):
            for w in op.weights:
                load(w, layer)
            for attr, kind in OPS[op.op].attrs.items():
                name = op.attrs.get(attr)
                if kind == "tensor" and name and self.model.has(name, None):
                    load(name, None)
        # tensors the graph does not run but the checkpoint carries (MTP heads): loaded and kept
        # for speculative decoding, reachable through weight(name, layer) like any other
        run = {w for o, _ in self._schedule for w in o.weights} | {t for t, _ in self._weights}
        for key in self.model.graph.tensors:
            if key in run or not hasattr(self.model, "tensor_layers"):
                continue
            for layer in self.model.tensor_layers(key):
                if self.model.has(key, layer):
                    load(key, layer)

    def weight(self, name: str, layer: int | None) -> np.ndarray:
        """The float32 array of tensor ``name`` (per-layer tensors at ``layer``, else None)."""
        return self._weights[(name, layer)]

    def rope_tables(
        self, freq_factors: str | None, theta: float | None = None, scaling: Any = MODEL_SCALING
    ) -> tuple[np.ndarray, np.ndarray]:
        """cos and sin tables [max_model_len, rope_dim/2] for a rope op whose ``freq_factors``
        attribute names ``freq_factors`` (None, or a tensor the file lacks: plain RoPE), at base
        ``theta`` (None: the ``rope_theta`` dim) with HF-style ``scaling`` (None: none; by default
        the ``rope_scaling`` dim). A rope op's ``theta``/``scaling`` attributes pass per-layer
        values. Cached."""
        ff_key = freq_factors if freq_factors and (freq_factors, None) in self._weights else None
        d = self.model.dims
        theta = float(d["rope_theta"]) if theta is None else float(theta)
        scaling = d.get("rope_scaling") if scaling is MODEL_SCALING else scaling
        key = (ff_key, theta, repr(sorted(scaling.items())) if scaling else None)
        if key not in self._rope:
            rope_dim = int(d.get("rope_dim") or self.head_dim)
            ff = self._weights[(ff_key, None)] if ff_key else None
            inv = ops_ref.rope_inv_freq(rope_dim, theta, scaling, ff)
            self._rope[key] = ops_ref.rope_tables(np.arange(self.max_model_len), inv)
        return self._rope[key]

    # -- execution ----------------------------------------------------------------------------

    def _run(
        self,
        tokens: Sequence[int],
        start_pos: int,
        block_table: Sequence[int],
        k_cache: np.ndarray,
        v_cache: np.ndarray,
        all_logits: bool,
        states: dict[tuple[str, int], np.ndarray] | None = None,
        slot: int = 0,
        snapshots: Sequence[tuple[int, int]] = (),
        window_table: Sequence[int] | None = None,
    ) -> dict[str, np.ndarray]:
        """Run the graph for ``tokens`` at ``start_pos..``; the values it computed (``logits``:
        [T or 1, vocab], the last row only unless ``all_logits``). A hybrid's recurrent state is
        ``states[..][slot]``, updated in place; ``snapshots`` (n, slot) also store the state after
        the first n tokens into ``slot``."""
        env: dict[str, np.ndarray] = {"tokens": np.asarray(tokens, dtype=np.int64)}
        step = RefStep(
            self, env, start_pos, block_table, k_cache, v_cache, all_logits, states, slot, snapshots,
            window_table, self.k_window, self.v_window,
        )  # fmt: skip
        for o, layer in self._schedule:
            REFERENCE[o.op](step, o, layer)
        return env

    def _build_schedule(self) -> list[tuple[Any, int | None]]:
        """(op, layer) in execution order: each per-layer op once per layer where its ``when``
        predicate holds, in graph order."""
        graph, dims = self.model.graph, self.model.dims
        sched: list[tuple[Any, int | None]] = []
        i, ops = 0, self.ops
        while i < len(ops):
            if not ops[i][1]:
                sched.append((ops[i][0], None))
                i += 1
                continue
            j = i
            while j < len(ops) and ops[j][1]:
                j += 1
            for layer in range(self.layers):
                sched.extend((op, layer) for op, _ in ops[i:j] if graph.op_runs(op, dims, layer))
            i = j
        return sched

    def _item_state(self, item: StepItem) -> dict[str, Any]:
        """The state arguments of ``_run`` for an item, after preparing its slot: a restore
        copies the snapshot in, a sequence's first token (start_pos 0) starts from zeros."""
        if not self.num_state_slots:
            return {}
        slot = item.state_slot
        if slot is None or not 0 <= slot < self.num_state_slots:
            raise bad_item(item, f"a hybrid model needs a state slot in 0..{self.num_state_slots - 1}, got {slot}")
        for other in [item.state_restore, *(s for _, s in item.state_snapshots)]:
            if other is not None and not 0 <= other < self.num_state_slots:
                raise bad_item(item, f"state slot {other} is out of range")
        if item.state_restore is not None:
            self.copy_state(item.state_restore, slot)
        elif item.start_pos == 0:
            for arr in self.states.values():
                arr[slot] = 0.0
        return {"states": self.states, "slot": slot, "snapshots": tuple(item.state_snapshots)}

    def _check_item(self, item: StepItem) -> None:
        need = check_step_item(
            item, max_model_len=self.max_model_len, block_size=self.block_size, num_blocks=self.num_blocks, vocab=self.vocab
        )
        if item.window_table is not None:
            self._check_window_table(item, need)

    def _check_window_table(self, item: StepItem, need: int) -> None:
        """An item's window table: this runner has a window pool; it covers the item's positions,
        with valid blocks from the window of its first position on (earlier ones may be RELEASED)."""
        table = item.window_table
        assert table is not None
        if not self.window_kv_blocks:
            raise bad_item(item, "a window_table for a runner without a window pool")
        first = ops_ref.window_start(item.start_pos, self.kv_window) // self.block_size
        if len(table) < need or not all(0 <= b < self.window_kv_blocks for b in table[first:need]):
            raise bad_item(
                item,
                f"window_table {list(table)[:need]} does not cover positions "
                f"{item.start_pos}..{item.start_pos + len(item.token_ids) - 1} (window {self.kv_window})",
            )

    def _run_item(self, item: StepItem, all_logits: bool = False) -> np.ndarray:
        """Run one checked item in the runner's cache; its logits (the last row unless ``all_logits``)."""
        env = self._run(
            item.token_ids, item.start_pos, item.block_table, self.k_cache, self.v_cache, all_logits,
            **self._item_state(item), window_table=item.window_table,
        )  # fmt: skip
        self._tap(item.seq_id, item.start_pos, env)
        return env["logits"]

    # Verification of a hybrid leaves each sequence's recurrent state at its last accepted position.
    verify_restores_state = True

    def verify(self, items: Sequence[StepItem]) -> list[list[int]]:
        """Runner.verify (engine.types.VerifyingRunner): like ``step``, but an item with a draft of k
        tokens has the logits of its last k+1 positions computed and ``engine.spec.accept`` turns
        them into the emitted tokens (accepted drafts + one); other items give [token] or [].
        On a hybrid, a draft row runs position by position (``_verify_stateful``)."""
        for item in items:
            self._check_item(item)
            k = len(item.draft)
            if k and (k >= len(item.token_ids) or list(item.token_ids[-k:]) != list(item.draft)):
                raise bad_item(item, f"the draft must be the last {k} of the item's tokens")
        out: list[list[int]] = []
        for item in items:
            k = len(item.draft)
            if k and self.num_state_slots:
                out.append(self._verify_stateful(item))
                continue
            logits = self._run_item(item, k > 0)
            if k:
                out.append(accept(logits[-(k + 1) :], item))
            elif item.sample:
                out.append([sample_item(logits[-1], item)])
            else:
                out.append([])
        return out

    def _verify_stateful(self, item: StepItem) -> list[int]:
        """A hybrid's draft row: the tokens before the draft as one chunk, then each draft token as
        its own one-token pass (the recurrent form decode uses, so the logits are decode's bit for
        bit), keeping the recurrent state after each; after acceptance the state after the last
        accepted token goes back into the sequence's slot (rejected positions leave no trace)."""
        k = len(item.draft)
        head = len(item.token_ids) - k
        st = self._item_state(item)
        slot = st["slot"]
        rows, saved = [], []
        for j in range(k + 1):
            lo = 0 if j == 0 else head + j - 1
            hi = head if j == 0 else lo + 1
            snaps = tuple((n - lo, s) for n, s in st["snapshots"] if lo < n <= hi)
            env = self._run(
                item.token_ids[lo:hi], item.start_pos + lo, item.block_table, self.k_cache, self.v_cache, False,
                self.states, slot, snaps, window_table=item.window_table,
            )  # fmt: skip
            self._tap(item.seq_id, item.start_pos + lo, env)
            rows.append(env["logits"][-1])
            saved.append({key: arr[slot].copy() for key, arr in self.states.items()})
        emitted = accept(np.stack(rows), item)
        for key, arr in self.states.items():
            arr[slot] = saved[len(emitted) - 1][key]  # after the accepted drafts (len(emitted) - 1)
        return emitted

    def _tap(self, seq_id: int, start_pos: int, env: dict[str, np.ndarray]) -> None:
        if self.hidden_tap is not None:
            self.hidden_tap.record(seq_id, start_pos, env[self.hidden_tap.value])

    def _scratch_run(self, length: int) -> Callable[[list[int], int, bool], np.ndarray]:
        nb = max(1, -(-length // self.block_size))
        (k, v), table, states = self._new_cache(nb), list(range(nb)), self._new_states(1)
        return lambda tokens, pos, all_logits: self._run(tokens, pos, table, k, v, all_logits, states)["logits"]
