"""Regenerate tests/golden/smollm2_logits.npz: SmolLM2-135M-Instruct Q4_1 logits from transformers.

Loads the GGUF with ``transformers.AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)`` in
float32 (transformers dequantises and undoes llama.cpp's q/k permutation), runs a fixed ChatML
prompt and stores: the token ids, the top-64 logits and their ids per position, and full logit
rows at a few positions (float32), plus the versions used. The file stays well under 1 MB.

Needs torch + transformers (test-only dependencies). Usage:
    python tools/make_golden.py [--model PATH.gguf] [--out tests/golden/smollm2_logits.npz]
Must not import CUDA or any engine module except engine.default_model (to find the file).
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


def golden_from_transformers(model_path: Path) -> dict[str, np.ndarray]:
    import torch
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(model_path.parent), gguf_file=model_path.name)
    ids = tok(PROMPT, add_special_tokens=False)["input_ids"]
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(model_path.parent), gguf_file=model_path.name, dtype=torch.float32
    )
    model.eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids]), use_cache=False).logits[0].float().numpy()
    top_ids = np.argsort(-logits, axis=1, kind="stable")[:, :TOP]
    rows = np.array([p % len(ids) for p in FULL_ROWS], dtype=np.int64)
    return {
        "token_ids": np.asarray(ids, dtype=np.int64),
        "top_ids": top_ids.astype(np.int32),
        "top_logits": np.take_along_axis(logits, top_ids, axis=1).astype(np.float32),
        "full_positions": rows,
        "full_logits": logits[rows].astype(np.float32),
        "versions": np.array(f"torch {torch.__version__}; transformers {transformers.__version__}"),
        "model_file": np.array(model_path.name),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, help="SmolLM2 GGUF (default: engine.default_model)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args(argv)
    model = args.model
    if model is None:
        from engine.default_model import default_model_path

        model = default_model_path()
    data = golden_from_transformers(model.resolve())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(args.out, **data)
    print(
        f"wrote {args.out} ({args.out.stat().st_size} bytes, {len(data['token_ids'])} positions, {data['versions']})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
