"""The model-family and device-profile DSL: shipped files load; bad files fail with file + key path."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from engine import graph, paths, profile
from engine.model import dims_for_size, match_quant, resolve_dims
from engine.types import ConfigError, MemraError


def test_shipped_families_load():
    fams = graph.all_families()
    assert {"llama", "qwen3"} <= set(fams)
    for name in ("bf16", "f16", "q8_0", "q4_0", "q4_1", "q4_k_m", "q6_k"):
        assert name in fams["llama"].quants and name in fams["qwen3"].quants
    q3_ops = [op.op for op, _ in fams["qwen3"].ops()]
    assert q3_ops.count("head_rmsnorm") == 2
    assert q3_ops.index("head_rmsnorm") < q3_ops.index("rope")
    assert fams["qwen3"].rope_style == {"hf": "neox", "gguf": "neox"}
    assert fams["llama"].rope_style == {"hf": "neox", "gguf": "interleaved"}
    assert "rope_freqs" not in fams["qwen3"].tensors


def test_q4_1_combo_matches_smollm2_layout():
    g = graph.load_family("llama")
    combo = match_quant(g, {"embed": {"q8_0"}, "wq": {"q4_1"}, "w_down": {"q4_1"}}, "x.gguf")
    assert combo.name == "q4_1"
    with pytest.raises(MemraError, match="Supported combos"):
        match_quant(g, {"wq": {"q2_k"}}, "x.gguf")


def test_dims_from_hf_and_gguf_metadata():
    g = graph.load_family("qwen3")
    hf = {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "intermediate_size": 128,
        "vocab_size": 300,
        "rms_norm_eps": 1e-6,
    }
    d = resolve_dims(g, "hf", hf, "config.json")
    assert d["q_dim"] == 128 and d["kv_dim"] == 64 and d["tie_embeddings"] is False
    gg = {
        "general.architecture": "qwen3",
        "qwen3.embedding_length": 64,
        "qwen3.block_count": 2,
        "qwen3.attention.head_count": 4,
        "qwen3.feed_forward_length": 128,
        "qwen3.attention.layer_norm_rms_epsilon": 1e-6,
    }
    d = resolve_dims(g, "gguf", gg, "m.gguf", tensor_shape=lambda k: (300, 64), has_tensor=lambda k: False)
    assert d["vocab"] == 300 and d["kv_heads"] == 4 and d["tie_embeddings"] is True and d["head_dim"] == 128
    with pytest.raises(MemraError, match=r"config.json: missing field 'hidden_size'"):
        resolve_dims(g, "hf", {k: v for k, v in hf.items() if k != "hidden_size"}, "config.json")
    with pytest.raises(MemraError, match="expected int"):
        resolve_dims(g, "hf", {**hf, "hidden_size": "big"}, "config.json")


def test_sizes_resolve():
    assert dims_for_size("qwen3", "qwen3-4b")["q_dim"] == 4096
    assert dims_for_size("llama", "smollm2-135m")["kv_dim"] == 192


def _family_copy(tmp_path: Path) -> Path:
    root = tmp_path / "models"
    shutil.copytree(paths.models_dir(), root)
    graph._load_family.cache_clear()
    return root


def _one_line_error(fn) -> str:
    with pytest.raises(ConfigError) as info:
        fn()
    text = str(info.value)
    assert "\n" not in text, text
    return text


def test_profile_base_inherits_tuning_knob_by_knob(tmp_path):
    """``base:`` starts a profile's tuning from another's; the knobs a file writes replace the base's
    one by one, its top-level numbers stay its own; an unknown base or a cycle names the file."""
    ps = profile.all_profiles()
    assert ps["h100"].tuning == ps["h200"].tuning and ps["generic-sm90"].tuning == ps["h200"].tuning
    assert ps["h100"].memory_bandwidth_gbs == 2990 and ps["h200"].memory_bandwidth_gbs == 4100  # their own
    root = tmp_path / "profiles"
    shutil.copytree(paths.profiles_dir(), root)
    h100 = root / "h100.yaml"
    h100.write_text(h100.read_text() + "tuning:\n  gemv_coop: {q8x_wsm_kb: 64}\n  gemv: {prefetch: false}\n")
    profile._load_all.cache_clear()
    mine, base = profile.all_profiles(root)["h100"], profile.all_profiles(root)["h200"]
    assert mine.tuning["gemv_coop"] == {**base.tuning["gemv_coop"], "q8x_wsm_kb": 64}
    assert mine.tuning["gemv"] == {**base.tuning["gemv"], "prefetch": False}
    assert mine.tuning["decode_graph"] == base.tuning["decode_graph"] and base.tuning["decode_graph"]["pair_linears"]
    for text, expect in (
        ("base: h300", r"h100.yaml: base: unknown profile 'h300'; available: .*h200"),
        ("base: h100", r"h100.yaml: base: 'h100' leads back to itself \(h100 -> h100\)"),
    ):
        h100.write_text(re.sub(r"^base: .*$", text, h100.read_text(), flags=re.M))
        profile._load_all.cache_clear()
        assert re.search(expect, _one_line_error(lambda: profile.all_profiles(root))), text
    profile._load_all.cache_clear()


def test_select_takes_the_devices_sm_count(caplog):
    """An H100 PCIe (114 SMs) matches h100.yaml (132, the SXM): the plan must size its grids for 114."""
    pcie = profile.select(profile.DeviceInfo("NVIDIA H100 PCIe", (9, 0), 114))
    assert pcie.name == "h100" and pcie.sm_count == 114
    assert profile.select(profile.DeviceInfo("NVIDIA H100 80GB HBM3", (9, 0), 132)).sm_count == 132
    assert profile.select(profile.DeviceInfo("NVIDIA H100 80GB HBM3", (9, 0))).sm_count == 132  # unknown: the file's
    assert profile.select(profile.DeviceInfo("NVIDIA H20", (9, 0), 78)).sm_count == 78


@pytest.mark.parametrize(
    "old,new,expect",
    [
        (
            "  hidden:       {hf: hidden_size,",
            "  hiden:       {hf: hidden_size,",
            r"llama.yaml: .*'hidden' is not a dim",
        ),
        (
            "rope_style: {hf: neox",
            "rope_styel: {hf: neox",
            r"llama.yaml: rope_styel: unknown key \(did you mean 'rope_style'\?\)",
        ),
        (
            "kind: matrix, shape: [q_dim, hidden]}",
            "kind: matrx, shape: [q_dim, hidden]}",
            r"llama.yaml: tensors.wq.kind: expected one of",
        ),
        (
            '  wq:         {hf: "model.layers.{i}.self_attn.q_proj.weight", gguf: "blk.{i}.attn_q.weight", ',
            "  wq:         {",
            r"llama.yaml: tensors.wq: a tensor needs a name pattern",
        ),
        (
            "layers:       {hf: num_hidden_layers,",
            "layers:       {hf: 7,",
            r"llama.yaml: dims.layers.hf: expected string or list, got int 7",
        ),
        (
            "{op: silu_mul, in: [g, u], out: m}",
            "{op: silu_mul, in: [g, z], out: m}",
            r"llama.yaml: graph\[1\].body\[7\].in: value 'z' is used before",
        ),
        (
            "q8_0:   {default: q8_0}",
            "q8_0:   {default: q8_1}",
            r"llama.yaml: quants.q8_0.default: unknown storage type 'q8_1'",
        ),
        (
            "{op: attention, in: [q, k, v], out: a}",
            "{op: atention, in: [q, k, v], out: a}",
            r"graph\[1\].body\[3\].op: unknown op 'atention'",
        ),
    ],
)
def test_bad_family_yaml_names_file_and_key(tmp_path, old, new, expect):
    root = _family_copy(tmp_path)
    f = root / "llama.yaml"
    text = f.read_text()
    assert old in text
    f.write_text(text.replace(old, new, 1))
    msg = _one_line_error(lambda: graph.load_family("llama", root))
    assert str(f) in msg
    assert pytest.importorskip("re").search(expect, msg), msg


def test_invalid_yaml_syntax_is_reported(tmp_path):
    root = _family_copy(tmp_path)
    (root / "llama.yaml").write_text("family: llama\ndims: {hidden: [\n")
    msg = _one_line_error(lambda: graph.load_family("llama", root))
    assert "invalid YAML at line" in msg


def test_extends_cycle_and_bad_edit(tmp_path):
    root = _family_copy(tmp_path)
    q = root / "qwen3.yaml"
    q.write_text(
        q.read_text().replace("after: {op: linear, out: [q, k, v]}", "after: {op: linear, out: [q, k, w]}")
    )
    msg = _one_line_error(lambda: graph.load_family("qwen3", root))
    assert "qwen3.yaml: graph_edits[0]: no op in the parent graph matches" in msg


def test_profiles_load_and_select():
    ps = profile.all_profiles()
    assert {"h100", "h200", "rtx-pro-6000", "rtx-5090"} <= set(ps)
    assert {f"generic-sm{n}" for n in (80, 86, 89, 90, 120)} <= set(ps)
    assert ps["h200"].arch == "sm_90a" and ps["rtx-5090"].arch == "sm_120a"
    assert profile.select(profile.DeviceInfo("NVIDIA H200", (9, 0))).name == "h200"
    assert profile.select(profile.DeviceInfo("NVIDIA H100 80GB HBM3", (9, 0))).name == "h100"
    assert (
        profile.select(profile.DeviceInfo("NVIDIA RTX PRO 6000 Blackwell Server Edition", (12, 0))).name
        == "rtx-pro-6000"
    )
    assert profile.select(profile.DeviceInfo("NVIDIA GeForce RTX 4090", (8, 9))).name == "generic-sm89"
    assert profile.select(profile.DeviceInfo("NVIDIA A800", (8, 7))).name == "generic-sm86"
    assert profile.select(profile.DeviceInfo("anything", (9, 0)), override="rtx-5090").name == "rtx-5090"
    with pytest.raises(ConfigError, match="unknown device profile 'nope'"):
        profile.get_profile("nope")
    with pytest.raises(ConfigError, match="older than every memra profile"):
        profile.select(profile.DeviceInfo("old", (7, 5)))


@pytest.mark.parametrize(
    "old,new,expect",
    [
        ("arch: sm_90a", "arch: 90", r"h200.yaml: arch: expected string, got int 90"),
        (
            "gemv: {prefetch: true",
            "gemv: {prefetc: true",
            r"h200.yaml: tuning.gemv.prefetc: unknown key \(did you mean 'prefetch'\?\)",
        ),
        (
            "kv_block_size: 16",
            "kv_block_size: 12",
            r"h200.yaml: kv_block_size: expected a power of two, got 12",
        ),
        (
            "memory_bandwidth_gbs: 4100",
            "memory_bandwith_gbs: 4100",
            r"h200.yaml: memory_bandwith_gbs: unknown key",
        ),
    ],
)
def test_bad_profile_yaml(tmp_path, old, new, expect):
    import re

    root = tmp_path / "profiles"
    shutil.copytree(paths.profiles_dir(), root)
    f = root / "h200.yaml"
    f.write_text(f.read_text().replace(old, new, 1))
    profile._load_all.cache_clear()
    msg = _one_line_error(lambda: profile.all_profiles(root))
    assert re.search(expect, msg), msg


def test_memra_tune_overrides_knobs_checked_like_a_profile(monkeypatch):
    from engine.profile import select, with_tuning
    from engine.types import DeviceInfo

    h200 = DeviceInfo("NVIDIA H200", (9, 0), 132)
    base = select(h200)
    monkeypatch.setenv("MEMRA_TUNE", "gemv.fuse_glu=false; gemv_coop.types=[bf16, q8_0]; gemv_coop.unroll=4")
    tuned = select(h200)
    assert tuned.tuning["gemv"]["fuse_glu"] is False and base.tuning["gemv"]["fuse_glu"] is True
    assert tuned.tuning["gemv_coop"] == {**base.tuning["gemv_coop"], "types": ["bf16", "q8_0"], "unroll": 4}
    assert tuned.tuning["gemm"] == base.tuning["gemm"] and tuned.name == "h200"
    for bad, msg in (
        ("gemv.fuse_gl=true", "did you mean 'fuse_glu'"),
        ("gemvx.unroll=2", "unknown key"),
        ("gemv_coop.unroll=-1", "positive"),
        ("gemv", "expected section.knob=value"),
        ("gemv_coop.unroll=abc", "expected integer"),
    ):
        with pytest.raises(ConfigError, match=msg):
            with_tuning(base, bad)


def test_tuning_is_one_frozen_dataclass_per_kernel_family(tmp_path):
    """engine.tuning: each family's knobs are a frozen dataclass with its defaults; a profile's
    values come in validated (file and key named) and read as attributes or as a Mapping."""
    import dataclasses

    from engine import tuning
    from engine.profile import get_profile, load_profile

    h200 = get_profile("h200")
    assert set(h200.tuning) == set(tuning.SECTIONS)
    coop = h200.tuning["gemv_coop"]
    assert isinstance(coop, tuning.GemvCoop) and coop.q8x and coop["q8x_threads"] == 256
    with pytest.raises(dataclasses.FrozenInstanceError):
        coop.q8x = False  # type: ignore[misc]
    assert tuning.Gemv().fuse_glu is False and get_profile("generic-sm80").tuning["gemv"] == tuning.Gemv()
    bad = tmp_path / "h200.yaml"
    bad.write_text(Path(h200.path).read_text().replace("unroll: 2,", "unroll: -2,", 1))
    with pytest.raises(ConfigError, match=r"h200.yaml: tuning.gemv_coop.unroll: expected a positive number"):
        load_profile(bad)


def test_every_knob_a_profile_sets_is_in_the_knob_table():
    """docs/kernels.md "Tuning knobs": every knob some profile sets to a non-default value has its
    line (the knob rule: non-default somewhere, with its measured gain recorded)."""
    from engine import tuning
    from engine.profile import all_profiles

    text = (Path(__file__).resolve().parent.parent / "docs" / "kernels.md").read_text()
    table = text[text.index("## Tuning knobs") : text.index("## Catalog API")]
    defaults = tuning.defaults()
    missing = set()
    for prof in all_profiles().values():
        for section, knobs in prof.tuning.items():
            for name, value in knobs.items():
                if value != defaults[section][name] and name not in table:
                    missing.add(f"{section}.{name}")
    assert not missing, f"set in a profile but not in docs/kernels.md's knob table: {sorted(missing)}"


def test_qwen3_5_reads_rope_fields_in_both_config_forms():
    """qwen3_5 lists the transformers-4 field and the transformers-5 rope_parameters field (one
    mechanism, hf lists); GGUF gets llama.cpp's tiled v-head order from gguf_default."""
    fam = graph.load_family("qwen3_5")
    base = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, intermediate_size=96, vocab_size=128,
                linear_value_head_dim=16)
    old = resolve_dims(fam, "hf", {**base, "rope_theta": 5e5, "partial_rotary_factor": 0.5}, "c.json")
    new = resolve_dims(
        fam, "hf", {**base, "rope_parameters": {"rope_theta": 5e5, "partial_rotary_factor": 0.5}}, "c.json"
    )
    for dims in (old, new):
        assert (dims["rope_theta"], dims["partial_rotary_factor"], dims["v_heads_tiled"]) == (5e5, 0.5, False)
    assert old["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    gguf = {f"qwen35.{k}": v for k, v in [("embedding_length", 64), ("block_count", 4), ("attention.head_count", 4),
                                          ("feed_forward_length", 96), ("vocab_size", 128),
                                          ("ssm.inner_size", 512)]}
    assert resolve_dims(fam, "gguf", {"general.architecture": "qwen35", **gguf}, "m.gguf")["v_heads_tiled"] is True
