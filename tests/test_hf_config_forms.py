"""config.json as transformers 5 writes it (``rope_parameters``), as transformers 4 wrote it
(``rope_theta`` + ``rope_scaling``) and per layer type give the same model, checked against
transformers' own output on tiny random checkpoints saved by the installed transformers; math-changing
keys memra does not implement are errors naming the key."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from engine.model import load_model
from engine.reference import ReferenceRunner
from engine.types import MemraError

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

IDS = [3, 77, 12, 12, 90, 5, 41, 127, 0, 66, 8, 19, 100, 54, 23, 31, 2, 9, 70, 44] * 2
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}


def _save(tmp: Path, arch: str, rope: dict | None = None) -> Path:
    common = dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        vocab_size=160,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    rope = rope or {"rope_type": "default", "rope_theta": 10000.0}
    if arch == "qwen3":
        cfg = transformers.Qwen3Config(**common, rope_parameters=rope)
        cls = transformers.Qwen3ForCausalLM
    else:
        cfg = transformers.LlamaConfig(**common, rope_parameters=rope)
        cls = transformers.LlamaForCausalLM
    torch.manual_seed(0)
    model = cls(cfg).eval()
    out = tmp / f"{arch}-v5"
    model.save_pretrained(out)
    return out


def _memra_logits(path: Path, ids=IDS) -> np.ndarray:
    return ReferenceRunner(load_model(path), num_blocks=8, block_size=16, max_model_len=128).forward_logits(ids)


def _hf(path: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def _rewrite(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    edit(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _v4_form(cfg: dict) -> None:
    rp = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rp.pop("rope_theta")
    cfg["rope_scaling"] = None if rp.get("rope_type") == "default" else rp


@pytest.mark.parametrize("arch,rope", [("qwen3", None), ("llama", None), ("llama", {"rope_theta": 500000.0, **LLAMA3})])
def test_v5_and_v4_configs_give_the_same_model(tmp_path, arch, rope):
    v5 = _save(tmp_path, arch, rope)
    cfg = json.loads((v5 / "config.json").read_text())
    assert "rope_parameters" in cfg and "rope_theta" not in cfg  # what transformers 5 writes
    ours = _memra_logits(v5)
    with torch.no_grad():
        theirs = _hf(v5)(torch.tensor([IDS]), use_cache=False).logits[0].numpy()
    err = float(np.abs(ours - theirs).max() / np.abs(theirs).max())
    assert err < 1e-4, f"{arch}: max relative error {err:.2e}"
    # greedy continuation: memra (re-running the prefix) vs transformers' generate
    runner = ReferenceRunner(load_model(v5), num_blocks=8, block_size=16, max_model_len=128)
    seq = list(IDS[:8])
    for _ in range(12):
        seq.append(int(np.argmax(runner.forward_logits(seq)[-1])))
    with torch.no_grad():
        hf_seq = _hf(v5).generate(torch.tensor([IDS[:8]]), max_new_tokens=12, do_sample=False, min_new_tokens=12)
    assert seq == hf_seq[0].tolist()
    # the same checkpoint in the transformers 4 form and in the per-layer-type form: identical logits
    v4 = _rewrite(v5, tmp_path / "v4", _v4_form)
    assert np.array_equal(_memra_logits(v4), ours)

    def per_type(c):
        c["rope_parameters"] = {"full_attention": c["rope_parameters"]}
        c["layer_types"] = ["full_attention"] * c["num_hidden_layers"]

    assert np.array_equal(_memra_logits(_rewrite(v5, tmp_path / "lt", per_type)), ours)
    assert load_model(v4).dims == load_model(v5).dims


@pytest.fixture(scope="module")
def qwen3_v5(tmp_path_factory) -> Path:
    return _save(tmp_path_factory.mktemp("qwen3_v5"), "qwen3")


def _load_error(base, tmp_path, name, edit) -> str:
    with pytest.raises(MemraError) as ei:
        load_model(_rewrite(base, tmp_path / name, edit))
    return str(ei.value)


@pytest.mark.parametrize(
    "name,edit,needle",
    [
        ("yarn", lambda c: c["rope_parameters"].update(rope_type="yarn", factor=4.0), "'rope_parameters.rope_type'"),
        ("bias", lambda c: c.update(attention_bias=True), "'attention_bias'"),
        ("act", lambda c: c.update(hidden_act="gelu"), "'hidden_act'"),
        ("swa", lambda c: c.update(use_sliding_window=True), "'use_sliding_window'"),
        ("layers", lambda c: c.update(layer_types=["full_attention", "sliding_attention"]), "'layer_types'"),
        (
            "disagree",
            lambda c: c.update(rope_theta=1000000.0),
            "'rope_theta' (1000000.0) and 'rope_parameters.rope_theta' (10000.0) disagree",
        ),
        (
            "per_type_differs",
            lambda c: c.update(  # no layer_types: every listed type is in use
                layer_types=None,
                rope_parameters={
                    "full_attention": {"rope_type": "default", "rope_theta": 10000.0},
                    "sliding_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                },
            ),
            "differs between layer types",
        ),
        ("partial", lambda c: c["rope_parameters"].update(partial_rotary_factor=0.5), "partial_rotary_factor"),
    ],
)
def test_math_changing_keys_memra_does_not_implement_are_errors(qwen3_v5, tmp_path, name, edit, needle):
    msg = _load_error(qwen3_v5, tmp_path, name, edit)
    assert needle in msg and "config.json" in msg, msg
