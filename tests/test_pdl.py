"""Programmatic dependent launch (PDL) without a GPU: the kernel contract (every template calls
pdl_wait() first), the profile field, MEMRA_PDL, and the launch configuration."""

from __future__ import annotations

import dataclasses
import shutil
from typing import Any

import pytest
from fixtures.catalog_specs import all_specs
from fixtures.families import family_cases
from fixtures.pdl import waits_first

from engine import kernel_catalog as kc
from engine import paths, profile
from engine.render import render
from engine.types import ConfigError


def _specs():
    """One spec per (template, code flags) over every family's sizes and storage types (h200 tuning,
    with decode_graph.pair_linears on for the gemv_pair kernels)."""
    tune = "decode_graph.pair_linears=true"
    prof = profile.with_tuning(profile.get_profile("h200"), tune)
    out: dict[tuple, Any] = {}
    for _fam, _size, d, types, styles, qk in family_cases():
        for s in all_specs(
            d, types, prof.tuning, block_size=prof.kv_block_size, rope_styles=styles, qk_norm=qk
        ):
            flags = tuple(sorted((k, v) for k, v in s.params.items() if isinstance(v, (bool, str))))
            out.setdefault((s.template, *flags), s)
    return list(out.values())


def test_every_kernel_waits_before_touching_memory():
    specs = _specs()
    assert {s.template for s in specs} == set(kc.KERNELS)
    for s in specs:
        src = render(s)
        assert "griddepcontrol.wait;" in src and "griddepcontrol.launch_dependents;" in src
        assert waits_first(src, s.entry), f"{s.entry} ({s.template}) does not start with pdl_wait();"
        assert s.pdl, f"{s.entry}: the spec's pdl field must say what its source does (the runner reads it)"


def test_the_spec_pdl_field_follows_the_template_contract(monkeypatch):
    """The runner launches with PDL by ``KernelSpec.pdl`` (it never renders to look): a template
    whose contract says it does not wait first gives specs without it."""
    s = kc.spec("silu_mul", inter=1536, in_stride=3072, threads=256)
    assert s.pdl and waits_first(render(s), s.entry)
    monkeypatch.setitem(kc.KERNELS, "silu_mul", dataclasses.replace(kc.KERNELS["silu_mul"], pdl=False))
    assert not kc.spec("silu_mul", inter=1536, in_stride=3072, threads=256).pdl


def test_waits_first_reads_the_first_statement_of_the_body():
    ok = "__global__ void k_1(int* a,\n    int n)\n{\n    // note\n\n    pdl_wait(); pdl_trigger();\n    a[0] = n;\n}\n"
    assert waits_first(ok, "k_1")
    assert not waits_first(ok.replace("pdl_wait(); pdl_trigger();", "a[1] = 0; pdl_wait();"), "k_1")
    assert not waits_first(ok, "k_2")
    assert not waits_first("__global__ void k_1(int n)\n{\n    __shared__ float s[4];\n}\n", "k_1")


def test_profiles_enable_pdl_only_on_sm90():
    ps = profile.all_profiles()
    assert {n for n, p in ps.items() if p.programmatic_launch} == {"h200", "h100", "generic-sm90"}
    for p in ps.values():
        if p.programmatic_launch:
            assert profile.arch_number(p.arch) >= 90


def test_programmatic_launch_below_sm90_is_a_config_error(tmp_path):
    root = tmp_path / "profiles"
    shutil.copytree(paths.profiles_dir(), root)
    f = root / "generic-sm80.yaml"
    f.write_text(f.read_text() + "programmatic_launch: true\n")
    with pytest.raises(ConfigError) as info:
        profile.load_profile(f)
    msg = str(info.value)
    assert "generic-sm80.yaml" in msg and "programmatic_launch" in msg and "sm_80" in msg
    f.write_text(f.read_text().replace("programmatic_launch: true", "programmatic_launch: yes please"))
    with pytest.raises(ConfigError, match="programmatic_launch"):
        profile.load_profile(f)


def test_memra_pdl_overrides_the_profile_and_needs_sm90(monkeypatch):
    from engine.runner_cuda import _pdl_enabled

    h200, sm80 = profile.get_profile("h200"), profile.get_profile("generic-sm80")
    monkeypatch.delenv("MEMRA_PDL", raising=False)
    assert _pdl_enabled(h200, (9, 0)) and not _pdl_enabled(sm80, (8, 0))
    assert not _pdl_enabled(h200, (8, 0))  # the device is older than the profile says
    monkeypatch.setenv("MEMRA_PDL", "0")
    assert not _pdl_enabled(h200, (9, 0))
    monkeypatch.setenv("MEMRA_PDL", "1")
    assert _pdl_enabled(h200, (9, 0))
    assert not _pdl_enabled(sm80, (9, 0))  # kernels built for sm_80 have pdl_wait() compiled out
    monkeypatch.setenv("MEMRA_PDL", "maybe")
    with pytest.raises(ConfigError, match="MEMRA_PDL"):
        _pdl_enabled(h200, (9, 0))


def _bindings():
    """The driver bindings as engine.cuda loads them (tests import no cuda-python themselves)."""
    from engine import cuda

    try:
        return cuda._driver()
    except cuda.CudaUnavailable:
        pytest.skip("cuda-bindings not installed")


class _FakeFunction:
    name = "k"
    handle = None

    def __init__(self):
        self.smem = []

    def ensure_smem(self, n: int) -> None:
        self.smem.append(n)


def test_prepared_launch_builds_its_config_without_a_gpu():
    drv = _bindings()
    from engine import cuda

    fn = _FakeFunction()
    pl = cuda.PreparedLaunch(fn, (3, 2), (128,), 65536, None, pdl=True)  # type: ignore[arg-type]
    assert fn.smem == [65536] and pl.grid == (3, 2, 1) and pl.block == (128, 1, 1)
    c = pl.config
    assert (c.gridDimX, c.gridDimY, c.gridDimZ) == (3, 2, 1)
    assert (c.blockDimX, c.blockDimY, c.blockDimZ) == (128, 1, 1)
    assert c.sharedMemBytes == 65536 and c.numAttrs == 1
    attr = c.attrs[0]
    assert attr.id == drv.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    assert attr.value.programmaticStreamSerializationAllowed == 1
    plain = cuda.PreparedLaunch(fn, (1,), (32,), 0, None, pdl=False)  # type: ignore[arg-type]
    assert plain.config.numAttrs == 0 and fn.smem == [65536]


def test_a_body_marked_pdl_preload_counts_only_with_its_wait():
    from fixtures.pdl import PDL_PRELOAD

    src = 'extern "C" __global__ void k_1(float* a) {\n    %s\n    float w = a[0];\n    pdl_wait();\n}\n'
    assert waits_first(src % PDL_PRELOAD, "k_1")
    assert not waits_first((src % PDL_PRELOAD).replace("pdl_wait();", ""), "k_1")
    assert not waits_first(src % "// other comment", "k_1")
