"""Micro-benchmarks of the bandwidth/FLOP-bound kernels at real model shapes (GPU machine only).

``PYTHONPATH=. python tools/bench_kernels.py [--out DIR]`` runs the full-size timing part of
tools/gpu_kernels_check.py (GEMV per storage type at llama3-8b / qwen3 lm_head shapes in GB/s
against the profile roofline, paged decode attention in GB/s of KV bytes, GEMM in TFLOP/s against
torch.matmul); each check still verifies its small cases first. Must not import gguf.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_kernels_check  # noqa: E402

if __name__ == "__main__":
    sys.argv = [sys.argv[0], "--only", "gemv,attention,gemm,sampling", *sys.argv[1:]]
    sys.exit(gpu_kernels_check.main())
