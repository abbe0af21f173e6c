"""Regenerate the golden logits of the real models: tests/golden/smollm2_logits.npz (SmolLM2-135M-Instruct
Q4_1) and tests/golden/gemma3_logits.npz (Gemma 3 270M Q4_K_M), from transformers.

Loads the GGUF with ``transformers.AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)`` in
float32 (transformers dequantises, undoes llama.cpp's q/k permutation and, for Gemma, the +1 its
converter adds to the norm weights), runs a fixed text and stores: the token ids, the top-64 logits
and their ids per position, and, within 1 MB, full logit rows at a few positions (SmolLM2's 49k
vocabulary) or every position's logits at every 128th vocabulary id (Gemma's 262k), float32, plus
the versions used.

Needs torch + transformers (test-only dependencies). Usage:
    python tools/make_golden.py [--preset smollm2|gemma3] [--model PATH.gguf] [--out FILE.npz]
Must not import CUDA or any engine module except engine.default_model (to find the files).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "tests" / "golden" / "smollm2_logits.npz"
# A fixed ChatML conversation (SmolLM2-Instruct's template, its default system prompt).
PROMPT = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "<|im_start|>user\nWhat is the capital of France? Answer in one sentence.<|im_end|>\n"
    "<|im_start|>assistant\n"
)
TOP = 64
FULL_ROWS = (0, 10, -1)  # positions whose whole logit row is stored
# Gemma 3 270M (a base model): plain text after BOS, cut to 64 tokens.
GEMMA_TEXT = (
    "The capital of France is Paris. The Eiffel Tower, built in 1889 for the World's Fair, stands on the "
    "Champ de Mars and remains one of the most visited monuments in the world. Every evening its lights "
    "sparkle for five minutes at the top of each hour, and visitors climb its stairs to see the Seine."
)
GEMMA_TOKENS = 64
GEMMA_COL_STRIDE = 128  # every 128th vocabulary id at every position: 64 x 2048 float32 = 512 KB
GEMMA_OUT = REPO / "tests" / "golden" / "gemma3_logits.npz"
# Greedy continuations (after BOS) stored too. The base 270M model continues the first with " the
# capital of the country of France" (" Paris" ranks third); the second it answers with Paris.
GEMMA_GREEDY_PROMPTS = ("The capital of France is", "Q: What is the capital of France?\nA:")
GEMMA_GREEDY_TOKENS = 16


def golden_from_transformers(model_path: Path, preset: str = "smollm2") -> dict[str, np.ndarray]:
    import torch
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(model_path.parent), gguf_file=model_path.name)
    if preset == "gemma3":
        ids = tok(GEMMA_TEXT, add_special_tokens=True)["input_ids"][:GEMMA_TOKENS]  # BOS first
        if len(ids) != GEMMA_TOKENS:
            raise SystemExit(f"the Gemma text has only {len(ids)} tokens, {GEMMA_TOKENS} needed")
    else:
        ids = tok(PROMPT, add_special_tokens=False)["input_ids"]
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(model_path.parent), gguf_file=model_path.name, dtype=torch.float32
    )
    model.eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids]), use_cache=False).logits[0].float().numpy()
    top_ids = np.argsort(-logits, axis=1, kind="stable")[:, :TOP]
    out = {
        "token_ids": np.asarray(ids, dtype=np.int64),
        "top_ids": top_ids.astype(np.int32),
        "top_logits": np.take_along_axis(logits, top_ids, axis=1).astype(np.float32),
        "versions": np.array(f"torch {torch.__version__}; transformers {transformers.__version__}"),
        "model_file": np.array(model_path.name),
    }
    if preset == "gemma3":
        cols = np.arange(0, logits.shape[1], GEMMA_COL_STRIDE, dtype=np.int64)
        out["columns"] = cols
        out["column_logits"] = logits[:, cols].astype(np.float32)
        out["text"] = np.array(GEMMA_TEXT)
        greedy = []
        for prompt in GEMMA_GREEDY_PROMPTS:
            p_ids = tok(prompt, add_special_tokens=True)["input_ids"]
            with torch.no_grad():
                gen = model.generate(
                    torch.tensor([p_ids]), max_new_tokens=GEMMA_GREEDY_TOKENS, do_sample=False, min_new_tokens=GEMMA_GREEDY_TOKENS
                )
            greedy.append(gen[0, len(p_ids) :].numpy())
        out["greedy_prompts"] = np.array(GEMMA_GREEDY_PROMPTS)
        out["greedy_ids"] = np.stack(greedy).astype(np.int64)
    else:
        rows = np.array([p % len(ids) for p in FULL_ROWS], dtype=np.int64)
        out["full_positions"] = rows
        out["full_logits"] = logits[rows].astype(np.float32)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=("smollm2", "gemma3"), default="smollm2")
    ap.add_argument("--model", type=Path, help="the preset's GGUF (default: engine.default_model fetches it)")
    ap.add_argument("--out", type=Path, default=None, help="default: tests/golden/<preset>_logits.npz")
    args = ap.parse_args(argv)
    model = args.model
    if model is None:
        from engine.default_model import default_model_path, known_model_path

        model = known_model_path("gemma3-270m") if args.preset == "gemma3" else default_model_path()
    out = args.out or (GEMMA_OUT if args.preset == "gemma3" else DEFAULT_OUT)
    data = golden_from_transformers(model.resolve(), args.preset)
    out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(out, **data)
    print(f"wrote {out} ({out.stat().st_size} bytes, {len(data['token_ids'])} positions, {data['versions']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
