"""The description of the served model that the HTTP layer needs (id, context length, backend).

Plain dataclass; must not import engine internals.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelInfo:
    id: str
    context_length: int
    backend: str
    created: int = 0
    aliases: tuple[str, ...] = ()  # other names a request's "model" may use
    # (SamplingParams field, value) the model's files ask for; applied where a request omits the field
    generation_defaults: tuple[tuple[str, float], ...] = ()

    def matches(self, name: str) -> bool:
        return name == self.id or name in self.aliases
