"""Pin every plan that builds today: family x size x quant combo x device profile.

    python tools/plan_golden.py --check            # every combo against tests/golden/plans.json
    python tools/plan_golden.py --write            # regenerate the golden (after a reviewed change)
    python tools/plan_golden.py --dump DIR [--only qwen3/qwen3-4b/q4_k_m/h200]
                                                   # each combo's full text, to diff two checkouts

A plan's text (``dump``) lists its weights, buffers, values, scratch and, for every step, mode and
launch: the kernel's template, entry point, the sha256 of its rendered CUDA code (comments left
out: ``code_of``), options, the
launch's grid (expressions as written), block, shared memory, row bounds, flags and its symbolic
arguments; then the sampling launches. The golden file keeps one sha256 per combo (sources are
hashed, never stored), so a refactor that changes no kernel and no launch leaves it byte-identical.
A combo whose plan raises a ConfigError pins the error text instead. ``tests/test_plan_golden.py``
checks a representative subset (``CI_COMBOS``) in CI; this tool checks them all. The file types are
the ones tools/make_checkpoint.py writes: a mix (q4_k_m, q5_k_m) with its q6_k layers
(tests/fixtures/checkpoints.mix_tensor_type), and GGUF rope style for the quantised combos.
Must not import CUDA.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from fixtures.checkpoints import MIXES, mix_tensor_type  # noqa: E402

from engine.graph import load_family  # noqa: E402
from engine.model import dims_for_size  # noqa: E402
from engine.plan import build_plan  # noqa: E402
from engine.profile import all_profiles  # noqa: E402
from engine.render import render  # noqa: E402
from engine.types import ConfigError  # noqa: E402

GOLDEN = ROOT / "tests" / "golden" / "plans.json"
# the families the CUDA runner plans (qwen3_moe: the MoE lowering, engine.lowering.moe; its digests
# were first written from main before the issue #33 redesign merge, so the merge is checked against them)
FAMILIES = ("llama", "qwen3", "qwen3_moe")
FLOAT_FILES = ("bf16", "f16", "f32")  # safetensors checkpoints: HF rope style, nominal types

# the subset tests/test_plan_golden.py checks (each profile family of tuning and every storage
# layout: the h200 coop/q8x/pair paths, the h100 base, sm_80 / sm_120 defaults)
CI_COMBOS = (
    "qwen3/qwen3-4b/bf16/h200",
    "qwen3/qwen3-4b/q8_0/h200",
    "qwen3/qwen3-4b/q4_k_m/h200",
    "qwen3/qwen3-4b/q4_k_m/h100",
    "qwen3/qwen3-0.6b/q6_k/h200",
    "llama/smollm2-135m/q4_1/h200",
    "llama/smollm2-135m/q4_0/generic-sm90",
    "llama/smollm2-135m/bf16/generic-sm80",
    "llama/smollm2-135m/q8_0/rtx-5090",
    "qwen3/qwen3-0.6b/q5_k_m/rtx-pro-6000",
    "qwen3_moe/qwen3-30b-a3b/q4_k_m/h200",
)


def combos() -> list[str]:
    out = []
    profiles = sorted(all_profiles())
    for family in FAMILIES:
        graph = load_family(family)
        for size in graph.sizes:
            for quant in graph.quants:
                out += [f"{family}/{size}/{quant}/{p}" for p in profiles]
    return out


def _mixed_dtypes(quant: str, layers: int) -> dict[str, str]:
    if quant not in MIXES:
        return {}
    keys = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "exp_down")
    out = {k: mix_tensor_type(quant, k, 1) for k in keys}
    out.update({k: mix_tensor_type(quant, k, -1) for k in ("embed", "lm_head")})
    for layer in range(layers):
        for k in ("wv", "w_down", "exp_down"):
            if (t := mix_tensor_type(quant, k, layer)) != out[k]:
                out[f"{k}@{layer}"] = t
    return out


def plan_of(combo: str):
    family, size, quant, profile = combo.split("/")
    graph = load_family(family)
    dims = dims_for_size(family, size)
    style = graph.rope_style["hf" if quant in FLOAT_FILES else "gguf"]
    return build_plan(
        graph,
        dims,
        graph.quant(quant),
        all_profiles()[profile],
        tensor_dtypes=_mixed_dtypes(quant, dims["layers"]),
        rope_style=style,
    )


_SOURCE_SHA: dict = {}


_COMMENT = re.compile(r"(^|\s)//.*$", re.M)


def code_of(source: str) -> str:
    """CUDA source without its ``//`` comments, trailing blanks and blank lines: what NVRTC
    compiles. Template prose may change; the code may not."""
    lines = (line.rstrip() for line in _COMMENT.sub(r"\1", source).splitlines())
    return "\n".join(line for line in lines if line)


def _source_sha(spec) -> str:
    if spec not in _SOURCE_SHA:
        _SOURCE_SHA[spec] = hashlib.sha256(code_of(render(spec)).encode()).hexdigest()[:20]
    return _SOURCE_SHA[spec]


def _arg(a) -> str:
    return f"{a.kind}:{a.ref!r}:{a.ctype}:{a.layer}:{a.row}"


def _launch(la) -> str:
    s = la.spec
    grid = ",".join(str(g) for g in la.grid)
    flags = f"rows={la.min_rows}..{la.max_rows} fit={int(la.fit_grid)} conc={int(la.concurrent)}"
    return (
        f"    {s.template} {s.entry} src={_source_sha(s)} opts={list(s.options)} grid=({grid}) "
        f"block={la.block} smem={la.smem} {flags} args=[{' '.join(_arg(a) for a in la.args)}]"
    )


def dump(plan) -> str:
    """The plan as text: everything the runner uses, kernel sources as hashes."""
    lines = [
        f"plan {plan.family} {plan.quant} {plan.profile} rope={plan.rope_style} max_tokens={plan.max_tokens} "
        f"block={plan.block_size} short={plan.short_context} wide={plan.wide_rows} buckets={plan.graph_batch_sizes}"
        + (f" b1_rows={plan.b1_rows}" if plan.b1_rows else ""),
        f"dims {json.dumps(plan.dims, sort_keys=True, default=str)}",
    ]
    for w in plan.weights:
        lines.append(f"weight {w.key} L{w.layer} {w.dtype} [{w.rows},{w.cols}] parts={w.parts} {w.part_rows}")
    for b in plan.buffers:
        lines.append(f"buffer {b.name} {b.dtype} x{b.width} rows={b.rows}")
    for v in plan.values.values():
        lines.append(f"value {v.name} {v.buffer}+{v.offset} w={v.width} ld={v.ld} {v.dtype}")
    for sp in plan.scratch:
        lines.append(f"scratch {sp.name} fixed={sp.fixed} per_split={sp.per_split}/{sp.split} fill={sp.fill}")
    for st in plan.steps:
        lines.append(f"step L{st.layer} head={int(st.head)} {st.op.op} {st.op.inputs}->{st.op.outputs}")
        for mode in sorted(st.launches):
            lines.append(f"  {mode}:")
            lines += [_launch(la) for la in st.launches[mode]]
    for kind in sorted(plan.sampling):
        lines.append(f"sampling {kind}:")
        lines += [_launch(la) for la in plan.sampling[kind]]
    return "\n".join(lines) + "\n"


def text_of(combo: str) -> str:
    try:
        return dump(plan_of(combo))
    except ConfigError as exc:
        return f"error {exc}\n"


def digest(combo: str) -> str:
    return hashlib.sha256(text_of(combo).encode()).hexdigest()


def load_golden() -> dict[str, str]:
    return json.loads(GOLDEN.read_text())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="compare every combo with the golden file")
    ap.add_argument("--write", action="store_true", help="rewrite the golden file")
    ap.add_argument("--dump", metavar="DIR", help="write each combo's text to DIR/<combo>.txt")
    ap.add_argument("--only", action="append", default=[], help="a combo (family/size/quant/profile)")
    args = ap.parse_args(argv)
    todo = args.only or combos()
    if args.dump:
        for c in todo:
            path = Path(args.dump) / (c.replace("/", "__") + ".txt")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text_of(c))
        print(f"{len(todo)} plans written to {args.dump}")
    if args.write:
        GOLDEN.write_text(json.dumps({c: digest(c) for c in todo}, indent=1, sort_keys=True) + "\n")
        print(f"{len(todo)} digests written to {GOLDEN}")
    if args.check:
        golden = load_golden()
        bad = [c for c in todo if golden.get(c) != digest(c)]
        missing = sorted(set(golden) - set(todo)) if not args.only else []
        for c in bad:
            print(f"DIFFERS {c}")
        for c in missing:
            print(f"GONE {c}")
        print(f"{len(todo) - len(bad)} of {len(todo)} plans match")
        return 1 if bad or missing else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
