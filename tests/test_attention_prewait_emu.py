"""The decode attention reads no key that the same pass writes before its pdl_wait() (issue #38, on
the CPU: tests/fixtures/cuda_emu.py).

A PDL launch may start before the kernel ahead of it (the rope's cache write) has finished, and its
reads before pdl_wait() may see the memory from before that kernel's writes. The emulator models
that (launch_any's ``stale``): each block reads the pass's KV slots as they were before the rope
until its pdl_wait(), then as the rope left them. A verify pass's rows (one sequence at consecutive
positions in one launch; a hybrid's rows laid out by draft position) read keys their sequence's
earlier rows wrote in the same pass: the split attention and the non-fused direct attention of a
SmolLM2-shaped plan (9 / 3 heads of 64, h100) must give every row the bits they give with the
slots written before the launch (no stale window), for rows at the start of a split (256..), just
before and across it (253..256) and at the start of the key range (direct: 8..)."""

from __future__ import annotations

import numpy as np
import pytest
from fixtures import cuda_emu
from fixtures.checkpoints import Dims, to_bf16_bits, write_random_gguf

from engine import kernel_catalog as kc
from engine.render import render

BS = 16
LLAMA = Dims(hidden_size=576, num_hidden_layers=2, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
             intermediate_size=1536, vocab_size=768, tie_word_embeddings=True)  # fmt: skip


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    """Layer 0's split attention and combine (decode) of a SmolLM2-shaped q4_1 plan on the h100."""
    from engine.model import load_model
    from engine.plan import build_plan
    from engine.profile import get_profile

    m = load_model(write_random_gguf(tmp_path_factory.mktemp("m") / "m.gguf", "llama", LLAMA, "q4_1", seed=3))
    plan = build_plan(m.graph, m.dims, m.quant, get_profile("h100"), m.tensor_dtypes, m.rope_style)
    (att,) = [st for st in plan.steps if st.layer == 0 and st.op.op == "attention"]
    split, comb = att.launches["decode"]
    assert not split.spec.params["direct"] and split.spec.params["vec16"]
    return split, comb


def _bf16(x) -> np.ndarray:
    return to_bf16_bits(np.ascontiguousarray(x, np.float32)).reshape(np.shape(x))


def _case(rng, kvh, hd, q_stride, rows_pos, rows_seq, nblocks_seq):
    """Tables (one per row, its sequence's), positions, q, the fresh cache and the stale one (the
    rows' own slots before the rope wrote them: other bytes)."""
    nseq = max(rows_seq) + 1
    tabs = [rng.permutation(nblocks_seq).astype(np.int32) + s * nblocks_seq for s in range(nseq)]
    tables = np.ascontiguousarray(np.stack([tabs[s] for s in rows_seq]))
    pos = np.array(rows_pos, np.int32)
    fresh = _bf16(rng.standard_normal((2, nseq * nblocks_seq, BS, kvh, hd)))
    stale = fresh.copy()
    for r, p in enumerate(rows_pos):
        slot = tables[r, p // BS]
        stale[:, slot, p % BS] = _bf16(rng.standard_normal((2, kvh, hd)) * 3.0)
    q = _bf16(rng.standard_normal((len(rows_pos), q_stride)) * 2.0)
    return tables, pos, q, fresh, stale


# (positions, sequence) of each row: a draft at the start of split 1, one across it, two drafts
# laid out by draft position (a hybrid's verify pass), and a draft beside a plain row
CASES = {
    "split-start": ([256, 257, 258, 259], [0, 0, 0, 0]),
    "across": ([253, 254, 255, 256], [0, 0, 0, 0]),
    "by-position": ([260, 300, 261, 301, 262, 302], [0, 1, 0, 1, 0, 1]),
    "beside-plain": ([270, 258, 259, 260], [1, 0, 0, 0]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_split_attention_reads_the_pass_keys_only_after_pdl_wait(launches, case, tmp_path):
    split, comb = launches
    sp = split.spec.params
    heads, kvh, hd = sp["heads"], sp["kv_heads"], sp["head_dim"]
    rows_pos, rows_seq = CASES[case]
    rng = np.random.default_rng(11)
    nb = 24
    tables, pos, q, fresh, stale = _case(rng, kvh, hd, sp["q_stride"], rows_pos, rows_seq, nb)
    n, ms = len(rows_pos), 2
    lib, types = cuda_emu.compile_any(render(split.spec), split.spec.entry, tmp_path)
    clib, ctypes_ = cuda_emu.compile_any(render(comb.spec), comb.spec.entry, tmp_path)
    outs = []
    for stale_window in (False, True):
        kc_, vc_ = fresh[0].copy(), fresh[1].copy()
        part_o = np.full((n, heads, ms, hd), np.nan, np.float32)
        part_ml = np.full((n, heads, ms, 2), np.nan, np.float32)
        st = [(kc_, stale[0]), (vc_, stale[1])] if stale_window else ()
        cuda_emu.launch_any(lib, types, (n, kvh, ms), split.block[0], 0,
                            [None, part_o, part_ml, q, kc_, vc_, tables, pos, nb, ms], stale=st)  # fmt: skip
        assert np.array_equal(kc_, fresh[0]) and np.array_equal(vc_, fresh[1])
        out = np.full((n, sp["out_stride"]), 0x7FC0, np.uint16)
        cuda_emu.launch_any(clib, ctypes_, (n, heads, 1), comb.block[0], 0, [out, part_o, part_ml, pos, ms])
        outs.append(out)
    bad = [int((outs[0][r] != outs[1][r]).sum()) for r in range(n)]
    assert not any(bad), (case, rows_pos, bad)


def test_direct_attention_without_rope_reads_the_pass_keys_only_after_pdl_wait(launches, tmp_path):
    """The direct kernel where the rope is not folded in (fuse_rope off: a verify pass below split
    then runs the rope kernel and this one): a draft at the start of the key range."""
    split, _ = launches
    spec = kc.spec("attention", **{**split.spec.params, "direct": True})
    sp = spec.params
    kvh, hd = sp["kv_heads"], sp["head_dim"]
    rows_pos, rows_seq = [5, 6, 7, 8, 40], [0, 0, 0, 0, 1]
    rng = np.random.default_rng(12)
    nb = 4
    tables, pos, q, fresh, stale = _case(rng, kvh, hd, sp["q_stride"], rows_pos, rows_seq, nb)
    n = len(rows_pos)
    lib, types = cuda_emu.compile_any(render(spec), spec.entry, tmp_path)
    outs = []
    for stale_window in (False, True):
        kc_, vc_ = fresh[0].copy(), fresh[1].copy()
        out = np.full((n, sp["out_stride"]), 0x7FC0, np.uint16)
        st = [(kc_, stale[0]), (vc_, stale[1])] if stale_window else ()
        cuda_emu.launch_any(lib, types, (n, kvh, sp.get("qsplit") or 1), split.block[0], 0,
                            [out, None, None, q, kc_, vc_, tables, pos, nb, 1], stale=st)  # fmt: skip
        outs.append(out)
    assert not np.isnan((outs[0].astype(np.uint32) << 16).view(np.float32)).any()
    bad = [int((outs[0][r] != outs[1][r]).sum()) for r in range(n)]
    assert not any(bad), (rows_pos, bad)
