"""CudaRunner on a real GPU (skipped without one): logits vs the numpy reference, graph == eager.

The checkpoint is a tiny random Llama written here (bf16 safetensors by hand, no torch).
"""

from __future__ import annotations

import json
import os
import struct

import numpy as np
import pytest

from engine import cuda
from engine.types import SamplingParams, StepItem

pytestmark = pytest.mark.skipif(not cuda.detect_devices(), reason="no CUDA GPU")

GREEDY = SamplingParams(temperature=0.0)
DIMS = dict(hidden=256, layers=2, heads=4, kv_heads=2, head_dim=64, intermediate=512, vocab=512)


def _bf16_bytes(a: np.ndarray) -> bytes:
    bits = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16).tobytes()


def write_checkpoint(path, family: str = "llama", dims: dict | None = None, seed: int = 0) -> None:
    """A random HF checkpoint (config.json + bf16 model.safetensors, tied embeddings) of ``family``
    (llama or qwen3) with ``dims`` (hidden, layers, heads, kv_heads, head_dim, intermediate, vocab)."""
    d = dims or DIMS
    rng = np.random.default_rng(seed)
    h, i, v = d["hidden"], d["intermediate"], d["vocab"]
    q, kv = d["heads"] * d["head_dim"], d["kv_heads"] * d["head_dim"]
    tensors = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    for layer in range(d["layers"]):
        p = f"model.layers.{layer}."
        tensors.update(
            {
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (q, h),
                p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h),
                p + "self_attn.o_proj.weight": (h, q),
                p + "mlp.gate_proj.weight": (i, h),
                p + "mlp.up_proj.weight": (i, h),
                p + "mlp.down_proj.weight": (h, i),
            }
        )
        if family == "qwen3":
            tensors[p + "self_attn.q_norm.weight"] = (d["head_dim"],)
            tensors[p + "self_attn.k_norm.weight"] = (d["head_dim"],)
    header, blobs, off = {}, [], 0
    for name, shape in tensors.items():
        if len(shape) == 1:
            arr = rng.uniform(0.7, 1.3, shape).astype(np.float32)
        else:
            arr = rng.standard_normal(shape, dtype=np.float32) * np.float32(0.05)
        raw = _bf16_bytes(arr)
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    path.mkdir(parents=True, exist_ok=True)
    _write_at_offsets(path / "model.safetensors", [struct.pack("<Q", len(head)) + head] + blobs)
    config = {
        "architectures": ["Qwen3ForCausalLM" if family == "qwen3" else "LlamaForCausalLM"],
        "model_type": family,
        "hidden_size": h,
        "intermediate_size": i,
        "num_hidden_layers": d["layers"],
        "num_attention_heads": d["heads"],
        "num_key_value_heads": d["kv_heads"],
        "head_dim": d["head_dim"],
        "vocab_size": v,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-6 if family == "qwen3" else 1e-5,
        "rope_theta": 1e6 if family == "qwen3" else 1e5,
        "tie_word_embeddings": True,
    }
    (path / "config.json").write_text(json.dumps(config))


def _write_at_offsets(file, parts: list[bytes]) -> None:
    """Write ``parts`` back to back with explicit offsets (os.pwrite, partial writes retried) and
    check the header reads back: one sandboxed filesystem was seen misplacing buffered writes."""
    fd = os.open(file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        off = 0
        for part in parts:
            view = memoryview(part)
            while view:
                done = os.pwrite(fd, view, off)
                off += done
                view = view[done:]
        os.fsync(fd)
    finally:
        os.close(fd)
    with open(file, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        json.loads(f.read(n))
    if os.path.getsize(file) != off:
        raise OSError(f"{file}: wrote {off} bytes, the file has {os.path.getsize(file)}")


def write_tiny_llama(path, seed: int = 0) -> None:
    write_checkpoint(path, "llama", DIMS, seed)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from engine.model import load_model
    from engine.reference import ReferenceRunner
    from engine.runner_cuda import CudaRunner

    path = tmp_path_factory.mktemp("tiny-llama")
    write_tiny_llama(path)
    model = load_model(path)
    runner = CudaRunner(model, num_blocks=256, max_model_len=1024)
    yield runner, ReferenceRunner(model, num_blocks=64, max_model_len=1024)
    runner.close()


def _rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_prefill_and_decode_logits_match_the_numpy_reference(models):
    runner, ref = models
    rng = np.random.default_rng(3)
    prompt = [int(t) for t in rng.integers(1, DIMS["vocab"], 11)]
    table = list(range(4))
    tok = runner.step([StepItem(0, prompt, 0, table, True, GREEDY)])[0]
    want = ref.forward_logits(prompt)
    assert _rel(runner.read_logits(1)[0], want[-1]) < 2e-2
    assert tok == int(np.argmax(runner.read_logits(1)[0]))
    seq = prompt + [tok]
    for _ in range(4):
        tok = runner.step([StepItem(0, [seq[-1]], len(seq) - 1, table, True, GREEDY)])[0]
        assert _rel(runner.read_logits(1)[0], ref.forward_logits(seq)[-1]) < 2e-2
        seq.append(tok)


@pytest.mark.parametrize("batch", [1, 3, 8])
def test_graph_replay_is_bit_identical_to_eager(models, batch):
    runner, _ = models
    rng = np.random.default_rng(batch)
    items = []
    for b in range(batch):
        table = [10 + 2 * b, 11 + 2 * b]
        prompt = [int(t) for t in rng.integers(1, DIMS["vocab"], 5 + b)]
        runner.step([StepItem(b, prompt, 0, table, True, GREEDY)])
        items.append(StepItem(b, [int(rng.integers(1, DIMS["vocab"]))], len(prompt), table, True, GREEDY))
    runner.use_graphs = True
    ids_graph = runner.step(items)
    logits_graph = runner.read_logits(batch)
    runner.use_graphs = False
    ids_eager = runner.step(items)
    logits_eager = runner.read_logits(batch)
    runner.use_graphs = True
    assert ids_graph == ids_eager
    assert np.array_equal(logits_graph.view(np.uint32), logits_eager.view(np.uint32))
    assert ids_graph == [runner.step([it])[0] for it in items]  # batched == alone


def test_copy_bandwidth_is_measured_not_the_profiles(models):
    """`memra bench`'s copy row: a device-to-device copy of a buffer several times the L2, read +
    written bytes over the median time. On a data-centre card it lands within a factor of two of
    the profile's number (which is itself a measurement or a datasheet value), and the runner's
    memory is as free afterwards as before."""
    runner, _ = models
    free_before, _ = runner.ctx.mem_info()
    gbs = runner.copy_bandwidth_gbs(nbytes=512 << 20, repeats=3)
    assert 0.5 * runner.profile.memory_bandwidth_gbs < gbs < 2.0 * runner.profile.memory_bandwidth_gbs, gbs
    free_after, _ = runner.ctx.mem_info()
    assert abs(free_after - free_before) < 64 << 20
