"""Render kernels/<template>.cu.j2 with a KernelSpec's parameters into CUDA source.

The Jinja2 environment uses StrictUndefined, so a template that reads a parameter the spec lacks
fails loudly with the spec's name. A template sees ``entry`` plus the spec's params and one
function, ``part`` (another template rendered from the params under a prefix: gemv_pair's two
GEMVs). Must not import CUDA.
"""

from __future__ import annotations

import re
import zlib
from functools import lru_cache
from pathlib import Path

import jinja2

from engine import env as memra_env
from engine import paths
from engine.kernel_spec import KernelSpec


class RenderError(Exception):
    pass


@lru_cache(maxsize=4)
def _environment(root: str) -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(root),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,
    )
    env.globals["part"] = _render_part
    return env


_DEFINE = re.compile(r"^[ \t]*#[ \t]*define[ \t]+([A-Za-z_][A-Za-z0-9_]*)", re.M)


@jinja2.pass_context
def _render_part(ctx: jinja2.runtime.Context, template: str, prefix: str, **extra: object) -> str:
    """``{{ part("gemv.cu.j2", "a_", entry="part", pair_body=true) }}`` in a template: ``template``
    rendered with the calling template's params named ``prefix``* (prefix dropped) plus ``extra``,
    followed by an ``#undef`` of every macro it defines, so that a second part rendered after it
    (in a namespace of its own) may define the same macros with other values."""
    params = {k[len(prefix) :]: v for k, v in ctx.get_all().items() if k.startswith(prefix)}
    source = ctx.environment.get_template(template).render(**params, **extra)
    names = dict.fromkeys(_DEFINE.findall(source))
    return source + "".join(f"#undef {name}\n" for name in names)


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
    if memra_env.MEMRA_TRACE.get():
        source = with_trace(source, spec.entry)
    return source


TRACE_SCOPE = "MEMRA_TRACE_SCOPE"


def trace_tag(entry: str) -> int:
    """The tag a traced kernel's records carry (tools/gpu_trace_decode.py maps it back)."""
    return zlib.crc32(entry.encode())


def with_trace(source: str, entry: str) -> str:
    """``source`` with the block timeline trace of kernels/_common.cuh.j2 switched on: MEMRA_TRACE
    defined, and the body of kernel ``entry`` opened by a trace scope carrying its tag."""
    body = _body_start(source, entry)
    if body < 0:
        raise RenderError(f"{entry}: no kernel body to trace")
    scope = f"\n    {TRACE_SCOPE}(0x{trace_tag(entry):08x}u);  // block timeline (MEMRA_TRACE)"
    traced = source[: body + 1] + scope + source[body + 1 :]
    return "#define MEMRA_TRACE 1\n" + traced


def _body_start(source: str, entry: str) -> int:
    """Index of the ``{`` opening kernel ``entry``'s body (-1 if there is none)."""
    start = source.find(f"{entry}(")
    if start < 0:
        return -1
    i, depth = start + len(entry) + 1, 1
    while depth and i < len(source):
        depth += {"(": 1, ")": -1}.get(source[i], 0)
        i += 1
    body = source.find("{", i)
    if body < 0 or source[i:body].strip():
        return -1
    return body

