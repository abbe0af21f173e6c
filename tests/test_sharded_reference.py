"""The sharded numpy reference (engine.sharded_reference) against the unsharded one: TP (heads,
columns, experts by expert or by column, vocab-parallel head, replicated K/V heads) and PP (layer
ranges passing the residual stream) give the same f32 logits (1e-5 relative) and the same greedy
tokens, for tiny Qwen3 dense and Qwen3-MoE checkpoints; and the Runner protocol's step through a
paged cache agrees with the reference's."""

from __future__ import annotations

import numpy as np
import pytest
from fixtures.checkpoints import write_qwen3_moe_safetensors, write_qwen3_safetensors

from engine.model import load_model
from engine.placement import plan_placement
from engine.reference import ReferenceRunner
from engine.sharded_reference import ShardedReference
from engine.types import SamplingParams, StepItem

PROMPT = [3, 77, 12, 12, 90, 5, 41, 100, 54, 23, 31]
KW = dict(num_blocks=8, block_size=4, max_model_len=64)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("sharded")
    dense = load_model(write_qwen3_safetensors(root / "qwen3", num_hidden_layers=3))
    moe = load_model(write_qwen3_moe_safetensors(root / "moe", num_hidden_layers=3, mlp_only_layers=(1,)))
    tied = load_model(write_qwen3_safetensors(root / "tied", num_hidden_layers=2, tie_word_embeddings=True))
    out = {}
    for name, m in (("qwen3", dense), ("qwen3_moe", moe), ("qwen3_tied", tied)):
        ref = ReferenceRunner(m, **KW)
        out[name] = (m, ref, ref.forward_logits(PROMPT), ref.generate(PROMPT, 6))
    return out


CASES = [
    ("qwen3", "tp", 2, "ep", "vocab"),
    ("qwen3", "tp", 4, "ep", "replicated"),  # 2 K/V heads over 4 ranks: replicated K/V heads
    ("qwen3", "pp", 2, "ep", "vocab"),
    ("qwen3", "pp", 3, "ep", "vocab"),
    ("qwen3_tied", "tp", 2, "ep", "vocab"),  # the head is a vocab slice of the replicated embedding
    ("qwen3_tied", "pp", 2, "ep", "vocab"),  # the last stage holds the table again
    ("qwen3_moe", "tp", 2, "ep", "vocab"),
    ("qwen3_moe", "tp", 2, "cols", "vocab"),
    ("qwen3_moe", "tp", 4, "ep", "replicated"),
    ("qwen3_moe", "pp", 2, "ep", "vocab"),
]


@pytest.mark.parametrize("family,split,n,moe,head", CASES)
def test_sharded_logits_and_greedy_equal_unsharded(models, family, split, n, moe, head):
    m, _, want, want_tokens = models[family]
    pl = plan_placement(m.graph, m.dims, split, list(range(n)), tensor_dtypes=m.tensor_dtypes, moe=moe, head=head)
    sr = ShardedReference(m, pl, **KW)
    got = sr.forward_logits(PROMPT)
    assert got.shape == want.shape
    assert float(np.abs(got - want).max() / np.abs(want).max()) < 1e-5
    assert sr.generate(PROMPT, 6) == want_tokens


def test_tp_ranks_hold_only_their_slices(models):
    m, *_ = models["qwen3_moe"]
    d = m.dims
    pl = plan_placement(m.graph, d, "tp", [0, 1], tensor_dtypes=m.tensor_dtypes)
    sr = ShardedReference(m, pl, **KW)
    hd, hidden = int(d["head_dim"]), int(d["hidden"])
    for r, rank in enumerate(sr.ranks):
        assert rank.weight("wq", 0).shape == (int(d["heads"]) // 2 * hd, hidden)
        assert rank.weight("wo", 0).shape == (hidden, int(d["heads"]) // 2 * hd)
        assert rank.weight("exp_gate", 0).shape[0] == int(d["experts"]) // 2
        assert rank.k_cache.shape[3] == int(d["kv_heads"]) // 2
        vlo, vhi = pl.slices["lm_head"][1][r]
        assert rank.weight("lm_head", None).shape[0] == vhi - vlo
    # the ranks' q projections are different halves of the model's
    assert not np.array_equal(sr.ranks[0].weight("wq", 0), sr.ranks[1].weight("wq", 0))


def test_pp_passes_only_the_residual_stream(models):
    m, *_ = models["qwen3"]
    pl = plan_placement(m.graph, m.dims, "pp", [0, 1], tensor_dtypes=m.tensor_dtypes)
    sr = ShardedReference(m, pl, **KW)
    assert sr.sends == [[], ["x"]]
    assert [p.layers for p in pl.parts] in ([(0,), (1, 2)], [(0, 1), (2,)])
    first, last = ({o.op for o, layer in r._schedule if layer is None} for r in sr.ranks)
    assert first == {"embed"} and last == {"rmsnorm", "linear"}  # the final norm and the head


@pytest.mark.parametrize("split", ["tp", "pp"])
def test_step_through_paged_cache_matches_reference(models, split):
    m, _, _, _ = models["qwen3_moe"]
    ref = ReferenceRunner(m, **KW)
    pl = plan_placement(m.graph, m.dims, split, [0, 1], tensor_dtypes=m.tensor_dtypes)
    sr = ShardedReference(m, pl, **KW)
    greedy = SamplingParams(temperature=0.0)
    table = [5, 2, 7, 1]
    outs = []
    for runner in (ref, sr):
        toks = list(PROMPT)
        item = StepItem(seq_id=1, token_ids=toks, start_pos=0, block_table=table, sample=True, sampling=greedy)
        got = []
        for _ in range(4):
            tok = runner.step([item])[0]
            got.append(tok)
            item = StepItem(seq_id=1, token_ids=[tok], start_pos=item.start_pos + len(item.token_ids), block_table=table, sample=True, sampling=greedy)
        outs.append(got)
    assert outs[0] == outs[1]


def test_pp_of_a_hybrid_keeps_each_stage_state(tmp_path):
    from fixtures.hybrid import write_qwen3_5_hf

    m = load_model(write_qwen3_5_hf(tmp_path / "h"))
    ref = ReferenceRunner(m, **KW)
    pl = plan_placement(m.graph, m.dims, "pp", [0, 1], tensor_dtypes=m.tensor_dtypes)
    sr = ShardedReference(m, pl, **KW)
    assert sr.num_state_slots == ref.num_state_slots and all(r.num_state_slots in (0, ref.num_state_slots) for r in sr.ranks)
    assert float(np.abs(sr.forward_logits(PROMPT) - ref.forward_logits(PROMPT)).max()) == 0.0
    greedy = SamplingParams(temperature=0.0)
    outs = []
    for runner in (ref, sr):
        item = StepItem(seq_id=1, token_ids=PROMPT, start_pos=0, block_table=[0, 1, 2, 3, 4], sample=True,
                        sampling=greedy, state_slot=2)
        got = []
        for _ in range(4):
            tok = runner.step([item])[0]
            got.append(tok)
            item = StepItem(seq_id=1, token_ids=[tok], start_pos=item.start_pos + len(item.token_ids),
                            block_table=[0, 1, 2, 3, 4], sample=True, sampling=greedy, state_slot=2)
        outs.append(got)
    assert outs[0] == outs[1]
    with pytest.raises(Exception, match="no tensor-parallel rule"):
        plan_placement(m.graph, m.dims, "tp", [0, 1], tensor_dtypes=m.tensor_dtypes)


@pytest.mark.parametrize("split", ["tp", "pp"])
def test_a_partial_block_hit_copies_every_rank_s_block(models, split):
    """engine.partial_blocks on the sharded reference: the same prompt again copies its cached
    partial block on every rank (copy_blocks) and gives the unsharded greedy tokens."""
    from fixtures.engine_waves import serve_waves

    m, _, _, want = models["qwen3"]
    pl = plan_placement(m.graph, m.dims, split, [0, 1], tensor_dtypes=m.tensor_dtypes)
    sr = ShardedReference(m, pl, **KW)
    outs, _ = serve_waves(sr, [[PROMPT], [PROMPT]], max_tokens=6, vocab_size=int(m.dims["vocab"]))
    assert outs == [(want, 0), (want, len(PROMPT) - 1)]
