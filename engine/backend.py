"""Choose and build a runner: the CUDA runner when a GPU is present, else the numpy reference.

``detect()`` never raises on a machine without CUDA; ``create_runner`` reports which backend it
picked and why on stderr. Must not import cuda.bindings directly (engine.cuda does).
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from engine import env
from engine.profile import DeviceProfile, select
from engine.progress import process_age
from engine.types import DeviceInfo, MemraError

BACKENDS = ("auto", "cuda", "reference")


@dataclass
class Detected:
    devices: list[DeviceInfo]
    error: str | None = None


def detect() -> Detected:
    """Every CUDA device the driver reports; [] with the reason when there is no usable driver."""
    try:
        from engine import cuda
    except Exception as exc:  # cuda-bindings missing or broken
        return Detected([], f"cuda-bindings unavailable: {exc}")
    try:
        return Detected(cuda.detect_devices())
    except Exception as exc:
        return Detected([], str(exc))


def detect_soon() -> Callable[[], Detected]:
    """``detect()`` begun in a thread now, so the driver's initialisation (cuInit leaves the GIL)
    overlaps what the caller does next (``load_stack``: the model's metadata and the tokenizer);
    the returned callable waits for its result."""
    out: list[Detected] = []

    def run() -> None:
        try:
            out.append(detect())
        except BaseException as exc:  # (detect itself never raises; a broken import might)
            out.append(Detected([], f"device detection failed: {exc}"))

    thread = threading.Thread(target=run, daemon=True, name="cuda-detect")
    thread.start()

    def wait() -> Detected:
        thread.join()
        return out[0]

    return wait


def choose_profile(device: DeviceInfo, override: str | None = None) -> DeviceProfile:
    return select(device, override or env.MEMRA_DEVICE_PROFILE.get() or None)


def split_devices(devices: str | None, split: str | None) -> tuple[int, ...]:
    """The device ids of ``--devices``/``--split``, checked (before any model loads): several
    devices need a split, a split needs at least two devices. (0,) when neither is given."""
    from engine.placement import parse_devices

    ids = parse_devices(devices) if devices else (0,)
    if split is None and len(ids) > 1:
        raise MemraError(f"--devices {devices}: {len(ids)} devices need --split pp or --split tp", param="split")
    if split is not None and len(ids) < 2:
        raise MemraError(
            f"--split {split} needs at least 2 devices, got --devices {devices or '0'} (e.g. --devices 0,1)",
            param="devices",
        )
    return ids


def parse_window_kv_blocks(value: str | int | None) -> int | None:
    """``--window-kv-blocks N``: None (the flag not given: sized automatically), or a block count
    >= 0 (0: no window pool); anything else is a MemraError naming the flag."""
    if value is None:
        return None
    try:
        n = int(str(value).strip())
    except ValueError:
        n = -1
    if n < 0:
        raise MemraError(
            f"--window-kv-blocks: expected a block count >= 0 (0: no window pool), got {value!r}",
            param="window_kv_blocks",
        )
    return n


@dataclass(frozen=True)
class StackFlags:
    """The model-loading flags of `memra run`, `chat`, `serve` and `bench` (engine.cli adds them to
    each parser), read from the parsed arguments in one place; a subcommand without one of them gets
    its default here."""

    backend: str = "auto"
    device_profile: str | None = None
    quant: str | None = None
    devices: str | None = None
    split: str | None = None
    window_kv_blocks: int | None = None
    overlap: bool = False

    @classmethod
    def of(cls, args: Any) -> StackFlags:
        """The flags of ``args``, checked before anything loads (--devices/--split, then
        --window-kv-blocks: a MemraError naming the flag)."""
        given = {f.name: getattr(args, f.name) for f in fields(cls) if getattr(args, f.name, None) is not None}
        split_devices(given.get("devices"), given.get("split"))
        given["window_kv_blocks"] = parse_window_kv_blocks(given.get("window_kv_blocks"))
        return cls(**given)


def _split_runner(model: Any, backend: str, devices: str | None, split: str | None, **kwargs: Any):
    """The runner for ``--devices``/``--split`` (engine.placement): the sharded numpy reference on
    ``--backend reference``; on CUDA a clear error (too few devices, or no multi-GPU runner yet)."""
    from engine.placement import plan_placement

    ids = split_devices(devices, split)
    assert split is not None
    placement = plan_placement(
        model.graph, model.dims, split, ids, model.quant, getattr(model, "tensor_dtypes", None)
    )
    if backend != "reference":
        found = detect()
        missing = [i for i in ids if i >= len(found.devices)]
        if missing:
            seen = ", ".join(f"{i}: {d.name}" for i, d in enumerate(found.devices)) or found.error or "none"
            raise MemraError(
                f"--split {split} over devices {','.join(map(str, ids))} needs {len(ids)} CUDA devices; "
                f"device {missing[0]} does not exist (found: {seen}). --backend reference runs the split "
                "on the numpy reference",
                param="devices",
            )
        raise MemraError(
            f"--split {split}: the CUDA runner does not split a model over devices yet; "
            "--backend reference runs the split on the numpy reference",
            param="split",
        )
    from engine.sharded_reference import ShardedReference

    print(f"memra: {placement.describe()}", file=sys.stderr)
    return ShardedReference(model, placement, **{k: v for k, v in kwargs.items() if k in ("num_blocks", "max_model_len")})


def create_runner(
    model: Any,
    backend: str = "auto",
    device_profile: str | None = None,
    devices: str | None = None,
    split: str | None = None,
    detected: Callable[[], Detected] | None = None,
    **kwargs: Any,
):
    """A Runner for ``model`` (engine.model.LoadedModel) on the requested backend; ``devices`` ("0,1")
    and ``split`` ("pp" | "tp") split it over several devices (engine.placement). ``kwargs`` go to
    the CUDA runner (``window_kv_blocks``, ``max_running`` ... : engine.runner_cuda.CudaRunner); the
    reference takes ``num_blocks``, ``max_model_len`` and an explicit ``window_kv_blocks``.
    ``detected``: the devices found by a ``detect_soon()`` begun earlier (else ``detect()`` now)."""
    if backend not in BACKENDS:
        raise MemraError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}", param="backend")
    if split is not None or (devices is not None and "," in devices):
        return _split_runner(model, backend, devices, split, **kwargs)
    if devices not in (None, "0"):
        raise MemraError(f"--devices {devices}: one device other than 0 is not supported yet; use CUDA_VISIBLE_DEVICES", param="devices")
    if backend in ("auto", "cuda"):
        found = detected() if detected is not None else detect()
        if found.devices:
            profile = choose_profile(found.devices[0], device_profile)
            from engine.runner_cuda import CudaRunner

            print(
                f"memra: backend cuda on {found.devices[0].name} (profile {profile.name}, {profile.arch})",
                file=sys.stderr,
            )
            return CudaRunner(model, profile, **kwargs)
        if backend == "cuda":
            raise MemraError(
                f"--backend cuda: no CUDA device found ({found.error or 'the driver lists none'})"
            )
        print(
            "memra: no CUDA device found; running the numpy reference backend (slow, for correctness)",
            file=sys.stderr,
        )
    from engine.reference import ReferenceRunner

    ref = {k: v for k, v in kwargs.items() if k in ("num_blocks", "max_model_len")}
    if kwargs.get("window_kv_blocks") is not None:  # (None: the reference's own default pool)
        ref["window_kv_blocks"] = kwargs["window_kv_blocks"]
    return ReferenceRunner(model, **ref)


def resolve_model_path(model: str | None) -> Path:
    """The model argument (a path, or a known alias such as ``gemma3-270m``, fetched on first use),
    or the embedded default (SmolLM2-135M-Instruct Q4_1) when omitted."""
    from engine.default_model import KNOWN_MODELS, default_model_path, known_model_path

    if model:
        path = Path(model).expanduser()
        if not path.exists():
            if model in KNOWN_MODELS:
                return known_model_path(model)
            raise MemraError(
                f"model path {path} does not exist (nor is it a known model: {', '.join(KNOWN_MODELS)})",
                param="model",
            )
        return path

    return default_model_path()


def load_stack(model_arg: str | None, flags: StackFlags = StackFlags(), **runner_kwargs: Any):
    """(LoadedModel, Tokenizer, Runner) for a model argument and the flags, with progress on stderr;
    ``runner_kwargs`` go to ``create_runner`` (None values left out: the runner's defaults)."""
    from engine.model import load_model
    from engine.tokenizer import load_tokenizer

    path = resolve_model_path(model_arg)
    t0 = time.perf_counter()
    one_gpu = flags.backend in ("auto", "cuda") and flags.split is None and flags.devices in (None, "0")
    soon = detect_soon() if one_gpu else None  # (the driver's init meanwhile: create_runner waits for it)
    age = process_age()
    print(f"memra: loading {path}" + (f" ({age:.2f} s after the process started)" if age is not None else ""), file=sys.stderr)
    model = load_model(path, quant=flags.quant)
    t1 = time.perf_counter()
    tokenizer = load_tokenizer(model.weights)
    t2 = time.perf_counter()
    kwargs = {k: v for k, v in {"window_kv_blocks": flags.window_kv_blocks, **runner_kwargs}.items() if v is not None}
    runner = create_runner(
        model, flags.backend, flags.device_profile, devices=flags.devices, split=flags.split, detected=soon, **kwargs
    )
    t3 = time.perf_counter()
    print(
        f"memra: {model.graph.family} model, {model.dims['layers']} layers, quant {model.quant.name}, "
        f"{runner.backend} backend, ready in {t3 - t0:.1f} s: model {t1 - t0:.2f} s, tokenizer {t2 - t1:.2f} s, "
        f"runner {t3 - t2:.2f} s",
        file=sys.stderr,
    )
    return model, tokenizer, runner
