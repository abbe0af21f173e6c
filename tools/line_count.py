"""engine/ line counts, split into the scope issue #33 measured and the modules later features added.

    python tools/line_count.py            # the totals, per feature, and the largest modules
    python tools/line_count.py --modules  # every module with its scope
    python tools/line_count.py --since 6872ba0  # growth of the modules that existed at a commit

Issue #33 (the redesign) measured engine/ at 14,831 lines and asked for at least 25 % fewer
(<= 11,123) with no module over 600. Since then other issues added whole modules for new
features. ``LATER`` names each of them with its feature, decided by the module's purpose (and the
commit that added it); every other module of engine/ is the pre-redesign scope, including the
modules the redesign split out of older ones (engine.ir, engine.lowering, engine.kernel_catalog,
engine.tuning, engine.storage, engine.runner_steps ...). Lines that later features added inside
older modules (loop, server resources, runner) count as pre-redesign scope: this tool does not
split a file; ``--since REV`` shows that growth, module by module, for the modules that existed at
REV (``BASELINE_COMMIT``: main when the issue was filed, engine/ 14,861 lines by this count). Lines
are newline characters, as ``wc -l`` counts them. Imports nothing of engine.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ENGINE = ROOT / "engine"
BASELINE = 14_831  # engine/ when issue #33 was filed
BASELINE_COMMIT = "6872ba0"  # main then (its engine/ is 14,861 lines by lines_of)
TARGET = BASELINE * 3 // 4  # at least 25 % fewer
MAX_MODULE = 600

# module (path under engine/) -> the later feature it exists for
LATER: dict[str, str] = {
    # mixture-of-experts (qwen3_moe)
    "lowering/moe.py": "MoE",
    "moe_kernels.py": "MoE",
    "ops/moe.py": "MoE",
    "ops_ref_moe.py": "MoE",
    "weights/stacked.py": "MoE",
    "weight_memory.py": "MoE",
    # the DSL's growth for the new families (extends:, when-predicates, list dims, config forms)
    "graph_extends.py": "model families (DSL)",
    "dsl_expr.py": "model families (DSL)",
    "hf_config.py": "model families (DSL)",
    # Gated DeltaNet hybrids
    "ops/linear_attention.py": "hybrids",
    "ops_ref_linear.py": "hybrids",
    "linear_attn_kernels.py": "hybrids",
    "lowering/linear_attention.py": "hybrids",
    "runner_state.py": "hybrids",
    # Gemma
    "ops/gemma.py": "Gemma",
    "tokenizer_spm.py": "Gemma",
    "lowering/gemma.py": "Gemma",
    "kv_groups.py": "Gemma",  # sliding-window KV release
    "runner_kv.py": "Gemma",  # the window KV pool
    # speculative decoding
    "spec/__init__.py": "speculative decoding",
    "spec/accept.py": "speculative decoding",
    "spec/build.py": "speculative decoding",
    "spec/config.py": "speculative decoding",
    "spec/cuda_verify.py": "speculative decoding",
    "spec/draft.py": "speculative decoding",
    "spec/policy.py": "speculative decoding",
    "spec/proposer.py": "speculative decoding",
    "spec/speculator.py": "speculative decoding",
    # several GPUs
    "placement.py": "multi-GPU",
    "sharded_reference.py": "multi-GPU",
    "nccl.py": "multi-GPU",
    # the sampling API (logprobs, n > 1, logit_bias, structured output, reasoning)
    "grammar.py": "sampling API",
    "gen_defaults.py": "sampling API",
    "server/logprobs.py": "sampling API",
    "server/reasoning.py": "sampling API",
    "server/sampling_api.py": "sampling API",
    "logit_prep.py": "sampling API",  # the device token mask / logit bias / logprobs inputs
    # server hardening
    "server/admission.py": "server hardening",
    "server/tokenize_pool.py": "server hardening",
    "server/waitress_guard.py": "server hardening",
    # web chat page
    "server/ui.py": "web chat",
    # warm prefix (prefix keys and tokenising in O(new tokens))
    "prefix_keys.py": "warm prefix",
    "token_cache.py": "warm prefix",
    # memory footprint and weight upload
    "memstat.py": "footprint / load",
    "upload.py": "footprint / load",
    # CLI progress bars
    "progress.py": "CLI polish",
}


def lines_of(path: Path) -> int:
    return path.read_bytes().count(b"\n")


def modules() -> dict[str, int]:
    """Every .py module of engine/ (path under engine/) -> its lines."""
    return {p.relative_to(ENGINE).as_posix(): lines_of(p) for p in sorted(ENGINE.rglob("*.py"))}


def report(show_modules: bool = False) -> tuple[str, bool]:
    """The report text, and whether it meets the targets (pre-redesign scope <= TARGET, no module
    over MAX_MODULE, every LATER entry an existing module)."""
    mods = modules()
    missing = sorted(set(LATER) - set(mods))
    total = sum(mods.values())
    later = {m: n for m, n in mods.items() if m in LATER}
    scope = total - sum(later.values())
    features: dict[str, int] = {}
    for m, n in later.items():
        features[LATER[m]] = features.get(LATER[m], 0) + n
    big = sorted(((n, m) for m, n in mods.items() if n > MAX_MODULE), reverse=True)
    out = [
        f"engine/: {total} lines in {len(mods)} modules",
        f"pre-redesign scope: {scope} lines ({len(mods) - len(later)} modules); issue #33 target <= {TARGET} "
        f"(25 % under {BASELINE}): {'met' if scope <= TARGET else f'{scope - TARGET} over'}"
        f" ({100 * (BASELINE - scope) / BASELINE:.1f} % under)",
        f"later features: {sum(later.values())} lines ({len(later)} modules)",
    ]
    out += [f"  {name:24s} {n:6d}" for name, n in sorted(features.items(), key=lambda kv: -kv[1])]
    out.append(f"modules over {MAX_MODULE} lines: " + (", ".join(f"{m} ({n})" for n, m in big) or "none"))
    if missing:
        out.append(f"LATER names modules that do not exist: {', '.join(missing)}")
    if show_modules:
        out += [f"  {n:5d} {m:40s} {LATER.get(m, 'pre-redesign scope')}" for m, n in sorted(mods.items())]
    else:
        top = sorted(((n, m) for m, n in mods.items() if m not in LATER), reverse=True)[:10]
        out.append("largest pre-redesign-scope modules: " + ", ".join(f"{m} ({n})" for n, m in top))
    return "\n".join(out), scope <= TARGET and not big and not missing


def since(rev: str) -> str:
    """The modules of engine/ at git revision ``rev`` that still exist: lines then and now, the
    largest growth first (a module the redesign split or renamed shows as gone)."""
    git = ["git", "-C", str(ROOT)]
    names = subprocess.run(
        [*git, "ls-tree", "-r", "--name-only", rev, "engine"], capture_output=True, text=True, check=True
    ).stdout.split()
    mods = modules()
    rows, gone = [], []
    for name in (n for n in names if n.endswith(".py")):
        then = subprocess.run([*git, "show", f"{rev}:{name}"], capture_output=True, check=True).stdout.count(b"\n")
        key = name.removeprefix("engine/")
        if key in mods:
            rows.append((mods[key] - then, key, then, mods[key]))
        else:
            gone.append(f"{key} ({then})")
    out = [f"modules of engine/ at {rev} that still exist: {sum(r[2] for r in rows)} -> {sum(r[3] for r in rows)} lines"]
    out += [f"  {d:+6d} {m:40s} {a:5d} -> {b:5d}" for d, m, a, b in sorted(rows, reverse=True)]
    out.append("gone (split or renamed): " + (", ".join(gone) or "none"))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modules", action="store_true", help="list every module with its scope")
    ap.add_argument("--check", action="store_true", help="exit 1 unless the targets are met")
    ap.add_argument("--since", metavar="REV", nargs="?", const=BASELINE_COMMIT,
                    help=f"growth of the modules that existed at git revision REV (default {BASELINE_COMMIT})")
    args = ap.parse_args(argv)
    text, ok = report(args.modules)
    print(text)
    if args.since:
        print(since(args.since))
    return 0 if ok or not args.check else 1


if __name__ == "__main__":
    sys.exit(main())
