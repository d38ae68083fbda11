"""One spelling for model components, used in every label, table and export.

A component is one of:

- ``L17.H3``: attention head 3 of layer 17 (its output before the output projection mixes heads);
- ``L17.MLP``: the MLP block of layer 17;
- ``L17``: the residual stream after layer 17 (a whole layer);
- ``input``: the token (and position) embeddings;
- ``logits``: the unembedding.

`parse` reads this spelling and the older ones pages and analyses used before it
(``a17.h3`` / ``m17`` from circuit graphs, ``L17H3`` from ICL-head titles, ``L17.H3`` from
knowledge conflicts); `Component.__str__` always writes the one spelling above, so
``str(parse(x))`` is the canonical form of ``x``.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Literal

__all__ = ["Component", "parse", "parse_many", "head", "mlp", "layer", "INPUT", "LOGITS",
           "canonical", "check_in_model", "ComponentError"]

Kind = Literal["head", "mlp", "layer", "input", "logits"]


class ComponentError(ValueError):
    """A component name that cannot be read, or that names a part the model does not have."""


@dataclass(frozen=True, order=True)
class Component:
    kind: Kind
    layer: int | None = None
    head: int | None = None

    def __post_init__(self) -> None:
        if self.kind in ("head", "mlp", "layer"):
            if not isinstance(self.layer, int) or self.layer < 0:
                raise ComponentError(f"a {self.kind} needs a layer >= 0, got {self.layer!r}")
        elif self.layer is not None or self.head is not None:
            raise ComponentError(f"{self.kind!r} has no layer or head")
        if self.kind == "head":
            if not isinstance(self.head, int) or self.head < 0:
                raise ComponentError(f"a head needs a head index >= 0, got {self.head!r}")
        elif self.head is not None:
            raise ComponentError(f"a {self.kind} has no head index")

    def __str__(self) -> str:
        if self.kind == "head":
            return f"L{self.layer}.H{self.head}"
        if self.kind == "mlp":
            return f"L{self.layer}.MLP"
        if self.kind == "layer":
            return f"L{self.layer}"
        return self.kind

    @property
    def is_head(self) -> bool:
        return self.kind == "head"


def head(layer: int, h: int) -> Component:
    return Component("head", int(layer), int(h))


def mlp(layer: int) -> Component:
    return Component("mlp", int(layer))


def layer(index: int) -> Component:
    return Component("layer", int(index))


INPUT = Component("input")
LOGITS = Component("logits")

_PATTERNS: tuple[tuple[re.Pattern, str], ...] = (
    (re.compile(r"^l(\d+)[.:/]?h(\d+)$"), "head"),           # L17.H3, L17H3
    (re.compile(r"^a(\d+)\.h(\d+)$"), "head"),                # a17.h3 (circuit graphs)
    (re.compile(r"^l(\d+)[.:/]?mlp$"), "mlp"),               # L17.MLP
    (re.compile(r"^m(\d+)$"), "mlp"),                         # m17 (circuit graphs)
    (re.compile(r"^l(\d+)$"), "layer"),                       # L17
)


def parse(text: "str | Component") -> Component:
    """Read one component name (any spelling listed in the module docstring).

    Raises `ComponentError` with the accepted spellings for anything else.
    """
    if isinstance(text, Component):
        return text
    if not isinstance(text, str):
        raise ComponentError(f"a component name is a string, got {type(text).__name__}")
    key = text.strip().lower()
    if key in ("input", "embed", "embedding", "embeddings"):
        return INPUT
    if key in ("logits", "unembed", "output"):
        return LOGITS
    for pattern, kind in _PATTERNS:
        m = pattern.match(key)
        if m:
            if kind == "head":
                return head(int(m.group(1)), int(m.group(2)))
            return Component(kind, int(m.group(1)))
    raise ComponentError(
        f"cannot read component {text.strip()[:40]!r}: write a head as L17.H3, an MLP as "
        "L17.MLP, a layer as L17, or input / logits")


def canonical(text: "str | Component") -> str:
    """The one spelling of a component name: ``canonical("a3.h1") == "L3.H1"``."""
    return str(parse(text))


def check_in_model(component: "str | Component", n_layers: int, n_heads: int) -> Component:
    """Parse ``component`` and check it exists in a model of this shape."""
    c = parse(component)
    if c.layer is not None and not 0 <= c.layer < n_layers:
        raise ComponentError(f"{c} is out of range: the model has layers 0..{n_layers - 1}")
    if c.head is not None and not 0 <= c.head < n_heads:
        raise ComponentError(f"{c} is out of range: the model has heads 0..{n_heads - 1} per layer")
    return c


def parse_many(text: "str | Iterable[str | Component]") -> list[Component]:
    """Components from a comma / whitespace separated string or an iterable, in order, once each."""
    items = re.split(r"[,;\s]+", text) if isinstance(text, str) else list(text)
    out: list[Component] = []
    for item in items:
        if isinstance(item, str) and not item.strip():
            continue
        c = parse(item)
        if c not in out:
            out.append(c)
    return out

