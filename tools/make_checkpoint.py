"""Write a full-size random-weight HF checkpoint (real shapes, bf16) for GPU tests and benchmarks.

Usage: python tools/make_checkpoint.py --shape qwen3-0.6b --out DIR [--dtype bf16] [--seed 0] [--layers N]
       python tools/make_checkpoint.py --shape qwen3-4b --gguf q4_k_m --out FILE.gguf   (random blocks)
       python tools/make_checkpoint.py --shape qwen3.5-4b --out DIR   (the Qwen3.5 hybrid, safetensors)
       python tools/make_checkpoint.py --shape qwen3.5-4b --gguf q4_k_m --out FILE.gguf   (hybrid, random blocks)
       python tools/make_checkpoint.py --shape qwen3.6-35b-a3b --gguf q4_k_m --out FILE.gguf (MoE hybrid: 256 experts)
       python tools/make_checkpoint.py --shape qwen3-30b-a3b --gguf q4_k_m --out FILE.gguf (MoE: 128 experts)

Same writer as the test fixtures (tests/fixtures/checkpoints.py): linear/embedding ~ N(0, 0.02),
norms ~ 1 + N(0, 0.05), streamed tensor by tensor in 2048-row chunks so memory stays bounded.
The tokenizer (``--tokenizer``) is by default a word-level one covering the whole vocabulary, so every
sampled id decodes to text (HTTP streaming benchmarks see one chunk per token); ``tiny`` writes the
fixtures' 384-token BPE instead. Must not import torch or CUDA.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from fixtures.checkpoints import (  # noqa: E402
    Dims,
    hf_config,
    hf_tensor_specs,
    write_random_gguf,
    write_safetensors,
    write_tokenizer_files,
)

SHAPES: dict[str, tuple[str, Dims]] = {
    "smollm2-135m": ("llama", Dims(576, 30, 9, 3, 64, 1536, 49152, 100000.0, 1e-5, 8192, True)),
    "llama3-8b": ("llama", Dims(4096, 32, 32, 8, 128, 14336, 128256, 500000.0, 1e-5, 8192, False)),
    "qwen3-0.6b": ("qwen3", Dims(1024, 28, 16, 8, 128, 3072, 151936, 1000000.0, 1e-6, 40960, True)),
    "qwen3-4b": ("qwen3", Dims(2560, 36, 32, 8, 128, 9728, 151936, 1000000.0, 1e-6, 40960, True)),
    "qwen3-8b": ("qwen3", Dims(4096, 36, 32, 8, 128, 12288, 151936, 1000000.0, 1e-6, 40960, False)),
    # MoE: per-expert safetensors (as published); GGUF experts stacked in ffn_{gate,up,down}_exps
    "qwen3-30b-a3b": (
        "qwen3_moe",
        Dims(2048, 48, 32, 4, 128, 6144, 151936, 1000000.0, 1e-6, 40960, False, 128, 8, 768, True),
    ),
}
# hybrid (Gated DeltaNet + gated attention) shapes: Qwen3_5ForCausalLM config overrides
# (tests/fixtures/hybrid.py writes them: safetensors for the dense one, random-block GGUF for both;
# the MoE shape also carries its expert keys, fixtures.hybrid.MOE's names)
HYBRID_SHAPES: dict[str, tuple[str, dict]] = {
    "qwen3.5-4b": (
        "qwen3_5",
        dict(
            vocab_size=248320, hidden_size=2560, intermediate_size=9216, num_hidden_layers=32,
            num_attention_heads=16, num_key_value_heads=4, head_dim=256, linear_conv_kernel_dim=4,
            linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
            linear_num_value_heads=32, max_position_embeddings=262144, full_attention_interval=4,
            rope_theta=10000000.0, partial_rotary_factor=0.25, tie_word_embeddings=True,
        ),
    ),
    "qwen3.6-35b-a3b": (
        "qwen3_5_moe",
        dict(
            vocab_size=248320, hidden_size=2048, intermediate_size=0, num_hidden_layers=40,
            num_attention_heads=16, num_key_value_heads=2, head_dim=256, linear_conv_kernel_dim=4,
            linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
            linear_num_value_heads=32, max_position_embeddings=262144, full_attention_interval=4,
            rope_theta=10000000.0, partial_rotary_factor=0.25, tie_word_embeddings=False,
            num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512, shared_expert_intermediate_size=512,
        ),
    ),
}
MOE_KEYS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size")


def write_hybrid(name: str, out: Path, seed: int, layers: int, tokenizer: str) -> None:
    """A full-size random Qwen3.5-class HF checkpoint (bf16, streamed like the dense shapes)."""
    from fixtures.checkpoints import write_safetensors
    from fixtures.hybrid import qwen3_5_config, qwen3_5_tensor_specs

    over = dict(HYBRID_SHAPES[name][1])
    if layers:
        over["num_hidden_layers"] = layers
    cfg = qwen3_5_config(**over)
    cfg["dtype"] = "bfloat16"
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    (out / "config.json").write_text(json.dumps(cfg, indent=2), encoding="utf-8")
    write_tokenizer_files(out, words_vocab=cfg["vocab_size"] if tokenizer == "words" else 0)
    specs = qwen3_5_tensor_specs(cfg, seed)
    write_safetensors(out / "model.safetensors", specs)
    n = sum(math.prod(s) for _, s, _ in specs)
    size = (out / "model.safetensors").stat().st_size
    print(f"{name}: {n / 1e9:.3f} B params, {size / 2**30:.2f} GiB in {time.perf_counter() - t0:.1f} s -> {out}")


def write_hybrid_gguf(name: str, out: Path, quant: str, seed: int, layers: int, tokenizer: str) -> None:
    """A full-size random-block hybrid GGUF (qwen35, or qwen35moe for a shape with experts)."""
    from fixtures.hybrid import write_random_hybrid_gguf

    over = dict(HYBRID_SHAPES[name][1])
    moe = {k: over.pop(k) for k in MOE_KEYS if k in over} or None
    if layers:
        over["num_hidden_layers"] = layers
    t0 = time.perf_counter()
    write_random_hybrid_gguf(out, quant=quant, seed=seed, moe=moe, words=tokenizer == "words", **over)
    size = out.stat().st_size
    print(f"{name} {quant}: {size / 2**30:.2f} GiB in {time.perf_counter() - t0:.1f} s -> {out}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", required=True, choices=sorted(SHAPES) + sorted(HYBRID_SHAPES))
    ap.add_argument("--dtype", default="bf16", choices=["bf16"])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", type=int, default=0, help="override the layer count (0 = the real one)")
    ap.add_argument("--tokenizer", default="words", choices=["words", "tiny"], help="words: one word per id")
    ap.add_argument("--gguf", default=None, metavar="QUANT", help="write OUT as a random-block GGUF of QUANT instead")
    args = ap.parse_args(argv)
    if args.shape in HYBRID_SHAPES:
        if args.gguf:
            write_hybrid_gguf(args.shape, args.out, args.gguf, args.seed, args.layers, args.tokenizer)
        elif HYBRID_SHAPES[args.shape][0] != "qwen3_5":
            ap.error(f"--shape {args.shape}: a MoE hybrid is written as GGUF only (add --gguf q4_k_m)")
        else:
            write_hybrid(args.shape, args.out, args.seed, args.layers, args.tokenizer)
        return 0
    family, dims = SHAPES[args.shape]
    if args.layers:
        from dataclasses import replace

        dims = replace(dims, num_hidden_layers=args.layers)
    if args.gguf:
        t0 = time.perf_counter()
        args.out.parent.mkdir(parents=True, exist_ok=True)
        write_random_gguf(args.out, family, dims, args.gguf, args.seed)
        size = args.out.stat().st_size
        print(f"{args.shape} {args.gguf}: {size / 2**30:.2f} GiB in {time.perf_counter() - t0:.1f} s -> {args.out}")
        return 0
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    (out / "config.json").write_text(json.dumps(hf_config(dims, family), indent=2), encoding="utf-8")
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": [2, 0]}))
    write_tokenizer_files(out, words_vocab=dims.vocab_size if args.tokenizer == "words" else 0)
    specs = hf_tensor_specs(dims, family, args.seed)
    write_safetensors(out / "model.safetensors", specs)
    n = sum(math.prod(s) for _, s, _ in specs)
    dt = time.perf_counter() - t0
    size = (out / "model.safetensors").stat().st_size
    print(f"{args.shape}: {n / 1e9:.3f} B params, {size / 2**30:.2f} GiB in {dt:.1f} s -> {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
