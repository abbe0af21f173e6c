"""KernelSpec: everything that determines one specialised CUDA kernel (template + parameters).

A spec is the unit the render -> cache -> NVRTC pipeline works on. Its ``params`` are the only
values the Jinja2 template sees (never YAML or engine objects), and launch geometry that both the
kernel and the host need (threads per block, tile sizes) is read from the same ``params`` so the two
cannot disagree. Must not import CUDA.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

_NAME_OK = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _freeze(value: Any) -> Any:
    if isinstance(value, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    return value


@dataclass(frozen=True)
class KernelSpec:
    """A kernel to build: ``kernels/<template>.cu.j2`` rendered with ``params``.

    ``entry`` is the ``extern "C"`` function name, built from the template and the parameters that
    matter (e.g. ``gemv_q4_1__n576_k1536_t256``) so cubins and profiles are readable. Templates must
    define exactly that symbol: the template receives it as ``{{ entry }}``.
    ``options`` are extra NVRTC options (e.g. ``-DFOO``); the arch comes from the device profile.
    ``pdl``: the kernel may be launched with programmatic dependent launch (its body calls
    ``pdl_wait()`` before it touches memory an earlier kernel of the pass writes; the catalog sets
    it from the template's contract, tests/test_pdl.py checks it against the rendered source).
    """

    template: str
    entry: str
    params: dict[str, Any] = field(default_factory=dict)
    options: tuple[str, ...] = ()
    pdl: bool = False

    def __post_init__(self) -> None:
        if not _NAME_OK.match(self.entry):
            raise ValueError(f"kernel entry name {self.entry!r} is not a C identifier")
        if not _NAME_OK.match(self.template):
            raise ValueError(f"kernel template name {self.template!r} is not a plain identifier")

    def _key(self) -> tuple:
        """The identity tuple, frozen once (specs are dict keys on the runner's binding path,
        where re-freezing the params per lookup cost more than the rest of a launch's binding)."""
        key = self.__dict__.get("_frozen_key")
        if key is None:
            key = (self.template, self.entry, _freeze(self.params), self.options, self.pdl)
            object.__setattr__(self, "_frozen_key", key)
            object.__setattr__(self, "_frozen_hash", hash(key))
        return key

    def __hash__(self) -> int:
        self._key()
        return self.__dict__["_frozen_hash"]

    def __getstate__(self) -> dict:
        # the cached hash is per process (str hashing is salted): a copy or unpickled spec recomputes it
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_frozen_")}

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, KernelSpec):
            return NotImplemented
        return self._key() == other._key()

    def describe(self) -> str:
        """One line for logs and `memra warmup --list`."""
        return f"{self.entry} ({self.template} {json.dumps(self.params, sort_keys=True)})"


def entry_name(template: str, **parts: Any) -> str:
    """Readable entry point name: ``entry_name("gemv_q8_0", n=576, k=1536, t=256)`` ->
    ``gemv_q8_0__n576_k1536_t256``. Values are sanitised to identifier characters."""
    bits = []
    for key, value in parts.items():
        text = re.sub(r"[^A-Za-z0-9]", "", str(value).replace(".", "p").replace("-", "m"))
        bits.append(f"{key}{text}")
    return f"{template}__{'_'.join(bits)}" if bits else template
