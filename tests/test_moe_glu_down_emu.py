"""kernels/moe_glu_down.cu.j2 (moe_gemv_q8's glu then down in one launch, roles by ticket) on the
CPU through the g++ CUDA emulator (tests/fixtures/cuda_emu.py; the GPU proof is
tests/gpu/test_moe_kernels.py): the bits of the glu kernel then the down kernel (act, ids, weights
and the output, the residual added in place), with the glu routing its token or not, a q4_k glu
before a q6_k or a q4_k down, one or two tokens; the blocks run forward, reversed and shuffled
(roles come from the tickets, not blockIdx: a down block run before the glu blocks it needs
fails, as the emulator's spin wait on a value not yet stored does), each launch twice on the same
counters, which every launch leaves at zero."""

from __future__ import annotations

import numpy as np
import pytest
from fixtures import cuda_emu
from fixtures.pdl import waits_first
from fixtures.quant_blocks import random_blocks

from engine import moe_kernels as mk
from engine.render import render
from engine.types import ConfigError

E, TOP_K, HIDDEN, INTER = 6, 3, 256, 256
NAN_BF16 = np.uint16(0x7FC0)


def _bf16(x) -> np.ndarray:
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def _lib(k, tmp_path):
    return cuda_emu.compile_any(render(k.spec), k.spec.entry, tmp_path)


@pytest.mark.parametrize(
    "down_q,route,rows",
    [("q6_k", True, 2), pytest.param("q4_k", True, 1, marks=pytest.mark.long), pytest.param("q4_k", False, 2, marks=pytest.mark.long)],
)  # (the long ones run in .ci/run's long step)
def test_fused_glu_down_stores_the_two_kernels_bits(tmp_path, down_q, route, rows):
    rng = np.random.default_rng(7)
    wg = random_blocks("q4_k", E * INTER * HIDDEN // 256, seed=1).reshape(E * INTER, -1)
    wu = random_blocks("q4_k", E * INTER * HIDDEN // 256, seed=2).reshape(E * INTER, -1)
    wd = random_blocks(down_q, E * HIDDEN * INTER // 256, seed=3).reshape(E * HIDDEN, -1)
    x = _bf16(rng.standard_normal((rows, HIDDEN)))
    res = _bf16(rng.standard_normal((rows, HIDDEN)))
    logits = rng.standard_normal((rows, E)).astype(np.float32)
    ids0 = np.stack([rng.choice(E, TOP_K, replace=False) for _ in range(rows)]).astype(np.int32)
    wts0 = rng.uniform(0.1, 1.0, (rows, TOP_K)).astype(np.float32)
    glu = mk.expert_q8_kernel("glu", "q4_k", INTER, HIDDEN, TOP_K, trigger=True, route=(E, True) if route else None)
    down = mk.expert_q8_kernel("down", down_q, HIDDEN, INTER, TOP_K, residual=True, trigger=True)
    fused = mk.glu_down_kernel(glu.spec, down.spec)
    assert fused.block == down.block and fused.spec.params["g_warps"] == down.spec.params["warps"]

    def fresh():
        ids = np.full((rows, TOP_K), -1, np.int32) if route else ids0.copy()
        wts = np.full((rows, TOP_K), np.nan, np.float32) if route else wts0.copy()
        return np.full((rows, TOP_K, INTER), NAN_BF16, np.uint16), ids, wts, res.copy()

    # apart: the glu kernel (its own block shape), then the down
    act, ids, wts, out = fresh()
    lib, types = _lib(glu, tmp_path)
    cuda_emu.launch_any(lib, types, glu.grid(rows), glu.block[0], 0,
                        [act, wg, wu, x, ids, rows, *((wts, logits) if route else ())])
    lib, types = _lib(down, tmp_path)
    cuda_emu.launch_any(lib, types, down.grid(rows), down.block[0], 0, [out, wd, act, ids, wts, out, rows])
    want = (act, ids, wts, out)
    assert not (act == NAN_BF16).any() and not np.array_equal(out, res) and (ids >= 0).all()

    lib, types = _lib(fused, tmp_path)
    grid = fused.grid(rows)
    blocks = grid[0]
    assert blocks == rows * (TOP_K * INTER // 16 + HIDDEN // 16)
    count = np.zeros(3, np.uint32)
    orders = {"forward": None, "reversed": None, "shuffled": rng.permutation(blocks)}
    for name, order in orders.items():
        for replay in range(2):  # (the same counters: the last block reset them)
            act, ids, wts, out = fresh()
            cuda_emu.launch_any(lib, types, grid, fused.block[0], 0,
                                [out, wg, wu, wd, x, act, ids, wts, out, *((logits,) if route else ()), count, rows],
                                blocks_reversed=name == "reversed", block_order=order)
            for got, exp in zip((act, ids, wts, out), want, strict=True):
                assert np.array_equal(got.view(np.uint8), exp.view(np.uint8)), (name, replay)
            assert not count.any(), (name, replay, count)


def test_a_down_block_before_the_glu_blocks_fails_in_the_emulator(tmp_path):
    """The emulator's spin wait: counters left as if a down ticket came before the glu blocks had
    counted (the tickets past the glu's): the down block's wait fails instead of hanging."""
    glu = mk.expert_q8_kernel("glu", "q4_k", INTER, HIDDEN, TOP_K)
    down = mk.expert_q8_kernel("down", "q4_k", HIDDEN, INTER, TOP_K, residual=True)
    fused = mk.glu_down_kernel(glu.spec, down.spec)
    lib, types = _lib(fused, tmp_path)
    rows = 1
    wg = random_blocks("q4_k", E * INTER * HIDDEN // 256, seed=1).reshape(E * INTER, -1)
    wd = random_blocks("q4_k", E * HIDDEN * INTER // 256, seed=3).reshape(E * HIDDEN, -1)
    x = np.zeros((rows, HIDDEN), np.uint16)
    act = np.zeros((rows, TOP_K, INTER), np.uint16)
    out = np.zeros((rows, HIDDEN), np.uint16)
    ids, wts = np.zeros((rows, TOP_K), np.int32), np.ones((rows, TOP_K), np.float32)
    count = np.array([TOP_K * INTER // 16, 0, 0], np.uint32)  # tickets from the first down block's on
    with pytest.raises(cuda_emu.EmuError, match="spin wait"):
        cuda_emu.launch_any(lib, types, fused.grid(rows), fused.block[0], 0,
                            [out, wg, wg, wd, x, act, ids, wts, out, count, rows])


def test_glu_down_kernel_checks_the_pair():
    glu = mk.expert_q8_kernel("glu", "q4_k", 768, 2048, 8, route=(128, True), trigger=True)
    down = mk.expert_q8_kernel("down", "q6_k", 2048, 768, 8, residual=True, trigger=True)
    k = mk.glu_down_kernel(glu.spec, down.spec)
    p = k.spec.params
    assert (p["g_warps"], p["g_rows_per_warp"], p["glu_blocks"], p["down_blocks"], p["threads"]) == (8, 2, 48, 128, 256)
    assert p["d_route"] and p["d_experts"] == 128 and p["g_route"] and p["g_trigger"] and p["d_trigger"]
    assert k.grid(1) == (48 * 8 + 128, 1, 1) and k.grid(2) == (2 * (48 * 8 + 128), 1, 1)
    assert [a for a, _ in k.args] == ["out", "wg", "wu", "wd", "x", "act", "ids", "weights", "residual", "logits",
                                      "count", "rows"]
    src = render(k.spec)
    body = src[src.index(cuda_emu.END_COMMON) :]
    assert "namespace memra_glu" in body and "namespace memra_down" in body and body.count("pdl_wait();") == 1
    assert waits_first(src, k.spec.entry) and body.count("pdl_trigger();") == 2  # (each part's, after its first loads)
    # the down part stages act through L2 (other blocks of the launch stored it), the glu part x as its kernel
    glu_ns, down_ns = body.split("namespace memra_down", 1)
    assert "raw[j] = __ldcg(" in down_ns and "raw[j] = __ldg(" in glu_ns and "__ldcg(" not in glu_ns.split("route_token")[0]
    bad = [
        (down.spec, glu.spec),
        (glu.spec, mk.expert_q8_kernel("down", "q4_k", 2048, 512, 8, residual=True).spec),  # k is not the glu's n
        (glu.spec, mk.expert_q8_kernel("down", "q4_k", 2048, 768, 8, residual=True, shared=256).spec),
        (glu.spec, mk.expert_q8_kernel("down", "q4_k", 2048, 768, 8, warps=16).spec),  # 16 rows over 16 warps: 1 each
    ]
    assert mk.glu_down_kernel(*bad[3]).spec.params["g_rows_per_warp"] == 1
    for g, d in bad[:3]:
        with pytest.raises(ConfigError, match="moe_glu_down"):
            mk.glu_down_kernel(g, d)
    with pytest.raises(ConfigError, match="rows per block"):
        mk.glu_down_kernel(mk.expert_q8_kernel("glu", "q6_k", 768, 2048, 8).spec,
                           mk.expert_q8_kernel("down", "q4_k", 2048, 768, 8, warps=16).spec)
