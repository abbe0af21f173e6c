"""CUDA lowering: one unit per graph op turns (op node, dims, storage types, tuning) into launches.

Every module of this package except ``registry`` and ``context`` is a lowering unit that registers
itself with ``engine.lowering.registry`` when imported; importing the package imports them all.
``engine.plan.build_plan`` drives a ``context.Lowerer`` over the schedule. Adding an op is one unit
here, one template in kernels/ and one reference function (docs/kernels.md, "Adding an op").
Must not import CUDA or numpy.
"""

from __future__ import annotations

import importlib
import pkgutil

for _info in pkgutil.iter_modules(__path__):
    if _info.name not in ("registry", "context"):
        importlib.import_module(f"{__name__}.{_info.name}")
