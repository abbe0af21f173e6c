"""The op vocabulary of the model-family DSL: every op's arity rules (``OPS``) and numpy reference
implementation (``REFERENCE``), collected from the modules of this package.

Each module ``engine/ops/<name>.py`` defines its ops with ``engine.ops.base.define`` at import; this
package imports them all, so a new op is one new module (or a few lines in an existing one) and
nothing else. The CUDA side lowers the same op names (docs/kernels.md). Must not import CUDA.
"""

from __future__ import annotations

import importlib
import pkgutil

from engine.ops.base import OPS, REFERENCE, OpDef, RefStep, define

for _mod in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    if _mod != "base":
        importlib.import_module(f"{__name__}.{_mod}")

__all__ = ["OPS", "REFERENCE", "OpDef", "RefStep", "define"]
