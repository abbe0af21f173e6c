"""gated_delta_chunk (the chunked / WY form of the gated delta rule, for prefill) on a real GPU against
the numpy reference (engine.ops_ref_linear.delta_rule_varlen, itself checked against the
token-by-token form in tests/test_hybrid_ops.py), on fresh random inputs with poisoned outputs:
sequences of 1 .. 1000 tokens (shorter than a chunk, exact chunks, ragged tails), several per
launch (varlen), starting at positions off the chunk grid (chunks end where positions are
multiples of the chunk), state from a slot or zeros, snapshots after chosen tokens (block boundaries and
random ones), chunks of 16 / 32 / 64 tokens, the tensor-core (mma) and the FMA form; then a timing print of the recurrent prefill kernel
against the chunked one at Qwen3.5-4B's linear-attention heads (T = 512 and 4096); then a tiny
Qwen3.5 on CudaRunner with each prefill form (build_plan's delta_prefill: chunked, the default,
and recurrent): its plan,
logits against the reference after a 150-token prompt (both forms' errors printed), the prefix
cache restoring the state snapshots its prefill wrote. Skipped without a CUDA device.

    python3 -m pytest -q -s tests/gpu/test_delta_chunk_gpu.py
"""

from __future__ import annotations

import numpy as np
import pytest
from gpu_harness import bf_round, poisoned, rel_err, upload

from engine import cuda
from engine import linear_attn_kernels as lk
from engine import ops_ref_linear as L

SLOTS = 24
BLOCK = 16  # the KV block size: prefix-cache snapshots fall after every 16th token of a sequence


def _smem_ok(profile, k_) -> bool:
    """Chunks of 64 at k_dim 128 need 111 / 125 KB of shared memory (sm_80 / sm_90 only)."""
    return k_.smem <= lk.DELTA_CHUNK_SMEM or profile.arch.startswith(("sm_80", "sm_90"))


def _case(rng, lens, kh, vh, kd, vd, tiled, snaps_per_seq=3):
    rows = len(lens)
    starts = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    total = int(starts[-1])
    qkv_w = 2 * kh * kd + vh * vd
    qs, bs = qkv_w + 8, vh + 4
    x = {
        "qkv": rng.standard_normal((total, qs)).astype(np.float32),
        "b": rng.standard_normal((total, bs)).astype(np.float32),
        "a": rng.standard_normal((total, bs)).astype(np.float32),
        "A": -np.exp(rng.uniform(-2, 1.5, vh)).astype(np.float32),
        "dt": (0.5 * rng.standard_normal(vh)).astype(np.float32),
        "state0": (rng.standard_normal((SLOTS, vh, kd, vd)) * 0.1).astype(np.float32),
    }
    perm = rng.permutation(SLOTS)
    outs, pool = perm[:rows].astype(np.int32), list(perm[rows:])
    ins = np.full(rows, -1, np.int32)
    for s in range(rows):  # alternate zeros / a restored slot / continuing in place
        if s % 3 == 1:
            ins[s] = pool.pop()
        elif s % 3 == 2:
            ins[s] = outs[s]
    snap = np.full(total, -1, np.int32)
    for s in range(rows):
        lo, hi = int(starts[s]), int(starts[s + 1])
        points = [lo + p - 1 for p in range(BLOCK, hi - lo + 1, BLOCK)]  # block boundaries
        points += [int(t) for t in rng.integers(lo, hi, 2)]  # and anywhere
        for t in rng.permutation(sorted(set(points)))[:snaps_per_seq]:
            if pool:
                snap[t] = pool.pop()
    return starts, total, qs, bs, ins, outs, snap, x


def _positions(starts) -> np.ndarray:
    """Each sequence's tokens at positions from (7 s^2) % 45 on (off the chunk grid but for s = 0)."""
    return np.concatenate([(7 * s * s) % 45 + np.arange(int(starts[s + 1] - starts[s])) for s in range(len(starts) - 1)])


def _run(kernels, k_, starts, total, vh, vd, ins, outs, snap, x):
    rows = len(starts) - 1
    dout, dstate = poisoned((total, vh * vd)), upload(x["state0"], "f32")
    pos = {"positions": upload(_positions(starts), "i32")} if ("positions", "ptr") in k_.args else {}  # (chunked only)
    kernels.launch(k_, rows, **pos, out=dout, qkv=upload(x["qkv"], "bf16"), b=upload(x["b"], "bf16"),
                   a=upload(x["a"], "bf16"), A=upload(x["A"], "f32"), dt_bias=upload(x["dt"], "f32"), state=dstate,
                   state_in=upload(ins, "i32"), state_out=upload(outs, "i32"), state_snap=upload(snap, "i32"),
                   seq_starts=upload(starts, "i32"), rows=rows)
    return dout.get(), dstate.get()


def _reference(starts, kh, vh, kd, vd, tiled, ins, outs, snap, x, chunk=64):
    qkv_w = 2 * kh * kd + vh * vd
    q, k, v = L.split_qkv(bf_round(x["qkv"][:, :qkv_w]), k_heads=kh, v_heads=vh, k_dim=kd, v_dim=vd, v_tiled=tiled)
    g, beta = L.delta_gates(bf_round(x["a"][:, :vh]), bf_round(x["b"][:, :vh]), x["A"], x["dt"])
    return L.delta_rule_varlen(q, k, v, g, beta, x["state0"], starts, ins, outs, snap, chunk, _positions(starts))


@pytest.mark.parametrize("mma", [True, False])
@pytest.mark.parametrize(
    "lens,kh,vh,kd,vd,tiled,chunk,vb",
    [
        ([1], 2, 4, 32, 32, False, 16, 0),
        ([15, 16, 1, 17], 2, 4, 32, 32, True, 16, 0),
        ([63, 64, 65, 1], 2, 4, 32, 32, False, 32, 0),
        ([63, 64, 65, 1], 2, 4, 32, 32, True, 64, 0),
        ([300, 7, 129], 2, 4, 16, 16, False, 64, 0),  # v_block 16 (v_dim not a multiple of 32)
        ([1000], 2, 4, 32, 64, False, 32, 0),
        ([1000, 33], 2, 4, 64, 32, True, 64, 0),
        ([70, 5, 1], 16, 32, 128, 128, False, 0, 0),  # Qwen3.5-4B's heads, the default chunk (32)
        ([300, 16, 2], 16, 32, 128, 128, True, 64, 0),
        ([100, 40], 16, 32, 128, 128, False, 32, 16),  # 16 state columns per block
    ],
)
def test_delta_chunk_matches_reference(kernels, profile, lens, kh, vh, kd, vd, tiled, chunk, vb, mma):
    rng = np.random.default_rng()
    starts, total, qs, bs, ins, outs, snap, x = _case(rng, lens, kh, vh, kd, vd, tiled)
    k_ = lk.delta_chunk_kernel(kh, vh, kd, vd, qs, bs, bs, vh * vd, tiled, True, chunk, vb, mma)
    if not _smem_ok(profile, k_):
        pytest.skip(f"chunk 64 at k_dim 128 needs more shared memory than {profile.arch} has")
    got, st = _run(kernels, k_, starts, total, vh, vd, ins, outs, snap, x)
    want, want_state = _reference(starts, kh, vh, kd, vd, tiled, ins, outs, snap, x, k_.spec.params["chunk"])
    want = want.reshape(total, vh * vd)
    assert np.isfinite(got).all(), "unwritten (NaN-poisoned) outputs"
    for t in range(total):
        assert rel_err(got[t], want[t]) < 1e-2, (t, rel_err(got[t], want[t]))
    for slot in range(SLOTS):  # written slots (final, snapshots) and untouched ones alike
        assert rel_err(st[slot], want_state[slot]) < 1e-4, (slot, rel_err(st[slot], want_state[slot]))


@pytest.mark.parametrize("mma", [True, False])
def test_delta_chunk_equals_recurrent_kernel(kernels, mma):
    """The chunked and the token-by-token prefill kernels on the same inputs (outputs and slots)."""
    rng = np.random.default_rng()
    kh, vh, kd, vd = 16, 32, 128, 128
    starts, total, qs, bs, ins, outs, snap, x = _case(rng, [200, 48, 3], kh, vh, kd, vd, False)
    chunked = lk.delta_chunk_kernel(kh, vh, kd, vd, qs, bs, bs, vh * vd, False, True, mma=mma)
    recurrent = lk.delta_rule_kernel(kh, vh, kd, vd, qs, bs, bs, vh * vd, False, True, lk.DELTA_PREFILL_THREADS)
    o1, s1 = _run(kernels, chunked, starts, total, vh, vd, ins, outs, snap, x)
    o2, s2 = _run(kernels, recurrent, starts, total, vh, vd, ins, outs, snap, x)
    assert rel_err(o1, o2) < 1e-2 and rel_err(s1, s2) < 1e-4


@pytest.mark.parametrize("mma", [True, False])
def test_delta_chunk_decode_rows(kernels, mma):
    """varlen off (one token per row, the decode layout) gives the recurrent step's result."""
    rng = np.random.default_rng()
    kh, vh, kd, vd = 2, 4, 32, 32
    starts, total, qs, bs, ins, outs, snap, x = _case(rng, [1] * 5, kh, vh, kd, vd, False)
    k_ = lk.delta_chunk_kernel(kh, vh, kd, vd, qs, bs, bs, vh * vd, False, False, 16, mma=mma)
    got, st = _run(kernels, k_, starts, total, vh, vd, ins, outs, snap, x)
    want, want_state = _reference(starts, kh, vh, kd, vd, False, ins, outs, snap, x)
    assert rel_err(got, want.reshape(total, -1)) < 1e-2 and rel_err(st, want_state) < 1e-4


def _time_ms(kernels, k_, rows, vals, iters=5) -> float:
    fn = kernels.function(k_.spec)
    packed = cuda.KernelArgs([kind for _, kind in k_.args], [vals[name] for name, _ in k_.args])
    stream = cuda.Stream()
    start, stop = cuda.Event(), cuda.Event()
    run = cuda.PreparedLaunch(fn, k_.grid(rows), k_.block, k_.smem, stream)
    run(packed)  # warm
    start.record(stream)
    for _ in range(iters):
        run(packed)
    stop.record(stream)
    stop.synchronize()
    ms = stop.elapsed_ms(start) / iters
    for x in (start, stop, stream):
        x.destroy()
    return ms


@pytest.mark.parametrize("total,rows,every", [(512, 1, 0), (4096, 1, 0), (4096, 8, 0), (4096, 1, 16)])
def test_delta_prefill_timing(kernels, profile, total, rows, every):
    """Prints ms and tokens/s of the recurrent and chunked prefill kernels (one layer, Qwen3.5-4B's
    linear-attention heads: 16 k heads, 32 v heads, 128 x 128; ``every``: a snapshot after every
    that many tokens, as the prefix cache takes them) and checks they agree."""
    rng = np.random.default_rng(0)
    kh, vh, kd, vd = 16, 32, 128, 128
    qs, bs = 2 * kh * kd + vh * vd, vh
    starts = np.linspace(0, total, rows + 1).astype(np.int32)
    snap = np.full(total, -1)
    if every:
        snap[every - 1 :: every] = rows + np.arange(total // every)
    slots = rows + (total // every if every else 0)
    d = {
        "qkv": upload(rng.standard_normal((total, qs)), "bf16"),
        "b": upload(rng.standard_normal((total, bs)), "bf16"),
        "a": upload(rng.standard_normal((total, bs)), "bf16"),
        "A": upload(-np.exp(rng.uniform(-2, 1.5, vh)), "f32"),
        "dt_bias": upload(0.5 * rng.standard_normal(vh), "f32"),
        "state_in": upload(np.full(rows, -1), "i32"),
        "state_out": upload(np.arange(rows), "i32"),
        "state_snap": upload(snap, "i32"),
        "seq_starts": upload(starts, "i32"),
        "positions": upload(_positions(starts), "i32"),
    }
    forms = {"recurrent": lk.delta_rule_kernel(kh, vh, kd, vd, qs, bs, bs, vh * vd, False, True, lk.DELTA_PREFILL_THREADS)}
    for mma, chunk, vb in [(m, c, 32) for m in (True, False) for c in (16, 32, 64)] + [(True, 32, 16), (True, 64, 16)]:
        k_ = lk.delta_chunk_kernel(kh, vh, kd, vd, qs, bs, bs, vh * vd, False, True, chunk, vb, mma)
        if _smem_ok(profile, k_):
            forms[f"{'mma' if mma else 'fma'} c{chunk} vb{vb}"] = k_
    results, base = {}, 0.0
    for name, k_ in forms.items():
        out, state = poisoned((total, vh * vd)), upload(np.zeros((slots, vh, kd, vd)), "f32")
        vals = {**{n: a.ptr for n, a in d.items()}, "out": out.ptr, "state": state.ptr, "rows": rows}
        ms = _time_ms(kernels, k_, rows, vals)
        base = base or ms
        results[name] = (out.get(), state.get())
        print(f"\ndelta rule prefill {name:>14}: T={total} in {rows} seq, snapshots every {every or '-'}: {ms:8.3f} ms/layer, "
              f"{total / ms * 1e3:11.0f} tokens/s, x{base / ms:5.2f} vs recurrent ({profile.name})")
    o_ref, s_ref = results["recurrent"]
    for name, (o, s) in results.items():
        assert rel_err(o, o_ref) < 1e-2 and rel_err(s, s_ref) < 1e-3, name


# ---- end to end: a tiny Qwen3.5 on CudaRunner with each prefill form (build_plan's delta_prefill)


@pytest.fixture(scope="module", params=["chunked", "recurrent"])
def prefill_runner(request, tmp_path_factory):
    from fixtures.hybrid import write_qwen3_5_hf
    from fixtures.hybrid_case import DIMS, SEED

    from engine.model import load_model
    from engine.reference import ReferenceRunner
    from engine.runner_cuda import CudaRunner

    model = load_model(write_qwen3_5_hf(tmp_path_factory.mktemp("qwen3_5") / "m", seed=SEED, bf16=True, **DIMS))
    runner = CudaRunner(model, num_blocks=256, max_model_len=1024, state_slots=64, delta_prefill=request.param)
    yield runner, ReferenceRunner(model, num_blocks=64, max_model_len=1024, state_slots=2), request.param
    runner.close()


def test_runner_prefill_uses_its_forms_kernel(prefill_runner):
    runner, _, form = prefill_runner
    pre = {la.spec.template for st in runner.plan.steps for la in st.launches["prefill"]}
    dec = {la.spec.template for st in runner.plan.steps for m in ("decode1", "decode") for la in st.launches[m]}
    assert ("gated_delta_chunk" in pre) is (form == "chunked") and ("gated_delta_rule" in pre) is (form == "recurrent")
    assert "gated_delta_rule" in dec and "gated_delta_chunk" not in dec
    # the chunked form's chunk divides the KV block (the state grid the scheduler cuts on)
    assert runner.state_align == (16 if form == "chunked" else 1) and runner.block_size % runner.state_align == 0


def test_runner_prefill_matches_the_reference(prefill_runner):
    """Both prefill forms against the reference on the same prompt (fixtures.hybrid_case.CHUNK_PROMPT:
    tests/test_hybrid_conditioning.py checks that bf16 storage alone moves these logits ~1 %)."""
    from fixtures.hybrid_case import CHUNK_PROMPT, CHUNK_STEPS, prompt

    from engine.types import SamplingParams, StepItem

    runner, ref, form = prefill_runner
    greedy = SamplingParams(temperature=0.0)
    seq = prompt(*CHUNK_PROMPT)  # chunks + a ragged tail
    tok = runner.step([StepItem(0, seq, 0, list(range(16)), True, greedy, state_slot=0)])[0]
    errs = []
    for _ in range(CHUNK_STEPS):
        got, want = np.array(runner.read_logits(1)[0]), ref.forward_logits(seq)[-1]
        errs.append(rel_err(got, want))
        seq = seq + [tok]
        tok = runner.step([StepItem(0, [tok], len(seq) - 1, list(range(16)), True, greedy, state_slot=0)])[0]
    print(f"{form} prefill: logits rel err {', '.join(f'{e:.2e}' for e in errs)}")
    assert max(errs) < 3e-2, (form, errs)


def test_runner_prefill_prefix_cache_matches_uncached(prefill_runner):
    """Snapshots written by the prefill kernel at block boundaries (prefill passes cut mid-block)
    restore to the same output as the uncached run."""
    from fixtures.engine_waves import serve_waves

    runner, _, _ = prefill_runner
    bs = runner.block_size
    rng = np.random.default_rng(5)
    prompt, other = [int(t) for t in rng.integers(3, 384, 20 * bs + 3)], [int(t) for t in rng.integers(3, 384, 9 * bs)]
    kw = dict(prefill_chunk_tokens=4 * bs + 5, max_step_tokens=512, max_tokens=12, vocab_size=runner.plan.dims["vocab"])
    cold, _ = serve_waves(runner, [[prompt, other]], enable_prefix_cache=False, **kw)
    warm, stats = serve_waves(runner, [[prompt, other], [prompt, other[: 5 * bs + 2]]], **kw)
    (first, c0), (o1, _), (second, c1), (o2, c2) = warm
    assert c0 == 0 and c1 == 20 * bs and c2 == 5 * bs
    assert first == cold[0][0] and second == cold[0][0] and o1 == cold[1][0]
    assert stats.state_slots_live == 0
