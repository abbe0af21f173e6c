"""The short (direct, rope folded in) and long (rope kernel, split attention, combine) decode attention
give a row the same bits on the GPU (issue #38): the GPU twin of tests/test_batch_invariance_emu.py's
check, which runs them on the CPU (g++, no FMA contraction, its own exp2f), for the layer-0 launches
of a SmolLM2-shaped plan (9 / 3 heads of 64, q4_1) on this GPU's profile, at the contexts around
split_kv_tokens (a verify pass of SmolLM2 at 253 gave row 255 other logits than the plain step).
Each launch alone (no PDL): this checks the arithmetic of the two kernels, not the pass's ordering."""

from __future__ import annotations

import numpy as np
import pytest
from fixtures.checkpoints import Dims, write_random_gguf
from gpu_harness import bf_round, poisoned, upload

from engine import kernel_catalog as kc
from engine.ir import SHORT1

LLAMA = Dims(hidden_size=576, num_hidden_layers=2, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
             intermediate_size=1536, vocab_size=768, tie_word_embeddings=True)  # fmt: skip


@pytest.fixture(scope="module")
def layer0(profile, tmp_path_factory):
    from engine.model import load_model
    from engine.plan import build_plan

    m = load_model(write_random_gguf(tmp_path_factory.mktemp("m") / "m.gguf", "llama", LLAMA, "q4_1", seed=3))
    plan = build_plan(m.graph, m.dims, m.quant, profile, m.tensor_dtypes, m.rope_style)
    (att,) = [st for st in plan.steps if st.layer == 0 and st.op.op == "attention"]
    (rope,) = [st for st in plan.steps if st.layer == 0 and st.op.op == "rope"]
    # the batch-1 direct kernel with trigger (SHORT1), where a layer has it (the same shapes)
    short1 = [la for st in plan.steps if st.op.op == "attention" for la in st.launches.get(SHORT1, ())][:1]
    return att, rope, short1


def test_direct_attention_equals_rope_split_and_combine_around_split(kernels, layer0):
    att, rope_st, short1 = layer0
    directs = [*att.launches.get("short", ()), *short1]
    if not directs or not directs[0].spec.params.get("rope"):
        pytest.skip("this profile folds no rope into a direct attention")
    split, comb = att.launches["decode"]
    (rope,) = rope_st.launches["decode"]
    dp, rp = directs[0].spec.params, rope.spec.params
    heads, kvh, hd, bs, sk = dp["heads"], dp["kv_heads"], dp["head_dim"], dp["block_size"], split.spec.params["split"]
    kv_stride, v_stride = rp["kv_stride"], rp.get("v_stride") or rp["kv_stride"]
    rng = np.random.default_rng(7)
    nblocks = sk // bs + 2
    table = rng.permutation(nblocks).astype(np.int32)[None, :]
    cache0 = bf_round(rng.standard_normal((2, nblocks, bs, kvh, hd)))
    report, bad = [], False
    for ctx in (sk - 3, sk - 2, sk - 1, sk):
        q = bf_round(rng.standard_normal((1, dp["q_stride"])) * 2.0)
        k = bf_round(rng.standard_normal((1, kv_stride)) * 2.0)
        v = bf_round(rng.standard_normal((1, v_stride)))
        pos = upload(np.array([ctx - 1], np.int32), "i32")
        slots = upload(np.array([table[0, (ctx - 1) // bs] * bs + (ctx - 1) % bs], np.int32), "i32")
        tab = upload(table, "i32")
        # the long launches: the rope kernel (q in place, the KV write), split attention, combine
        qd, kd, vd = upload(q, "bf16"), upload(k, "bf16"), upload(v, "bf16")
        kcache, vcache = upload(cache0[0], "bf16"), upload(cache0[1], "bf16")
        kernels.launch(kc.choice("rope", **rp), 1, q=qd, k=kd, v=vd, positions=pos, q_norm=0, k_norm=0, freq=0,
                       k_cache=kcache, v_cache=vcache, slots=slots, rows=1)  # fmt: skip
        ms = 2
        part_o, part_ml = poisoned((1, heads, ms, hd), "f32"), poisoned((1, heads, ms, 2), "f32")
        kernels.launch(kc.choice("attention", **split.spec.params), 1, grid_kw={"max_splits": ms}, out=0,
                       part_o=part_o, part_ml=part_ml, q=qd, k_cache=kcache, v_cache=vcache, block_tables=tab,
                       positions=pos, max_blocks=nblocks, max_splits=ms)  # fmt: skip
        out_s = poisoned((1, dp["out_stride"]))
        kernels.launch(kc.choice("attention_combine", **comb.spec.params), 1, out=out_s, part_o=part_o,
                       part_ml=part_ml, positions=pos, max_splits=ms)  # fmt: skip
        want, want_k = out_s.get(), (kcache.get(), vcache.get())
        for la in directs:
            c = kc.choice("attention", **la.spec.params)
            kc2, vc2 = upload(cache0[0], "bf16"), upload(cache0[1], "bf16")
            out_d = poisoned((1, dp["out_stride"]))
            args = dict(out=out_d, part_o=0, part_ml=0, q=upload(q, "bf16"), k_cache=kc2, v_cache=vc2,
                        block_tables=tab, positions=pos, max_blocks=nblocks, max_splits=1, k_in=upload(k, "bf16"),
                        v_in=upload(v, "bf16"), q_norm=0, k_norm=0, freq=0, slots=slots)  # fmt: skip
            for name, _ in c.args:
                if name.startswith("pf"):
                    args[name] = kc2  # an L2 prefetch of a later weight: any readable range
            kernels.launch(c, 1, **args)
            got = out_d.get()
            n = int((got[:, : heads * hd] != want[:, : heads * hd]).sum())
            kv_same = np.array_equal(kc2.get(), want_k[0]) and np.array_equal(vc2.get(), want_k[1])
            report.append(f"ctx {ctx} {'trigger' if la.spec.params.get('trigger') else 'short'}: {n} differ, kv {'same' if kv_same else 'differ'}")
            bad |= n > 0 or not kv_same
    print("; ".join(report))
    assert not bad, report
