"""Batched equal to solo on the device (issue #38 item 3): a decode row's bits must not depend on
which kernel of a pair ran it (the batch-1 GEMV against the bucket one, the direct attention against
the split one, the rope-fused attention against the rope kernel). The emulator
(tests/test_batch_invariance_emu.py) checks the order of operations with contraction off; on the
device a plain ``a * b + c`` or ``a * b - c * d`` leaves the compiler to choose which product it
fuses into an FFMA, and the choice may differ between two kernels compiled from one template. So
the decode kernels spell every rounding out (fmaf, __fmul_rn, __fadd_rn), which this module checks
in the PTX NVRTC makes of them (no GPU needed; skipped without NVRTC):

* NVVM contracts nothing: the PTX with ``--fmad=true`` equals the PTX with ``--fmad=false``, but for
  the ``.rn`` the latter writes on each plain mul / add / sub;
* nothing is left for ptxas to fuse: no plain ``mul.f32`` whose one use is a plain ``add.f32`` /
  ``sub.f32`` (a product used more than once, as libdevice's powf keeps one, is not fused).

The kernels: every decode launch (all batch-1, short, verify and bucket forms) of layer 0, a window
layer and the head of the Gemma 3 270M Q4_K_M launch mix (q5_0, q4_k and q6_kr GEMVs with exact x,
q8_0 v, the tall q8_0r head; head_dim 256 attention with q/k norms and a window) and of SmolLM2-135M
Q4_1 (q4_1r coop q8x GEMVs, the classic q8_0 head, 9 / 3 heads of 64), and of a tiny Qwen3 q4_k_m
GGUF (q4_k / q6_kr q8x GEMVs and pairs, the norm prologue, q/k norms) on the h100 profile. On main
the online softmax's ``l *= corr; l += p`` (every attention kernel), attention_combine's ``L += c``,
the q4_k GEMVs' ``dl * dot_l - ml * sl + dhi * dot_h - mhi * sh`` (f32 and q8x paths) and the
norms' ``ss / K + eps`` (contracted where K is a power of two: the same bits, as ss / K is exact
there, but spelt out too so that the check holds without exceptions) failed it.
"""

from __future__ import annotations

import os
import re
from concurrent.futures import ThreadPoolExecutor

import pytest

from engine import nvrtc
from engine.render import render

MODES = ("decode1", "short", "short1", "vshort", "vdecode", "decode")


def fusable_pairs(ptx: str) -> list[str]:
    """Plain ``mul.f32`` results read once, by a plain ``add.f32`` / ``sub.f32`` (scanning the PTX in
    text order; a register written again starts a new value)."""
    live: dict[str, list] = {}  # register -> [its defining line, plain mul?, reads, readers]
    out: list[str] = []

    def close(reg: str) -> None:
        d = live.pop(reg, None)
        if d and d[1] and d[2] == 1 and re.match(r"(?:@!?%p\d+\s+)?(add|sub)\.f32\s", d[3][0]):
            out.append(f"{d[0]} -> {d[3][0]}")

    for line in ptx.splitlines():
        line = line.strip()
        m = re.match(r"(?:@!?%p\d+\s+)?([a-z][\w.]*)\s+(.*);", line)
        if not m:
            continue
        op, regs = m.group(1), re.findall(r"%f\d+\b", m.group(2))
        dest = regs[0] if regs and not op.startswith("st.") and m.group(2).lstrip().startswith(regs[0]) else None
        for r in regs[1:] if dest else regs:
            if r in live:
                live[r][2] += 1
                live[r][3].append(line)
        if dest:
            close(dest)
            live[dest] = [line, op == "mul.f32", 0, []]
    for reg in list(live):
        close(reg)
    return out


def contracted(ptx_fmad: str, ptx_nofmad: str) -> bool:
    """Whether NVVM contracted something: the two PTX texts differ beyond the .rn of plain ops."""

    def norm(p: str) -> str:
        p = re.sub(r"\b(mul|add|sub)\.rn\.(f32|f64)\b", r"\1.\2", p)
        return "\n".join(x for x in p.splitlines() if not x.startswith("//"))

    return norm(ptx_fmad) != norm(ptx_nofmad)


def _ptx(spec, fmad: bool) -> str:
    return nvrtc.compile_to_ptx(render(spec), spec.entry, "compute_90a", [f"--fmad={'true' if fmad else 'false'}"])


@pytest.fixture(scope="module")
def decode_specs(tmp_path_factory):
    try:
        nvrtc.version()
        nvrtc.include_dirs()
    except nvrtc.NvrtcUnavailable as exc:
        pytest.skip(str(exc))
    from fixtures.checkpoints import Dims, write_gemma3_safetensors, write_random_gguf

    from engine.graph import load_family
    from engine.model import dims_for_size, load_model
    from engine.plan import build_plan
    from engine.profile import get_profile

    g = load_family("llama")
    smol = build_plan(g, dims_for_size("llama", "smollm2-135m"), g.quant("q4_1"), get_profile("h100"),
                      {"embed": "q8_0", "lm_head": "q8_0"}, rope_style="neox")  # fmt: skip
    m = load_model(write_gemma3_safetensors(tmp_path_factory.mktemp("g270"), window=512, hidden_size=640, num_hidden_layers=6,
                                            num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                                            intermediate_size=2048, vocab_size=512))  # fmt: skip
    mix = {"wq": "q5_0", "wk": "q5_0", "w_gate": "q5_0", "w_up": "q5_0", "wo": "q4_k", "wv": "q8_0",
           "w_down": "q6_k", "embed": "q8_0", "lm_head": "q8_0"}  # fmt: skip
    gemma = build_plan(m.graph, {**m.dims, "vocab": 262144}, m.graph.quant("q4_k_m_640"), get_profile("h100"), mix,
                       m.rope_style)  # fmt: skip
    qwen = Dims(hidden_size=512, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                intermediate_size=1536, vocab_size=768)  # fmt: skip
    m = load_model(write_random_gguf(tmp_path_factory.mktemp("q4km") / "m.gguf", "qwen3", qwen, "q4_k_m", seed=3))
    q4km = build_plan(m.graph, m.dims, m.quant, get_profile("h100"), m.tensor_dtypes, m.rope_style)
    specs = {}
    for plan in (smol, gemma, q4km):
        for st in plan.steps:
            if st.layer not in (0, 5, None):  # (gemma: layer 5 is a global one, 0 a window one)
                continue
            for mode in MODES:
                for la in st.launches.get(mode) or ():
                    p = la.spec.params
                    if la.spec.template == "gemv" and p["bmax"] > 1:  # (the bucket form: the same code unrolled;
                        continue  # its bmax-1 twin is checked)
                    specs.setdefault(la.spec, f"{plan.family} {st.op.op} layer {st.layer} {mode} {la.spec.template}")
    return specs


def _unfused(item) -> tuple[str, list[str]] | None:
    spec, what = item
    ptx = _ptx(spec, True)
    pairs = fusable_pairs(ptx)
    if pairs or contracted(ptx, _ptx(spec, False)):
        return what, pairs[:2] or ["NVVM contracted (fmad true / false PTX differ)"]
    return None


@pytest.mark.long  # (six seconds of compiles: .ci/run's long step)
def test_decode_kernels_leave_no_product_to_fuse(decode_specs):
    # (NVRTC releases the GIL: a thread per core, as KernelBuilder.build_all compiles)
    with ThreadPoolExecutor(max(2, os.cpu_count() or 2)) as pool:
        bad = dict(r for r in pool.map(_unfused, decode_specs.items()) if r)
    assert len(decode_specs) >= 12
    assert not bad, bad


def test_the_check_finds_a_fusable_product():
    src = 'extern "C" __global__ void k(float* a) { float l = a[0] * a[1]; if (a[2] > 0.0f) l += a[3]; a[4] = l; }'
    try:
        ptx = nvrtc.compile_to_ptx(src, "k", "compute_90a")
    except nvrtc.NvrtcUnavailable as exc:
        pytest.skip(str(exc))
    assert fusable_pairs(ptx) or contracted(ptx, nvrtc.compile_to_ptx(src, "k", "compute_90a", ["--fmad=false"]))
    rn = src.replace("a[0] * a[1]", "__fmul_rn(a[0], a[1])").replace("l += a[3]", "l = __fadd_rn(l, a[3])")
    ptx = nvrtc.compile_to_ptx(rn, "k", "compute_90a")
    assert not fusable_pairs(ptx) and not contracted(ptx, nvrtc.compile_to_ptx(rn, "k", "compute_90a", ["--fmad=false"]))
    two = 'extern "C" __global__ void k(float* a) { a[4] = a[0] * a[1] - a[2] * a[3]; }'
    ptx = nvrtc.compile_to_ptx(two, "k", "compute_90a")
    assert fusable_pairs(ptx) or contracted(ptx, nvrtc.compile_to_ptx(two, "k", "compute_90a", ["--fmad=false"]))
