"""Render kernels/<template>.cu.j2 with a KernelSpec's parameters into CUDA source.

The Jinja2 environment uses StrictUndefined, so a template that reads a parameter the spec lacks
fails loudly with the spec's name. A template sees ``entry`` plus the spec's params and nothing
else. Must not import CUDA.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import jinja2

from engine import paths
from engine.kernel_spec import KernelSpec


class RenderError(Exception):
    pass


@lru_cache(maxsize=4)
def _environment(root: str) -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(root),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,
    )


def render(spec: KernelSpec, kernels_root: Path | None = None) -> str:
    """Return the CUDA source of ``spec``. Raises RenderError naming the template and the problem."""
    root = str(kernels_root or paths.kernels_dir())
    env = _environment(root)
    name = f"{spec.template}.cu.j2"
    try:
        template = env.get_template(name)
    except jinja2.TemplateNotFound as exc:
        raise RenderError(f"kernel template {name} not found in {root}") from exc
    if "entry" in spec.params:
        raise RenderError(f"{spec.entry}: 'entry' is reserved and may not be a spec parameter")
    try:
        source = template.render(entry=spec.entry, **spec.params)
    except jinja2.UndefinedError as exc:
        raise RenderError(f"{name} for {spec.entry}: {exc.message}") from exc
    except jinja2.TemplateError as exc:
        raise RenderError(f"{name} for {spec.entry}: {exc}") from exc
    if f"{spec.entry}(" not in source:
        raise RenderError(f"{name} rendered for {spec.entry} does not define the entry point {spec.entry}")
    return source


# the first line of a kernel body that reads step-invariant data (weights, step inputs, earlier
# steps' KV) before its pdl_wait()
PDL_PRELOAD = "// pdl: only weights and step inputs before pdl_wait()"


def waits_first(source: str, entry: str) -> bool:
    """Whether the body of kernel ``entry`` in ``source`` starts with ``pdl_wait();`` (comments and
    blank lines aside): the contract of a kernel launched with programmatic dependent launch. A
    body whose first line is PDL_PRELOAD counts when it does call ``pdl_wait();``: before the wait it
    reads only what no kernel of the pass writes (weights; the step inputs uploaded before the pass:
    positions, slots, block tables; KV-cache entries of earlier steps), which every kernel before the
    previous one has finished with, since each kernel waits before it ends."""
    start = source.find(f"{entry}(")
    if start < 0:
        return False
    i, depth = start + len(entry) + 1, 1
    while depth and i < len(source):
        depth += {"(": 1, ")": -1}.get(source[i], 0)
        i += 1
    body = source.find("{", i)
    if body < 0 or source[i:body].strip():
        return False
    rest = source[body + 1 :]
    if rest.lstrip().startswith(PDL_PRELOAD):
        return "pdl_wait();" in rest
    for line in rest.splitlines():
        code = line.split("//", 1)[0].strip()
        if code:
            return code.startswith("pdl_wait();")
    return False
