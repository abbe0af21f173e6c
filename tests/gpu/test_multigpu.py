"""Two GPUs (skipped unless two CUDA devices and NCCL are present): NCCL all-reduce and send/recv
between the devices through engine.nccl, and greedy output of a model split over two GPUs (TP-2,
PP-2) equal to one GPU and to the sharded numpy reference, for Qwen3 dense and Qwen3-MoE.

The split-model tests xfail while the CUDA runner refuses ``--split`` (engine.backend says "does
not split a model over devices yet"); once it splits, they are the acceptance check.
"""

from __future__ import annotations

import numpy as np
import pytest
from fixtures.checkpoints import write_qwen3_moe_safetensors, write_qwen3_safetensors

from engine import cuda, nccl
from engine.types import MemraError, SamplingParams, StepItem


def _two_gpus() -> bool:
    try:
        return len(cuda.detect_devices()) >= 2
    except Exception:
        return False


def _nccl() -> bool:
    try:
        nccl.version()
        return True
    except nccl.NcclUnavailable:
        return False


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not _two_gpus(), reason="needs 2 CUDA devices"),
    pytest.mark.skipif(not _nccl(), reason="NCCL not installed (memra[multigpu])"),
]

GREEDY = SamplingParams(temperature=0.0)
DENSE = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
             intermediate_size=512, vocab_size=512)
MOE = dict(DENSE, moe_intermediate_size=256, mlp_only_layers=(1,), num_experts=8, num_experts_per_tok=2)
PROMPT = [3, 77, 12, 12, 90, 5, 41, 127, 0, 66, 8, 19, 100, 54, 23, 31]


def test_all_reduce_and_send_recv_between_two_devices():
    ctxs = [cuda.Context(d) for d in (0, 1)]
    n = 1 << 20
    host = [np.random.default_rng(r).standard_normal(n).astype(np.float32) for r in (0, 1)]
    bufs, outs, streams = [], [], []
    for r, ctx in enumerate(ctxs):
        ctx.make_current()
        bufs.append(cuda.alloc(4 * n))
        outs.append(cuda.alloc(4 * n))
        streams.append(cuda.Stream())
        cuda.htod(bufs[r].ptr, host[r])
    comms = nccl.Communicator.init_all([0, 1])
    nccl.group_start()
    for r, ctx in enumerate(ctxs):
        ctx.make_current()
        comms[r].all_reduce(bufs[r].ptr, outs[r].ptr, n, "f32", int(streams[r].handle))
    nccl.group_end()
    want = host[0] + host[1]
    for r, ctx in enumerate(ctxs):
        ctx.make_current()
        streams[r].synchronize()
        got = cuda.dtoh(np.empty(n, np.float32), outs[r].ptr)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    # point to point: rank 0's activations land on rank 1 (what PP sends between stages)
    nccl.group_start()
    ctxs[0].make_current()
    comms[0].send(bufs[0].ptr, n, "f32", 1, int(streams[0].handle))
    ctxs[1].make_current()
    comms[1].recv(outs[1].ptr, n, "f32", 0, int(streams[1].handle))
    nccl.group_end()
    ctxs[1].make_current()
    streams[1].synchronize()
    np.testing.assert_array_equal(cuda.dtoh(np.empty(n, np.float32), outs[1].ptr), host[0])
    for c in comms:
        c.destroy()


def _greedy(runner, steps: int = 12) -> list[int]:
    table = list(range(8))
    item = StepItem(seq_id=1, token_ids=PROMPT, start_pos=0, block_table=table, sample=True, sampling=GREEDY)
    out = []
    for _ in range(steps):
        tok = runner.step([item])[0]
        out.append(tok)
        item = StepItem(seq_id=1, token_ids=[tok], start_pos=item.start_pos + len(item.token_ids),
                        block_table=table, sample=True, sampling=GREEDY)
    return out


@pytest.fixture(scope="module", params=["qwen3", "qwen3_moe"])
def model(request, tmp_path_factory):
    from engine.model import load_model

    d = tmp_path_factory.mktemp(request.param)
    write = write_qwen3_safetensors if request.param == "qwen3" else write_qwen3_moe_safetensors
    return load_model(write(d / "m", seed=5, **(DENSE if request.param == "qwen3" else MOE)))


@pytest.mark.parametrize("split", ["tp", "pp"])
def test_split_greedy_equals_one_gpu_and_the_sharded_reference(model, split):
    from engine.backend import create_runner
    from engine.placement import plan_placement
    from engine.runner_cuda import CudaRunner
    from engine.sharded_reference import ShardedReference

    one = _greedy(CudaRunner(model, num_blocks=64, max_model_len=256))
    try:
        two = create_runner(model, "cuda", None, devices="0,1", split=split, num_blocks=64, max_model_len=256)
    except MemraError as exc:
        if "does not split a model over devices yet" in str(exc):
            pytest.xfail("the CUDA runner does not split over devices yet (issue 40)")
        raise
    assert _greedy(two) == one
    pl = plan_placement(model.graph, model.dims, split, [0, 1], model.quant, model.tensor_dtypes)
    ref = _greedy(ShardedReference(model, pl, num_blocks=64, max_model_len=256))
    assert ref[:4] == one[:4]  # bf16 activations may part from the f32 oracle later in a random model
