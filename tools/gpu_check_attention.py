"""GPU check + benchmark of the attention kernels: attention_prefill (varlen flash attention over the
paged KV cache) and paged decode attention (split-KV + attention_combine, and the direct variant).

Run on a GPU machine: ``PYTHONPATH=. python3 tools/gpu_check_attention.py --out DIR [--quick]``.
Writes DIR/gpu_check_attention.json (every row) and DIR/gpu_check_attention.txt (a short table).
Every check builds a random paged cache (random non-contiguous block tables, fixed seed), poisons
the output with NaN, and compares with a torch f32 reference computed from the cache gathered on
the host (relative error ||out - ref|| / ||ref||, bf16 tolerance, NaN fails). Timings: median of
CUDA-event-timed repeats after warm-up. Prefill: TFLOP/s counting causal work
(4 * heads * head_dim * sum over rows of keys attended) against the H200 bf16 peak and against
torch.nn.functional.scaled_dot_product_attention (causal, contiguous tensors, same shape). Decode:
GB/s of K+V bytes read against the 4100 GB/s copy roofline, over a split / warps sweep.
torch is only the allocator / timer / reference / baseline here (never in engine/).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_kernels_check import DEV, PROFILE, Kernels, Recorder, bench, check, i32, nan_like, run_steps  # noqa: E402

from engine import kernel_catalog as kc  # noqa: E402

RESULTS: list[dict] = []
T0 = time.time()
PEAK_TFLOPS = 787.0
COPY_GBPS = 4100.0
BUDGET_S = 80.0  # stop timing (not checking) past this many seconds
BS = PROFILE.kv_block_size
QWEN3_4B = (32, 8, 128)  # heads, kv_heads, head_dim


_REC = Recorder(RESULTS, "check")
record, guarded = _REC.record, _REC.guarded


def bench_graph(fns, reps: int = 10) -> float:
    """Median milliseconds per call of the callables ``fns`` captured back to back into one CUDA
    graph (no Python launch gaps; cycling through several caches keeps small KV out of the 50 MB
    L2). Falls back to eager timing when capture fails."""
    for fn in fns:
        fn()
    torch.cuda.synchronize()
    try:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for fn in fns:
                fn()
        return bench(g.replay, reps) / len(fns)
    except Exception as exc:
        print(f"graph capture failed ({exc}); timing eagerly", file=sys.stderr)
        torch.cuda.synchronize()
        return bench(lambda: [fn() for fn in fns], reps) / len(fns)


class Cache:
    """A random paged KV cache: k/v bf16 [num_blocks, BS, kv_heads, head_dim] on the device, each
    sequence's blocks a random (disjoint, non-contiguous) subset of the pool."""

    def __init__(self, rng, ctxs: list[int], kvh: int, hd: int, spare: int = 7):
        need = [-(-c // BS) for c in ctxs]
        self.max_blocks = max(need)
        nblocks = sum(need) + spare
        perm = rng.permutation(nblocks)
        self.tables = np.zeros((len(ctxs), self.max_blocks), dtype=np.int32)
        at = 0
        for s, n in enumerate(need):
            self.tables[s, :n] = perm[at : at + n]
            self.tables[s, n:] = perm[-1]  # unused entries: a valid block the kernel must not read
            at += n
        g = torch.Generator(device=DEV)
        g.manual_seed(int(rng.integers(1 << 30)))
        self.k = torch.randn(nblocks, BS, kvh, hd, device=DEV, generator=g).to(torch.bfloat16)
        self.v = torch.randn(nblocks, BS, kvh, hd, device=DEV, generator=g).to(torch.bfloat16)
        self.tables_d = i32(self.tables)
        self.kvh, self.hd = kvh, hd

    def seq_kv(self, s: int, ctx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequence s's keys/values 0..ctx-1, contiguous f32 [ctx, kv_heads, head_dim]."""
        idx = np.arange(ctx)
        slots = torch.from_numpy(self.tables[s, idx // BS].astype(np.int64) * BS + idx % BS).to(DEV)
        kk = self.k.reshape(-1, self.kvh, self.hd)[slots].float()
        vv = self.v.reshape(-1, self.kvh, self.hd)[slots].float()
        return kk, vv


def ref_rows(
    q: torch.Tensor, kk: torch.Tensor, vv: torch.Tensor, pos: np.ndarray, heads: int
) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + causal mask) v in f32: q [n, heads, d] at positions pos, keys
    kk/vv [ctx, kv_heads, d]; returns [n, heads, d]."""
    n, _, d = q.shape
    group = heads // kk.shape[1]
    k = kk.repeat_interleave(group, dim=1).permute(1, 2, 0)  # [heads, d, ctx]
    v = vv.repeat_interleave(group, dim=1).permute(1, 0, 2)  # [heads, ctx, d]
    s = torch.bmm(q.permute(1, 0, 2), k) * (d**-0.5)  # [heads, n, ctx]
    p_t = torch.from_numpy(pos.astype(np.int64)).to(DEV)
    mask = torch.arange(kk.shape[0], device=DEV)[None, :] > p_t[:, None]
    s = s.masked_fill(mask[None], float("-inf"))
    return torch.bmm(torch.softmax(s, dim=-1), v).permute(1, 0, 2)


def prefill_choice(heads, kvh, hd, q_stride, out_stride, bq=64, bkv=64, warps=4) -> kc.KernelChoice:
    return kc.choice(
        "attention_prefill",
        heads=heads,
        kv_heads=kvh,
        head_dim=hd,
        block_size=BS,
        scale=float(hd) ** -0.5,
        q_stride=q_stride,
        out_stride=out_stride,
        block_q=bq,
        block_kv=bkv,
        warps=warps,
    )


def decode_choice(
    heads, kvh, hd, q_stride, out_stride, split, warps, direct, vec16=False, qsplit=1, table_first=False
) -> kc.KernelChoice:
    return kc.choice(
        "attention",
        heads=heads,
        kv_heads=kvh,
        head_dim=hd,
        block_size=BS,
        split=split,
        scale=float(hd) ** -0.5,
        q_stride=q_stride,
        out_stride=out_stride,
        mode="decode",
        direct=direct,
        warps=warps,
        vec16=vec16,
        qsplit=qsplit,
        table_first=table_first,
    )


class Prefill:
    """One varlen prefill pass: sequences with (start position, row count), the fused q|k|v buffer
    (q is its column view at q_stride), a NaN-poisoned output at out_stride."""

    def __init__(self, rng, heads, kvh, hd, seqs: list[tuple[int, int]], out_pad: int = 0):
        self.heads, self.kvh, self.hd = heads, kvh, hd
        self.seqs = seqs
        self.cache = Cache(rng, [p0 + n for p0, n in seqs], kvh, hd)
        self.rows = sum(n for _, n in seqs)
        self.q_stride = (heads + 2 * kvh) * hd
        self.out_stride = heads * hd + out_pad
        g = torch.Generator(device=DEV)
        g.manual_seed(int(rng.integers(1 << 30)))
        self.qkv = torch.randn(self.rows, self.q_stride, device=DEV, generator=g).to(torch.bfloat16)
        starts = np.cumsum([0] + [n for _, n in seqs]).astype(np.int32)
        self.pos = np.concatenate([np.arange(p0, p0 + n) for p0, n in seqs]).astype(np.int32)
        self.starts = starts
        self.starts_d, self.pos_d = i32(starts), i32(self.pos)
        self.max_q = max(n for _, n in seqs)
        self.out = nan_like((self.rows, self.out_stride))
        # causal work: every row attends positions[i] + 1 keys
        self.flops = 4.0 * heads * hd * float((self.pos.astype(np.int64) + 1).sum())

    def choice(self, bq=64, bkv=64, warps=4) -> kc.KernelChoice:
        return prefill_choice(self.heads, self.kvh, self.hd, self.q_stride, self.out_stride, bq, bkv, warps)

    def launch(self, K: Kernels, c: kc.KernelChoice) -> None:
        args = [
            self.out,
            self.qkv,
            self.cache.k,
            self.cache.v,
            self.cache.tables_d,
            self.pos_d,
            self.starts_d,
        ]
        K.launch(c, args + [self.cache.max_blocks], self.rows, max_q=self.max_q, nseq=len(self.seqs))

    def reference(self) -> np.ndarray:
        out = torch.zeros(self.rows, self.heads, self.hd, device=DEV)
        q = self.qkv[:, : self.heads * self.hd].float().reshape(self.rows, self.heads, self.hd)
        for s, (p0, n) in enumerate(self.seqs):
            lo = int(self.starts[s])
            kk, vv = self.cache.seq_kv(s, p0 + n)
            out[lo : lo + n] = ref_rows(q[lo : lo + n], kk, vv, self.pos[lo : lo + n], self.heads)
        return out.cpu().numpy().astype(np.float64)

    def result(self) -> np.ndarray:
        torch.cuda.synchronize()
        o = self.out[:, : self.heads * self.hd].float().cpu().numpy().astype(np.float64)
        return o.reshape(self.rows, self.heads, self.hd)


PREFILL_CASES = [
    # (label, heads, kv_heads, head_dim, [(start position, rows)], out_pad)
    ("qwen3-4b 4 seqs, prefix/chunk starts", 32, 8, 128, [(0, 37), (100, 130), (5, 1), (55, 64)], 0),
    ("qwen3-4b one seq 300 rows", 32, 8, 128, [(0, 300)], 0),
    ("qwen3-4b chunk at 1000", 32, 8, 128, [(1000, 200)], 0),
    ("smollm2-135m gqa3 hd64", 9, 3, 64, [(0, 70), (33, 17), (200, 129)], 0),
    ("gqa1 hd64 padded out", 16, 16, 64, [(0, 65), (7, 3)], 64),
    ("gqa8 hd128", 32, 4, 128, [(16, 80), (0, 1), (300, 47)], 0),
    ("gqa4 hd128 2048 rows", 32, 8, 128, [(0, 2048)], 0),
]
PREFILL_TILES = [(64, 64, 4), (64, 32, 4), (128, 32, 8), (32, 64, 2), (32, 32, 2)]


def prefill_checks(K: Kernels, quick: bool) -> None:
    profile_tile = tuple(PROFILE.tune("attention_prefill")[x] for x in ("block_q", "block_kv", "warps"))
    for i, (label, h, kvh, hd, seqs, pad) in enumerate(PREFILL_CASES):
        tiles = [profile_tile] if quick else list(dict.fromkeys([profile_tile] + PREFILL_TILES[:3]))
        for tile in tiles:

            def one(i=i, label=label, h=h, kvh=kvh, hd=hd, seqs=seqs, pad=pad, tile=tile):
                rng = np.random.default_rng(1000 + i)
                pf = Prefill(rng, h, kvh, hd, seqs, pad)
                c = pf.choice(*tile)
                pf.launch(K, c)
                out = pf.result()
                if pad:  # the padding columns must stay untouched (NaN)
                    torch.cuda.synchronize()
                    assert torch.isnan(pf.out[:, h * hd :].float()).all(), "wrote past heads * head_dim"
                record(f"prefill {label} tile {tile}", out, pf.reference(), 1e-2, entry=c.spec.entry)

            guarded(f"prefill {label} tile {tile}", one)


def time_prefill(K: Kernels, quick: bool) -> None:
    h, kvh, hd = QWEN3_4B
    tokens = (512, 4096) if quick else (512, 2048, 4096)
    tiles = [tuple(PROFILE.tune("attention_prefill")[x] for x in ("block_q", "block_kv", "warps"))]
    if not quick:
        tiles = list(dict.fromkeys(tiles + PREFILL_TILES))
    for t in tokens:
        rng = np.random.default_rng(t)
        pf = Prefill(rng, h, kvh, hd, [(0, t)])
        # baseline: SDPA on contiguous [1, heads, t, hd] tensors, GQA expanded
        q = pf.qkv[:, : h * hd].reshape(1, t, h, hd).transpose(1, 2).contiguous()
        kk = torch.randn(1, h, t, hd, device=DEV).to(torch.bfloat16)
        vv = torch.randn(1, h, t, hd, device=DEV).to(torch.bfloat16)

        def sdpa(q=q, kk=kk, vv=vv):
            torch.nn.functional.scaled_dot_product_attention(q, kk, vv, is_causal=True)

        ms_t = bench(sdpa, 20)
        tf_t = pf.flops / ms_t / 1e9
        for tile in tiles:

            def one(pf=pf, tile=tile, t=t, ms_t=ms_t, tf_t=tf_t):
                c = pf.choice(*tile)
                ms = bench(lambda: pf.launch(K, c), 20)
                tf = pf.flops / ms / 1e9
                record(
                    f"prefill time {t} tok tile {tile}",
                    tokens=t,
                    tile=list(tile),
                    ms=ms,
                    TFLOPs=tf,
                    frac_peak=tf / PEAK_TFLOPS,
                    sdpa_ms=ms_t,
                    sdpa_TFLOPs=tf_t,
                    vs_sdpa=ms_t / ms,
                )

            guarded(f"prefill time {t} tile {tile}", one)
        # several sequences in one pass (4 x t/4, a varlen pass as the runner packs it)
        if t >= 2048:

            def multi(t=t, tile=tiles[0]):
                pf4 = Prefill(np.random.default_rng(t + 1), h, kvh, hd, [(0, t // 4)] * 4)
                c = pf4.choice(*tile)
                ms = bench(lambda: pf4.launch(K, c), 20)
                record(
                    f"prefill time 4x{t // 4} tok tile {tile}", tokens=t, ms=ms, TFLOPs=pf4.flops / ms / 1e9
                )

            guarded(f"prefill time 4x{t // 4}", multi)


class Decode:
    """Decode rows: row i is sequence i at context ctxs[i] (position ctxs[i] - 1)."""

    def __init__(self, rng, heads, kvh, hd, ctxs: list[int], max_ctx: int | None = None):
        self.heads, self.kvh, self.hd = heads, kvh, hd
        self.ctxs = ctxs
        self.cache = Cache(rng, ctxs, kvh, hd)
        self.rows = len(ctxs)
        self.q_stride = (heads + 2 * kvh) * hd
        self.out_stride = heads * hd
        g = torch.Generator(device=DEV)
        g.manual_seed(int(rng.integers(1 << 30)))
        self.qkv = torch.randn(self.rows, self.q_stride, device=DEV, generator=g).to(torch.bfloat16)
        self.pos = np.array([c - 1 for c in ctxs], dtype=np.int32)
        self.pos_d = i32(self.pos)
        self.max_ctx = max_ctx or max(ctxs)
        self.out = nan_like((self.rows, self.out_stride))
        self.kv_bytes = 2.0 * sum(ctxs) * kvh * hd * 2

    def launches(
        self, K: Kernels, split: int, warps: int, direct: bool, vec16: bool = False, qsplit: int = 1, tf: bool = False
    ):
        c = decode_choice(
            self.heads, self.kvh, self.hd, self.q_stride, self.out_stride, split, warps, direct, vec16, qsplit, tf
        )
        ms_ = 1 if direct else -(-self.max_ctx // split)
        po = torch.full((self.rows, self.heads, ms_, self.hd), float("nan"), device=DEV)
        pml = torch.full((self.rows, self.heads, ms_, 2), float("nan"), device=DEV)
        cc = kc.choice(
            "attention_combine", heads=self.heads, head_dim=self.hd, split=split, out_stride=self.out_stride
        )
        tab, m = self.cache.tables_d, self.cache.max_blocks

        def run():
            args = [self.out, 0 if direct else po, 0 if direct else pml, self.qkv, self.cache.k, self.cache.v]
            K.launch(c, args + [tab, self.pos_d, m, ms_], self.rows, max_splits=ms_)
            if not direct:
                K.launch(cc, [self.out, po, pml, self.pos_d, ms_], self.rows)

        return c, run

    def reference(self) -> np.ndarray:
        q = self.qkv[:, : self.heads * self.hd].float().reshape(self.rows, self.heads, self.hd)
        out = torch.zeros(self.rows, self.heads, self.hd, device=DEV)
        for s, ctx in enumerate(self.ctxs):
            kk, vv = self.cache.seq_kv(s, ctx)
            out[s : s + 1] = ref_rows(q[s : s + 1], kk, vv, self.pos[s : s + 1], self.heads)
        return out.cpu().numpy().astype(np.float64)

    def result(self) -> np.ndarray:
        torch.cuda.synchronize()
        return self.out.float().cpu().numpy().astype(np.float64).reshape(self.rows, self.heads, self.hd)


DECODE_CTXS = [1, 17, 511, 512, 513, 4096]


def decode_checks(K: Kernels, quick: bool) -> None:
    tune = PROFILE.tune("attention_decode")
    w0 = tune["warps"]
    split0 = max(4 * w0, tune["split_kv_tokens"] // (4 * w0) * 4 * w0)
    cases = [("qwen3-4b", 32, 8, 128), ("smollm2-135m gqa3 hd64", 9, 3, 64), ("gqa8 hd128", 32, 4, 128)]
    variants = [(split0, w0, False), (split0, w0, True), (256, 4, False), (1024, 8, False)]
    if quick:
        variants = variants[:2]
    # (table_first: the first table chunk staged before the position is known, split and direct)
    variants = [v + (vec, False) for vec in (False, True) for v in variants]
    variants += [(split0, w0, direct, True, True) for direct in (False, True)]
    for i, (label, h, kvh, hd) in enumerate(cases):
        for split, warps, direct, vec, tf in variants:
            name = f"decode {label} ctx {DECODE_CTXS} split {split} warps {warps} direct {direct} vec16 {vec}"
            name += " table_first" if tf else ""

            def one(i=i, h=h, kvh=kvh, hd=hd, split=split, warps=warps, direct=direct, vec=vec, tf=tf, name=name):
                dc = Decode(np.random.default_rng(2000 + i), h, kvh, hd, DECODE_CTXS, max_ctx=4100)
                c, run = dc.launches(K, split, warps, direct, vec, tf=tf)
                run()
                record(name, dc.result(), dc.reference(), 1e-2, entry=c.spec.entry)

            guarded(name, one)
        group = h // kvh
        for qs in sorted({group, max(q for q in range(1, group) if group % q == 0)} - {1}):
            for vec in (False, True):  # direct with the kv head's query heads split over grid z
                name = f"decode {label} ctx {DECODE_CTXS} direct qsplit {qs} warps 8 vec16 {vec}"

                def one(i=i, h=h, kvh=kvh, hd=hd, qs=qs, vec=vec, name=name):
                    dc = Decode(np.random.default_rng(3000 + i), h, kvh, hd, DECODE_CTXS, max_ctx=4100)
                    c, run = dc.launches(K, 256, 8, True, vec, qs)
                    run()
                    record(name, dc.result(), dc.reference(), 1e-2, entry=c.spec.entry)

                guarded(name, one)


def time_decode(K: Kernels, quick: bool) -> None:
    h, kvh, hd = QWEN3_4B
    tune = PROFILE.tune("attention_decode")
    w0 = tune["warps"]
    split0 = max(4 * w0, tune["split_kv_tokens"] // (4 * w0) * 4 * w0)
    sweep = [(s, w, False) for w in (4, 8) for s in (128, 256, 512, 1024, 2048)] + [
        (64, 4, True),
        (64, 8, True),
    ]
    if quick:
        sweep = [(split0, w0, False), (64, w0, True)]
    sweep = [v + (vec,) for vec in (False, True) for v in [(split0, w0, False)] + sweep]
    for b in (1, 8, 32):
        for ctx in (512, 4096):
            kv = 2.0 * b * ctx * kvh * hd * 2
            copies = int(min(32, max(1, -(-150e6 // kv))))  # > 150 MB of KV per graph: not L2-resident
            dcs = [Decode(np.random.default_rng(b * ctx + j), h, kvh, hd, [ctx] * b) for j in range(copies)]
            dc = dcs[0]
            for split, warps, direct, vec in dict.fromkeys(sweep):
                if not direct and split > ctx and split != split0:
                    continue
                if time.time() - T0 > BUDGET_S:
                    record(f"decode time b{b} ctx{ctx}: skipped (budget)")
                    break

                def one(dc=dc, dcs=dcs, split=split, warps=warps, direct=direct, vec=vec, b=b, ctx=ctx):
                    ms = bench_graph([d.launches(K, split, warps, direct, vec)[1] for d in dcs], 10)
                    gbps = dc.kv_bytes / ms / 1e6
                    record(
                        f"decode time b{b} ctx{ctx} split {split} warps {warps} direct {direct} vec16 {vec}",
                        batch=b,
                        ctx=ctx,
                        split=split,
                        warps=warps,
                        direct=direct,
                        vec16=vec,
                        profile_default=(split, warps, direct, vec)
                        == (split0, w0, False, bool(tune.get("vec16"))),
                        us=ms * 1e3,
                        GBps=gbps,
                        frac_copy=gbps / COPY_GBPS,
                    )

                guarded(
                    f"decode time b{b} ctx{ctx} split {split} warps {warps} direct {direct} vec16 {vec}", one
                )


def precompile(K: Kernels) -> None:
    specs = []
    for _, h, kvh, hd, _, pad in PREFILL_CASES:
        for tile in PREFILL_TILES:
            try:
                specs.append(prefill_choice(h, kvh, hd, (h + 2 * kvh) * hd, h * hd + pad, *tile).spec)
            except Exception:
                pass
    tune = PROFILE.tune("attention_decode")
    w0 = tune["warps"]
    split0 = max(4 * w0, tune["split_kv_tokens"] // (4 * w0) * 4 * w0)
    used = {(split0, w0, False), (split0, w0, True), (256, 4, False), (1024, 8, False)}  # decode_checks
    for h, kvh, hd in (QWEN3_4B, (9, 3, 64), (32, 4, 128)):
        combos = set(used)
        if (h, kvh, hd) == QWEN3_4B:  # time_decode's sweep
            combos |= {(s, w, False) for w in (4, 8) for s in (128, 256, 512, 1024, 2048)}
            combos |= {(64, 4, True), (64, 8, True)}
        for s, w, direct in sorted(combos):
            for vec in (False, True):
                try:
                    q_stride = (h + 2 * kvh) * hd
                    specs.append(decode_choice(h, kvh, hd, q_stride, h * hd, s, w, direct, vec).spec)
                except Exception:
                    pass
            if not direct:
                specs.append(kc.spec("attention_combine", heads=h, head_dim=hd, split=s, out_stride=h * hd))
    stats = K.builder.build_all(list(dict.fromkeys(specs)), jobs=os.cpu_count() or 4, progress=None)
    record("precompile", specs=len(specs), compiled=stats.compiled, hits=stats.hits, seconds=time.time() - T0)


def table(rows: list[dict]) -> str:
    lines = [f"{'check':78s} result"]
    for r in rows:
        if "rel_err" in r:
            res = f"{'ok ' if r['ok'] else 'FAIL'} rel_err={r['rel_err']:.2e} nans={r['nans']}"
        elif "TFLOPs" in r:
            res = f"{r['ms']:.3f} ms {r['TFLOPs']:.1f} TFLOP/s"
            if "sdpa_TFLOPs" in r:
                res += f" ({r['frac_peak']:.0%} of peak) | sdpa {r['sdpa_TFLOPs']:.1f} TFLOP/s x{r['vs_sdpa']:.2f}"
        elif "GBps" in r:
            res = f"{r['us']:.1f} us {r['GBps']:.0f} GB/s ({r['frac_copy']:.0%})" + (
                " [profile]" if r.get("profile_default") else ""
            )
        elif r.get("ok") is False:
            res = f"FAIL {r.get('error', '')[:120]}"
        else:
            res = " ".join(f"{k}={v}" for k, v in r.items() if k != "check")
        lines.append(f"{r['check'][:78]:78s} {res}")
    best = {}
    for r in rows:
        if "GBps" in r:
            key = (r["batch"], r["ctx"])
            if key not in best or r["GBps"] > best[key]["GBps"]:
                best[key] = r
    for (b, ctx), r in sorted(best.items()):
        lines.append(
            f"best decode b{b} ctx{ctx}: split {r['split']} warps {r['warps']} direct {r['direct']} "
            f"vec16 {r['vec16']} {r['GBps']:.0f} GB/s"
        )
    bad = [r["check"] for r in rows if r.get("ok") is False]
    lines.append(f"{len(bad)} failing" + (f": {bad}" if bad else ""))
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", default="", help="comma list of: prefill,decode,tprefill,tdecode")
    args = ap.parse_args()
    torch.zeros(1, device=DEV)
    from cuda.bindings import driver as drv

    check(drv.cuInit(0))
    print(torch.cuda.get_device_name(), file=sys.stderr)
    K = Kernels("/tmp/memra-kcache")
    guarded("precompile", lambda: precompile(K))
    steps = {
        "prefill": lambda: prefill_checks(K, args.quick),
        "decode": lambda: decode_checks(K, args.quick),
        "tprefill": lambda: time_prefill(K, args.quick),
        "tdecode": lambda: time_decode(K, args.quick),
    }
    return run_steps("gpu_check_attention", steps, RESULTS, table, args, guarded)


if __name__ == "__main__":
    sys.exit(main())
