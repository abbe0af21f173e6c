"""The CUDA runner's step logic on the host: a step's items checked and split into prefill passes
and decode rows (a prompt's tail as decode rows too, its last position or, for a hybrid, its
trailing partial block: engine.runner_tail), each row's sampling fields, the launches of a pass bound to a shape (prefill shapes in an LRU, the warm-prefix tails bound
ahead), the step's sampling kind (logit bias, constraint masks and logprobs packed for the device's
token_mask and logprobs steps by engine.logit_prep), the sampled ids and logprobs read back (rows
past the device buffers' capacity re-sampled on the host); speculative verify
delegated to engine.spec.cuda_verify. ``StepLogic`` is CudaRunner's base
class; every device call goes through CudaRunner's own methods (engine.runner_cuda), so this
module never touches the driver. Must not import CUDA.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from engine.block_manager import aligned_count
from engine.ir import LOGPROBS, LP_SLOTS, MASKED, PENALTY_CAPACITY, TAIL_SEQS, WIDE, Arg, launch_key, pass_key
from engine.logit_prep import on_device
from engine.runner_tail import run_tails, split_item, tail_count, whole_block_tails
from engine.runner_warm import background, run_now, warm_units
from engine.sampling import penalty_entries, sample_item
from engine.step_check import check_step_item
from engine.types import MemraError, StepItem

log = logging.getLogger("memra.runner_cuda")


_STATE_ROWS = frozenset(("state_in", "state_out", "state_snap"))  # per-row state inputs (int32)
_CLEARED = object()  # _row_sampling: the row holds the padding rows' neutral sampling fields
GROUPINGS_KEPT = 32  # hybrid verify passes' row groupings kept bound / captured (LRU)
PREFILL_SHAPES_KEPT = 64  # bound prefill passes kept (LRU), by (tokens, sequences, longest chunk)
# a row's sampling inputs, and their values in padding rows (greedy, no filters, no penalties)
_SAMPLING_VIEWS = ("temperature", "top_p", "top_k", "min_p", "seeds", "presence", "frequency", "repetition")
_NEUTRAL_SAMPLING = (0.0, 1.0, 0, 0.0, 0, 0.0, 0.0, 1.0)


def is_decode_row(it: StepItem) -> bool:
    """Whether ``step`` runs the item as a decode row: one token past the prompt. A prompt's
    tokens are a prefill item, whose tail (its last position; a hybrid's trailing partial block)
    the runner also runs as decode rows (engine.runner_tail, by absolute position: a warm or chunked prompt gets the bits of the cold
    run, since a decode row reduces otherwise than a prefill pass: GEMVs, not the prefill GEMM)."""
    return len(it.token_ids) == 1 and it.start_pos > 0 and it.start_pos >= it.prompt_len


def _on_host(it: StepItem) -> bool:
    """Rows a plain sample pass does not finish: logit bias, logprobs, a constraint mask (re-sampled
    on the host when a step falls back to it)."""
    return it.sample and (it.allowed is not None or it.sampling.needs_host)


def _wants_logprobs(it: StepItem) -> bool:
    """Rows asking for the log probabilities of their raw logits."""
    return it.sample and it.sampling.logprobs is not None


def _decode_mode(bucket: int, wide_rows: int = 0) -> str:
    """The launches key of a decode pass of ``bucket`` rows (WIDE from ``plan.wide_rows`` up)."""
    if bucket == 1:
        return "decode1"
    return WIDE if wide_rows and bucket >= wide_rows else "decode"


class StepLogic:
    """Host-side step logic of CudaRunner (engine.runner_cuda); see the module docstring."""

    # a verify pass of n rows runs a graph of exactly n rows, not the bucket's (padding rows cost
    # GEMV and attention work; tools/gpu_spec_round.py times both)
    verify_exact_rows = True
    _tail_keys: frozenset = frozenset()  # the prompt tails' hybrid graphs (engine.runner_tail.tail_captures)
    _tail_attention = False  # the plan has TAIL attention launches (engine.runner_tail.has_tail_attention)

    def _rope_freq_factors(self) -> np.ndarray:
        """f32 divisors ff with theta^(-2i/d) / ff = the reference's scaled inverse frequencies."""
        from engine import ops_ref

        d, m = self.plan.dims, self.model
        rope_dim, theta = int(d["rope_dim"]), float(d["rope_theta"])
        ff = None
        tensor = next((op.attrs.get("freq_factors") for op, _ in m.graph.ops() if op.op == "rope"), None)
        if tensor and m.has(tensor):
            ff = m.dequantize(tensor)
        inv = ops_ref.rope_inv_freq(rope_dim, theta, d.get("rope_scaling"), ff)
        base = ops_ref.rope_inv_freq(rope_dim, theta)
        return (base / inv).astype(np.float32)

    def _resolve(self, arg: Arg, shape: dict[str, int]) -> Any:
        # shape "row0": the launch covers rows row0.. of the pass (a hybrid verify pass's stateful
        # launches, one per draft position: engine.spec.cuda_verify)
        row0 = shape.get("row0", 0)
        if arg.kind == "value":
            ptr = self._value_ptr[arg.ref] + row0 * self._value_rowbytes[arg.ref]
            if arg.row == "last":
                ptr += (shape["n"] - 1) * self._value_rowbytes[arg.ref]
            return ptr
        if arg.kind == "weight":
            return self._weights[arg.ref].ptr
        if arg.kind == "kv":
            return self._kv_ptr(arg.layer, arg.ref)
        if arg.kind == "input":
            return self._in_dev.ptr + self._in_off[arg.ref] + (4 * row0 if arg.ref in _STATE_ROWS else 0)
        if arg.kind == "shape":
            if arg.ref.startswith("splits:"):
                return -(-shape["max_ctx"] // int(arg.ref.split(":")[1]))
            return shape[arg.ref]
        if arg.kind == "state":
            return self._state_ptr(arg.ref)
        if arg.kind == "scratch":
            return self._scratch[arg.ref].ptr
        if arg.kind == "const":
            return arg.ref
        if arg.kind == "tmap":
            return self._tensor_map(*arg.ref)
        raise MemraError(
            f"plan argument kind {arg.kind!r} is unknown to the CUDA runner", code="internal_error"
        )

    def _shape(self, n: int, nseq: int, max_q: int = 1) -> dict[str, int]:
        return {
            "n": n,
            "nseq": nseq,
            "max_q": max_q,
            "max_blocks": self._table_ld,
            "block_size": self.block_size,
            "max_ctx": self.max_model_len,
        }

    def _bind_pass(
        self,
        mode: str,
        n: int,
        nseq: int,
        head_only: bool,
        sampling: str,
        short: bool = False,
        max_q: int = 1,
        groups: tuple[int, ...] = (),
        verify: bool = False,
        tail: bool = False,
    ) -> list[Any]:  # (engine.runner_cuda._Bound)
        """The bound launches of a pass. ``groups`` (a decode pass): launches with recurrent state
        run once per group of consecutive rows (a hybrid verify pass, one group per draft
        position, in order: engine.spec.cuda_verify), every other launch once over all rows.
        ``verify``: a verify pass's short-context launches (engine.ir.VSHORT) where the plan has them;
        ``tail``: a prompt tail's pass, its attention past short_context the TAIL launches."""
        # a TAIL pass's sequences: at most TAIL_SEQS (its partial launch's grid; no other decode launch reads nseq)
        shape = self._shape(n, min(nseq, TAIL_SEQS) if tail else nseq, max_q)
        bound = []
        for step in self.plan.steps:
            if head_only and not step.head:
                continue
            if mode == "prefill" and step.head:
                continue
            if head_only:
                key = launch_key(step.launches, _decode_mode(n, self.plan.wide_rows), short, verify)
            else:
                key = pass_key(step, mode, n, short, verify, self.plan.b1_rows, tail)
            for launch in step.launches[key]:
                if not launch.runs_at(n):
                    continue
                if groups and any(a.kind == "state" for a in launch.args):
                    row0 = 0
                    for c in groups:
                        bound.append(self._bind(launch, {**shape, "n": c, "nseq": c, "row0": row0}))
                        row0 += c
                else:
                    bound.append(self._bind(launch, shape))
        if mode != "prefill" or head_only:
            for launch in self.plan.sampling[sampling]:
                bound.append(self._bind(launch, shape))
        return bound

    def _prefill_pass_bound(self, n: int, nseq: int, max_q: int) -> list[Any]:
        """The bound prefill pass of ``n`` tokens in ``nseq`` sequences (longest chunk ``max_q``),
        from an LRU of PREFILL_SHAPES_KEPT shapes: a warm-prefix tail stays bound."""
        key = ("prefill", n, nseq, max_q)
        bound = self._prefill_bound.pop(key, None) or self._bind_pass("prefill", n, nseq, False, "", max_q=max_q)
        self._prefill_bound[key] = bound  # most recently used last
        if len(self._prefill_bound) > PREFILL_SHAPES_KEPT:
            del self._prefill_bound[next(iter(self._prefill_bound))]
        return bound

    def _warm_up(self, defer: bool) -> None:
        """The passes a prefix-cache hit runs, bound and captured ahead (engine.runner_warm): now,
        or with ``defer`` by the engine thread once the server is ready (``background_work``)."""
        self._deferred: list[Callable[[], Any]] = []
        if defer:
            units = warm_units(self)  # (now: a hybrid's tail graph keys registered at build)
            self._deferred.append(lambda: units)
        else:
            run_now(self)

    def background_work(self) -> Iterator[int] | None:
        """The deferred ahead-of-time work (engine.runner_warm.background: one unit per ``next``,
        run by the engine thread between requests), handed out once; None when there is none."""
        work, self._deferred = self._deferred, []
        return background(self, work) if work else None

    def _head_bound(self, k: int, kind: str) -> list[Any]:
        """The bound head pass of ``k`` rows and sampling ``kind`` (bound on first use, kept)."""
        key = ("head", k, kind)
        if key not in self._eager:
            self._eager[key] = self._bind_pass(_decode_mode(k, self.plan.wide_rows), k, k, True, kind)
        return self._eager[key]

    def _run_prefill_layers(self, n: int, nseq: int, max_q: int) -> None:
        """The layers of a prefill pass (inputs uploaded): the captured tail graph for one sequence's
        block_size tokens (a prefix-cache hit's tail when the prompt ends on a block boundary) when
        graphs are on, else eagerly."""
        tail = self._graphs.get(("tail", n)) if nseq == 1 and self.use_graphs else None
        if tail is not None:
            tail[0].launch(self.stream)
        else:
            self._run(self._prefill_pass_bound(n, nseq, max_q))

    def step(self, items: Sequence[StepItem]) -> list[int | None]:
        # a CUDA context is current per thread: the engine loop steps from its own thread, not
        # the one that built the runner (graph instantiation there failed with INVALID_CONTEXT)
        self._ensure_context()
        self._sync_step_allowed()
        out: list[int | None] = [None] * len(items)
        decode: list[int] = []
        prefill: list[int] = []
        parts: list[StepItem] = []  # the prefill items, less their prompt's tail
        tails: list[int] = []  # items whose prompt's tail runs as decode rows (engine.runner_tail)
        tail_of: list[int] = []
        whole = whole_block_tails(self)
        for i, it in enumerate(items):
            self._check_item(it)
            if is_decode_row(it):
                decode.append(i)
                continue
            t = tail_count(it, self.block_size, whole)
            if t:
                tails.append(i)
                tail_of.append(t)
            if t < len(it.token_ids):
                prefill.append(i)
                parts.append(split_item(it, t) if t else it)
        for sub in self._prefill_passes(parts):
            for idx, tok in self._run_prefill_pass(sub).items():
                out[prefill[idx]] = tok
        if tails:
            ids = run_tails(self, [(items[i], t) for i, t in zip(tails, tail_of, strict=True)])
            for i, tok in zip(tails, ids, strict=True):
                out[i] = tok
        limit = self._max_rows
        for lo in range(0, len(decode), limit):
            rows = decode[lo : lo + limit]
            ids = self._decode([items[i] for i in rows])
            for i, tok in zip(rows, ids, strict=True):
                out[i] = tok if items[i].sample else None
        return out

    verify_during = True  # verify(items, during=) calls ``during`` while its first pass runs

    def verify(self, items: Sequence[StepItem], during: Callable[[], None] | None = None) -> list[list[int]]:
        """Runner.verify (engine.types.VerifyingRunner): each draft item's k+1 positions run as
        decode rows of one bucket graph (engine.spec.cuda_verify); other items as in ``step``.
        ``during`` runs on the host once the first verify pass is queued, before the wait for it."""
        from engine.spec.cuda_verify import verify

        self._ensure_context()
        self._sync_step_allowed()
        return verify(self, items, during)

    def prepare_verify(self, k: int) -> int:
        """Capture the verify graphs of drafts up to ``k`` tokens ahead (engine.spec.cuda_verify.prepare);
        a runner built with ``defer_warm_up`` whose background work is not handed out yet queues
        them there instead (0 now)."""
        from engine.spec.cuda_verify import prepare, verify_captures

        if self._deferred:
            self._deferred.append(lambda: verify_captures(self, k))
            return 0
        self._ensure_context()
        return prepare(self, k)

    def _check_item(self, it: StepItem) -> None:
        check_step_item(
            it,
            max_model_len=self.max_model_len,
            block_size=self.block_size,
            num_blocks=self.num_blocks,
            vocab=self.plan.dims["vocab"],
        )

    def _fill_sampling(self, row: int, it: StepItem) -> None:
        s = it.sampling
        self._views["counters"][row] = it.num_generated
        if self._row_sampling[row] is not s:  # else the same (frozen) params as this row's last write
            self._row_sampling[row] = s
            seed = (s.seed or 0) & 0xFFFFFFFFFFFFFFFF
            fields = (s.temperature, s.top_p, s.top_k, s.min_p, seed, s.presence_penalty, s.frequency_penalty,
                      s.repetition_penalty)  # fmt: skip
            self._write_sampling(row, fields)

    def _clear_sampling(self, row: int) -> None:
        self._views["counters"][row] = 0
        if self._row_sampling[row] is not _CLEARED:
            self._row_sampling[row] = _CLEARED
            self._write_sampling(row, _NEUTRAL_SAMPLING)

    def _write_sampling(self, row: int, fields: Sequence[Any]) -> None:
        for name, value in zip(_SAMPLING_VIEWS, fields, strict=True):
            self._views[name][row] = value

    def _sampling_kind(self, items: Sequence[StepItem]) -> str:
        """greedy / sample / penalised (the penalty entries are written to the pinned inputs), as
        masked_<kind> when a row has a logit bias or a constraint mask (the token_mask inputs are
        packed too), masked_<kind>_lp when rows ask for logprobs (at most LP_SLOTS: the logprobs
        kernel computes them after the sampler), or host: the step has more penalty or bias entries
        than the device buffers hold, so every row needing more than a plain sample is re-sampled on
        the host from its logits after a plain sample pass. With more than LP_SLOTS logprobs rows,
        those rows (``_host_rows``) get no device entries, so their logits stay raw, and are
        re-sampled on the host."""
        s = items[0].sampling
        if not s.needs_host and not s.uses_penalties and all(it.sampling is s and it.allowed is None for it in items):
            self._host_rows = []  # (one plain params object, no mask: a verify pass's rows, a solo step)
            return "greedy" if s.greedy else "sample"
        lp_rows = [r for r, it in enumerate(items) if _wants_logprobs(it)]
        device_lp = len(lp_rows) <= LP_SLOTS
        self._host_rows = [] if device_lp else lp_rows
        skip = frozenset(self._host_rows)
        kind = self._penalty_kind(items, skip)
        if kind == "host" or not any(on_device(it) for r, it in enumerate(items) if r not in skip):
            return kind
        size = self._prep.pack(items, skip, logprobs=device_lp)
        if size is None:
            return "host"
        self._prep_bytes = size
        return MASKED + kind + (LOGPROBS if self._prep.lp_rows else "")

    def _penalty_kind(self, items: Sequence[StepItem], skip: frozenset[int]) -> str:
        if not any(it.sampling.uses_penalties for r, it in enumerate(items) if r not in skip):
            return "greedy" if all(it.sampling.greedy for r, it in enumerate(items) if r not in skip) else "sample"
        vocab = self.plan.values["logits"].width
        parts, total = [], 0
        for r, it in enumerate(items):
            if not it.sampling.uses_penalties or r in skip:
                continue
            toks, info = penalty_entries(it.sampling, it.history, it.prompt_len, vocab, it.prompt_memo)
            parts.append((r, toks, info))
            total += toks.size
        if total > PENALTY_CAPACITY:
            return "host"
        ent = self._pen[4 : 4 + 3 * total].reshape(total, 3)
        at = 0
        for r, toks, info in parts:
            ent[at : at + toks.size, 0] = r
            ent[at : at + toks.size, 1] = toks
            ent[at : at + toks.size, 2] = info
            at += toks.size
        self._pen[0] = total
        self._pen_count = total
        return "penalised"

    def _read_ids(self, rows: int, copied: bool = False) -> np.ndarray:
        """The sampled ids of the last pass; ``copied``: the pass itself (an io graph) queued their
        copy to the host, so only the wait is left."""
        if not copied:
            self._ids_to_host(rows)
        self.stream.synchronize()
        return self._views["out_ids"][:rows].copy()

    def _decode(
        self,
        items: Sequence[StepItem],
        short_ok: bool = True,
        state_snap: Sequence[int] | None = None,
        groups: tuple[int, ...] = (),
        exact: bool = False,
        verify: bool = False,
        during: Callable[[], None] | None = None,
        tail: bool = False,
    ) -> list[int]:
        """Decode rows through the bucket's graph; ``short_ok=False`` keeps the long-context
        launches (speculative verify rows of one sequence, engine.spec.cuda_verify). A hybrid
        verify pass gives each row's snapshot slot (``state_snap``) and the row groups its stateful
        launches run in, one after another (``groups``, the padding rows joining the last).
        ``exact``: a pass of exactly ``len(items)`` rows (a graph per row count, no padding rows:
        a verify pass of k + 1 rows, engine.spec.cuda_verify) instead of the bucket's;
        ``verify``: a verify pass's short-context launches (engine.ir.VSHORT) where the plan has them;
        ``during``: host work run once the pass is queued, before the wait for it; ``tail``: a
        prompt tail's pass (engine.runner_tail): past short_context, where the plan has them, its
        attention runs the TAIL launches (the key split's partials over each sequence's rows,
        ``_fill_seq_starts``)."""
        n = len(items)
        bucket, groups = self._fill_decode(items, state_snap, groups, n if exact else 0)
        kind = self._sampling_kind(items)
        launch_kind = "sample" if kind == "host" else kind
        short = short_ok and max(it.start_pos for it in items) < self.plan.short_context
        tail = tail and not short and self._tail_attention
        if tail:
            self._fill_seq_starts(items, bucket)
        # a graph without penalty or token_mask entries copies the inputs in and the sampled ids
        # out itself (pinned host memory): one driver call per step, then the wait
        io = self.use_graphs and not ("penalised" in kind or kind.startswith(MASKED))
        if not io:
            self._upload_inputs(bucket, kind)
        if groups:
            self._keep_grouping((bucket, launch_kind, short, io, groups))
        self._launch_decode_pass(bucket, launch_kind, short, io=io, groups=groups, verify=verify, tail=tail)
        if during is not None:
            during()
        ids = self._read_ids(n, copied=io).tolist()
        self._tap_decode(items)
        return self._host_sample(items, ids, kind)

    def _launch_decode_pass(
        self, bucket: int, kind: str, short: bool, io: bool = False, groups: tuple[int, ...] = (), verify: bool = False,
        tail: bool = False,
    ) -> None:
        """Run the bucket's decode pass on the stream: its CUDA graph, or eagerly without graphs."""
        if self.use_graphs:
            self._graph(bucket, kind, short, io=io, groups=groups, verify=verify, tail=tail).launch(self.stream)
            return
        key = ("decode", bucket, kind, short, groups, *(("verify",) if verify else ()), *(("tail",) if tail else ()))
        if key not in self._eager:
            mode = _decode_mode(bucket, self.plan.wide_rows)
            self._eager[key] = self._bind_pass(mode, bucket, bucket, False, kind, short, groups=groups, verify=verify,
                                               tail=tail)  # fmt: skip
        self._run(self._eager[key])

    def _fill_decode(
        self, items: Sequence[StepItem], state_snap: Sequence[int] | None, groups: tuple[int, ...], rows: int = 0
    ) -> tuple[int, tuple[int, ...]]:
        """Write decode rows' inputs into the pinned block (padding rows up to the bucket at the
        sinks, or up to ``rows`` where given); returns the bucket and the row groups with the
        padding rows in the last."""
        n = len(items)
        bucket = rows or self._bucket_of[n]
        v = self._views
        ld = self._table_ld
        tables = self._tables[: bucket * ld].reshape(bucket, ld)
        lens, sink, bs = self._table_len, self._sink_block, self.block_size
        tokens, positions, slots = v["tokens"], v["positions"], v["slots"]
        prev = None  # the last row's block table (a verify pass's rows share their sequence's)
        run = k = 0  # the first row of the rows sharing ``prev``, and its length: one copy for them
        for r, it in enumerate(items):
            pos = it.start_pos
            tokens[r] = it.token_ids[0]
            positions[r] = pos
            bt = it.block_table
            if bt is not prev:
                if r - run > 1:
                    tables[run + 1 : r, :k] = tables[run, :k]
                k = min(len(bt), ld)
                tables[r, :k] = bt[:k]
                run, prev = r, bt
            if lens[r] > k:  # a shorter table than this row's last one: the rest back to the sink
                tables[r, k : lens[r]] = sink
            lens[r] = k
            slots[r] = bt[pos // bs] * bs + pos % bs
            if self.window_kv_blocks:
                self._fill_window(r, r, it, np.array([pos]))
            self._fill_sampling(r, it)
        if n - run > 1:
            tables[run + 1 : n, :k] = tables[run, :k]
        for r in range(n, bucket):  # padding rows: token 0 at position 0 of the sink block
            v["tokens"][r] = 0
            v["positions"][r] = 0
            v["slots"][r] = sink * self.block_size
            self._pad_window(r)
            if lens[r]:
                tables[r, : lens[r]] = sink
                lens[r] = 0
            self._clear_sampling(r)
        self._fill_state_decode(items, bucket)
        if groups:
            v["state_snap"][:n] = state_snap
            groups = (*groups[:-1], groups[-1] + bucket - n)
        return bucket, groups

    def _fill_seq_starts(self, items: Sequence[StepItem], bucket: int) -> None:
        """A prompt tail's pass (TAIL attention, engine.lowering.attention): ``seq_starts`` as a
        prefill pass's, its sequences the runs of consecutive rows of one sequence at consecutive
        positions (run_tails packs each tail's rows in order, at most TAIL_SEQS tails: the grid's
        sequences), the padding rows (a capture's warm run: every row at position 0 of the sink
        block) one more, whose rows read the sink block only; the entries past them empty."""
        ss = self._views["seq_starts"]
        s, prev = 0, None
        for r, it in enumerate(items):
            if prev is None or it.seq_id != prev.seq_id or it.start_pos != prev.start_pos + 1:
                ss[s] = r
                s += 1
            prev = it
        n = len(items)
        if n < bucket:
            ss[s] = n
            s += 1
        if s > min(bucket, TAIL_SEQS):
            raise MemraError(f"a prompt-tail pass of {s} sequences (at most {TAIL_SEQS})", code="internal_error")
        ss[s : bucket + 1] = bucket

    def _keep_grouping(self, key: tuple) -> None:
        """Hybrid verify passes get a graph (or bound eager pass) per row grouping: keep the
        GROUPINGS_KEPT most recently used, destroying the least recently used one's (never the
        prompt tails' graphs, engine.runner_tail.tail_captures: ``_tail_keys``)."""
        if key in self._tail_keys:  # (a prompt tail's graph, captured ahead: kept for good)
            return
        kept = getattr(self, "_groupings", None)
        if kept is None:
            kept = self._groupings = {}
        kept.pop(key, None)
        kept[key] = None
        if len(kept) > GROUPINGS_KEPT:
            old = next(iter(kept))
            del kept[old]
            bucket, kind, short, io, groups = old
            graph = self._graphs.pop((bucket, kind, short, io, groups), None)
            if graph is not None:
                self.stream.synchronize()
                graph[0].destroy()
            self._eager.pop(("decode", bucket, kind, short, groups), None)

    def _host_sample(self, items: Sequence[StepItem], ids: list[int], kind: str) -> list[int]:
        """The device's logprobs of a ``_lp`` step into the items, then rows re-sampled on the host
        from their logits (engine.sampling.sample_item): logprobs rows past LP_SLOTS, and in a
        ``host`` step (more penalty or bias entries than the device buffers hold) every row with
        penalties, logit bias, a mask or logprobs; every other row keeps its id."""
        if kind.endswith(LOGPROBS):
            self._logprobs_to_host()
            self._prep.logprobs_out(items)
        if kind == "host":
            rows = [r for r, it in enumerate(items) if it.sampling.uses_penalties or _on_host(it)]
        else:
            rows = self._host_rows
        if not rows:
            return ids
        logits = self.read_logits(max(rows) + 1)
        for r in rows:
            ids[r] = sample_item(logits[r], items[r])
        return ids

    def _prefill_passes(self, items: Sequence[StepItem]) -> list[list[tuple[int, StepItem, int, int]]]:
        """Pack the prefill items into passes of at most ``prefill_chunk_tokens`` rows: each entry is
        (item index, item, lo, hi), the item's tokens lo..hi-1. A long item is split over consecutive
        passes (its earlier chunk's KV is in the cache before the next pass), a hybrid's at absolute
        positions on its ``state_align`` grid (a warm run resumed there computes the same bits). With a plan whose
        prefill attention is not varlen, every pass holds one sequence."""
        chunk = self.profile.prefill_chunk_tokens
        max_seqs = self._max_rows if self._varlen else 1
        align = self.state_align
        passes: list[list[tuple[int, StepItem, int, int]]] = []
        cur: list[tuple[int, StepItem, int, int]] = []
        used = 0
        for idx, it in enumerate(items):
            lo, n = 0, len(it.token_ids)
            while lo < n:
                if used == chunk or len(cur) == max_seqs:
                    passes.append(cur)
                    cur, used = [], 0
                take = min(n - lo, chunk - used)
                if take < n - lo and align > 1:  # a cut inside the item: on the state grid
                    cut = aligned_count(it.start_pos + lo, take, align)
                    if not cut and used:  # no grid position in this pass's room: the next pass
                        passes.append(cur)
                        cur, used = [], 0
                        continue
                    take = cut or take
                cur.append((idx, it, lo, lo + take))
                used += take
                lo += take
        if cur:
            passes.append(cur)
        return passes

    def _head_input_rows(self) -> list[tuple[str, int, int]]:
        """Values the head reads that the layers produced (moved to rows 0..k-1 before the head)."""
        if self._head_inputs is None:
            produced_in_head: set[str] = set()
            needed: list[str] = []
            for step in self.plan.steps:
                if not step.head:
                    continue
                for name in step.op.inputs:
                    if name not in produced_in_head and name not in needed:
                        needed.append(name)
                produced_in_head.update(step.op.outputs)
            self._head_inputs = [(nm, self._value_ptr[nm], self._value_rowbytes[nm]) for nm in needed]
        return self._head_inputs
