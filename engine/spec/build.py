"""Turn a SpecConfig into the engine's Speculator: the proposer (loading a draft model beside the
target, or the target's MTP head with a hidden-state tap on its runner, when asked) and the
per-step policy. Used by `memra run/serve/bench`.

Must not import CUDA directly (a draft on the cuda backend is built through engine.backend).
"""

from __future__ import annotations

import sys
from typing import Any

from engine.spec.config import SpecConfig
from engine.spec.proposer import MtpProposer, NgramProposer
from engine.spec.speculator import Speculator
from engine.types import ConfigError, MemraError

# KV blocks of a draft model on the GPU (the target sized its cache from free memory first)
DRAFT_CUDA_BLOCKS = 2048
_PROBE = "The quick brown fox, 12345 + 678 = ? Ünïcödé 汉字 <|im_start|>"


def _check_same_tokenizer(target: Any, draft: Any, path: str) -> None:
    tv, dv = int(target.dims["vocab"]), int(draft.dims["vocab"])
    if tv != dv:
        raise MemraError(
            f"--speculative draft:{path}: its vocabulary has {dv} tokens, the target's {tv}; a draft "
            "model needs the target's tokenizer",
            param="speculative",
        )
    from engine.tokenizer import load_tokenizer

    try:
        a, b = load_tokenizer(target.weights), load_tokenizer(draft.weights)
    except MemraError:
        return  # a model without a tokenizer (tests' bare checkpoints): the vocab size check stands
    if a.encode(_PROBE) != b.encode(_PROBE):
        raise MemraError(
            f"--speculative draft:{path}: its tokenizer splits text differently from the target's",
            param="speculative",
        )


def _mtp_proposer(model: Any, runner: Any) -> MtpProposer:
    """The MTP proposer over the target runner: its head beside the runner, and a hidden-state tap
    on the runner (one-line errors for a model without an MTP head or a backend without one). On
    the cuda backend the head is a second CudaRunner (engine.spec.mtp_cuda; the numpy head on the
    host, engine.spec.mtp_host, where its graph does not fit that split) and the target taps its
    final-normed hidden rows back from the device (engine.runner_tap)."""
    MtpProposer.check(model)
    if runner.backend not in ("reference", "cuda"):
        raise ConfigError(f"--speculative mtp: the {runner.backend} backend does not run MTP heads yet; use ngram or draft:PATH")
    from engine.spec.hidden_tap import HiddenTap
    from engine.spec.mtp_head import MtpHeadReference

    where = runner.backend
    head: Any
    if runner.backend == "cuda":
        from engine.spec.mtp_cuda import MtpHeadCuda
        from engine.spec.mtp_host import HeadWeights

        try:
            head = MtpHeadCuda(runner)
        except ConfigError as e:  # a head graph the split does not fit: the numpy head on the host
            print(f"memra: {e}; the MTP head runs on the host", file=sys.stderr)
            head = MtpHeadReference(HeadWeights(model, runner.block_size, runner.max_model_len))
            where = "the host (numpy), target on cuda"
    else:
        head = MtpHeadReference(runner)
    runner.hidden_tap = HiddenTap(model.graph.mtp.hidden_from)
    print(f"memra: speculative MTP head of {model.name} ({head.layers} layer) on {where}", file=sys.stderr)
    return MtpProposer(model, head, runner.hidden_tap)


def build_speculator(
    cfg: SpecConfig | None, model: Any, runner: Any, *, device_profile: str | None = None
) -> Speculator | None:
    """None without speculation; raises MemraError/ConfigError with one line naming the problem."""
    if cfg is None:
        return None
    cfg.validate()
    if not callable(getattr(runner, "verify", None)):
        raise ConfigError(f"--speculative: the {runner.backend} runner cannot verify drafts")
    prepare = getattr(runner, "prepare_verify", None)
    if callable(prepare):  # (the CUDA runner: its verify graphs captured ahead, not in a round)
        prepare(cfg.k)
    if cfg.method == "ngram":
        return Speculator(NgramProposer(cfg.ngram_min, cfg.ngram_max), cfg)
    if cfg.method == "mtp":
        return Speculator(_mtp_proposer(model, runner), cfg)
    from engine.backend import create_runner
    from engine.model import load_model
    from engine.spec.draft import DraftModelProposer

    path = str(cfg.draft_path)
    draft_model = load_model(path)
    _check_same_tokenizer(model, draft_model, path)
    # (the draft's own BlockManager has no window group: its window layers stay in its one pool)
    kwargs: dict[str, Any] = {"max_model_len": runner.max_model_len, "window_kv_blocks": 0}
    if runner.backend == "cuda":
        kwargs["num_blocks"] = DRAFT_CUDA_BLOCKS
    draft_runner = create_runner(draft_model, runner.backend, device_profile, **kwargs)
    if draft_runner.block_size < 1 or draft_runner.max_model_len < 2:
        raise MemraError(f"--speculative draft:{path}: the draft runner has no usable context")
    print(
        f"memra: speculative draft {draft_model.name} ({draft_model.graph.family}, "
        f"{draft_model.dims['layers']} layers) on {draft_runner.backend}, k={cfg.k}",
        file=sys.stderr,
    )
    return Speculator(DraftModelProposer(draft_runner), cfg)


def speculator_from_args(args: Any, model: Any, runner: Any) -> Speculator | None:
    """The engine's Speculator for a CLI namespace's --speculative/--spec-tokens (None without them)."""
    from engine.spec.config import parse_speculative

    cfg = parse_speculative(getattr(args, "speculative", None), getattr(args, "spec_tokens", None))
    return build_speculator(cfg, model, runner, device_profile=getattr(args, "device_profile", None))
