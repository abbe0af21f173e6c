"""Issue #4's decode / prefill targets against measured results: a markdown table, each row met,
missed or not measured, with the card each figure came from.

    python tools/targets_table.py --result qwen3-4b-q4_k_m=$RES/q4_k_m.json \
        --result qwen3-4b-q8_0=$RES/q8_0.json --result qwen3-4b-bf16=$RES/bf16.json \
        --result qwen3-0.6b-bf16=$RES/profile/decode_profile.json#qwen3-0.6b \
        --result smollm2-135m-q4_1=$RES/profile/decode_profile.json#smol_q4_1.gguf

A result is a `memra bench --json` file (its rows; decode fractions against the measured copy, as the
issue defines the roofline) or a `tools/gpu_decode_profile.py` decode_profile.json with ``#ENTRY``
naming the checkpoint (its "default" variant: wall-clock b1 through the runner). The issue's targets
are H200 figures: a row measured on another card says so and is never "met". Runs anywhere (no
GPU, no CUDA import); must not be imported by the engine.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

TARGET_CARD = "H200"


@dataclass(frozen=True)
class Target:
    model: str  # the --result key
    measure: str
    goal: float
    unit: str  # "%" (a fraction shown in percent) or "tok/s" or "x"
    value: Callable[[dict], float | None]  # from the loaded result; None where it lacks the figure


def _bench_row(result: dict, kind: str, **match) -> dict | None:
    for row in result.get("rows", []):
        if row.get("kind") == kind and all(row.get(k) == v for k, v in match.items()):
            return row
    return None


def _field(kind: str, name: str, **match) -> Callable[[dict], float | None]:
    """A row's ``name`` (the first row of that kind matching ``match``)."""

    def get(result: dict) -> float | None:
        row = _bench_row(result, kind, **match)
        return None if row is None else row.get(name)

    return get


_B1_COPY = _field("decode", "copy_roofline_fraction", batch=1, depth=0)
_B1_TOK_S = _field("decode", "tok_s", batch=1, depth=0)
_B32_TOK_S = _field("decode", "tok_s", batch=32, depth=0)


def _b32_over_b1(result: dict) -> float | None:
    b1, b32 = _B1_TOK_S(result), _B32_TOK_S(result)
    return None if b1 is None or b32 is None else b32 / b1

TARGETS = [
    Target("qwen3-4b-bf16", "decode b1, of the measured copy", 0.75, "%", _B1_COPY),
    Target("qwen3-4b-q8_0", "decode b1, of the measured copy", 0.60, "%", _B1_COPY),
    Target("qwen3-4b-q4_k_m", "decode b1, of the measured copy", 0.50, "%", _B1_COPY),
    Target("qwen3-0.6b-bf16", "decode b1", 1500.0, "tok/s", _B1_TOK_S),
    Target("smollm2-135m-q4_1", "decode b1", 2000.0, "tok/s", _B1_TOK_S),
    Target("qwen3-4b-bf16", "prefill 512", 32000.0, "tok/s", _field("prefill", "tok_s", tokens=512)),
    Target("qwen3-4b-bf16", "prefill 4096, of tensor-core peak", 0.40, "%", _field("prefill", "roofline_fraction", tokens=4096)),
    Target("qwen3-4b-bf16", "decode b32 aggregate over b1", 10.0, "x", _b32_over_b1),
]


def load_result(spec: str) -> tuple[str, dict]:
    """``KEY=PATH`` or ``KEY=PATH#ENTRY`` -> (KEY, the result as `memra bench` writes it: a
    decode_profile.json entry becomes its batch-1 decode row and its card)."""
    key, sep, where = spec.partition("=")
    if not sep or not key or not where:
        raise SystemExit(f"--result {spec!r}: expected KEY=PATH or KEY=PATH#ENTRY")
    path, _, entry = where.partition("#")
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise SystemExit(f"--result {key}: {path}: {exc}") from exc
    if entry:
        variants = data.get(entry)
        if not isinstance(variants, dict) or "default" not in variants:
            raise SystemExit(f"--result {key}: {path} has no entry {entry!r} (has: {', '.join(data)})")
        default = variants["default"]
        b1 = default.get("b1")
        rows = [{"kind": "decode", "batch": 1, "depth": 0, "tok_s": b1["tok_s"]}] if b1 else []
        return key, {"rows": rows, "device": default.get("device", {})}
    if "rows" not in data:
        raise SystemExit(f"--result {key}: {path} is not a `memra bench --json` file (no rows)")
    return key, data


def render(results: dict[str, dict], targets: list[Target] = TARGETS) -> tuple[str, int]:
    """The markdown table and how many targets are missed or not measured on the target card."""
    lines = [
        "| model | measure | measured | target | card | verdict |",
        "|---|---|---:|---:|---|---|",
    ]
    open_count = 0
    for t in targets:
        result = results.get(t.model)
        value = None if result is None else t.value(result)
        card = ((result or {}).get("device") or {}).get("name") or "unknown card"
        if value is None:
            shown, verdict, card = "-", "not measured", "-"
        else:
            shown = _fmt(value, t.unit)
            if TARGET_CARD not in card:
                verdict = f"{'at or above' if value >= t.goal else 'below'} the goal, not on an {TARGET_CARD}"
            else:
                verdict = "met" if value >= t.goal else "missed"
        open_count += verdict != "met"
        lines.append(f"| {t.model} | {t.measure} | {shown} | >= {_fmt(t.goal, t.unit)} | {card} | {verdict} |")
    return "\n".join(lines), open_count


def _fmt(value: float, unit: str) -> str:
    if unit == "%":
        return f"{100 * value:.1f} %"
    if unit == "x":
        return f"{value:.1f}x"
    return f"{value:,.1f} tok/s"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--result", action="append", default=[], metavar="KEY=PATH[#ENTRY]")
    args = ap.parse_args(argv)
    keys = {t.model for t in TARGETS}
    results = {}
    for spec in args.result:
        key, result = load_result(spec)
        if key not in keys:
            raise SystemExit(f"--result {key}: unknown model key (one of: {', '.join(sorted(keys))})")
        results[key] = result
    text, open_count = render(results)
    print(text)
    print(f"\n{len(TARGETS) - open_count} of {len(TARGETS)} targets met on an {TARGET_CARD}")
    return 0 if open_count == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
