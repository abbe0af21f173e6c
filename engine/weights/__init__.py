"""Open model weights (HF safetensors directory or single/split GGUF) as a name-based WeightSource.

Must not import CUDA, the model graph or the tokenizer.
"""

from __future__ import annotations

import os
from pathlib import Path

from engine.types import MemraError
from engine.weights.gguf_reader import GGUFSource, split_files
from engine.weights.safetensors_reader import SafetensorsSource
from engine.weights.source import WeightSource
from engine.weights.stacked import StackedSource  # noqa: F401  (engine.weights.StackedSource)


def open_weights(path: str | os.PathLike[str]) -> WeightSource:
    """Open ``path``: a directory with config.json + safetensors, or a ``.gguf`` file (any shard of a split).

    Raises MemraError (ConfigError for bad JSON) naming the file and the problem.
    """
    p = Path(path).expanduser()
    if not p.exists():
        raise MemraError(f"{p}: no such file or directory", code="invalid_model")
    if p.is_dir():
        ggufs = sorted(p.glob("*.gguf"))
        if not (p / "config.json").exists() and ggufs:
            if len(split_files(ggufs[0])) == len(ggufs) or len(ggufs) == 1:
                return GGUFSource(ggufs[0])
            raise MemraError(f"{p}: several GGUF files; pass one of them: {', '.join(g.name for g in ggufs)}")
        return SafetensorsSource(p)
    if p.suffix == ".gguf":
        return GGUFSource(p)
    if p.suffix == ".safetensors" or p.name == "config.json":
        return SafetensorsSource(p.parent)
    raise MemraError(
        f"{p}: not a model: expected a directory with config.json + *.safetensors, or a .gguf file"
    )
