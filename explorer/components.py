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

Two more things can be selected, with their own spelling:

- an `Edge` of the circuit graph, ``SRC->DST``: ``L3.H1->L5.MLP``, ``input->L0.H2``,
  ``L29.MLP->logits``. Its source is ``input``, a head or an MLP; its target a head, an MLP
  or ``logits``; it goes forward in depth (input, then per layer its heads, then its MLP, then
  the logits: a head reads earlier layers only, an MLP its own layer's heads too). `parse_edge`
  also reads the circuit graph's node names (``a3.h1->m5``) and ``→`` for the arrow;
  `Edge.__str__` writes ``L3.H1->L5.MLP``.
- a token `Position` of the prompt, ``P5`` (0-based, the ``pos`` index of the results).
  `parse_position` also reads ``pos 5``, ``pos5``, ``pos=5`` and a bare ``5``;
  `Position.__str__` writes ``P5``. `check_position` checks it against a prompt's length.

- a dictionary `Feature`, ``L5.F123``: feature 123 of the dictionary read at layer 5's
  residual stream (the Feature dashboards page's dictionary at that layer). `parse_feature`
  also reads ``l5.f123`` and ``L5 F123``; `check_feature` checks its layer against the model.

`parse_any` reads any of the four kinds (component, edge, position, feature).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Literal

__all__ = ["Component", "parse", "parse_many", "head", "mlp", "layer", "INPUT", "LOGITS",
           "canonical", "check_in_model", "ComponentError", "Edge", "edge", "parse_edge",
           "check_edge_in_model", "Position", "parse_position", "check_position", "Feature",
           "parse_feature", "check_feature", "parse_any", "canonical_any", "check_any"]

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



# -- circuit edges ------------------------------------------------------------------------------

_EDGE_SOURCES = ("input", "head", "mlp")
_EDGE_TARGETS = ("head", "mlp", "logits")
_ARROW = re.compile(r"\s*(?:->|→)\s*")
_EDGE_HELP = ("write an edge as SRC->DST, e.g. L3.H1->L5.MLP, input->L0.H2 or "
              "L29.MLP->logits")


def _depth(c: Component) -> tuple[float, int]:
    """Where ``c`` sits in the forward pass: input, (per layer) heads then MLP, logits."""
    if c.kind == "input":
        return (-1, 0)
    if c.kind == "logits":
        return (float("inf"), 0)
    return (c.layer, 0 if c.kind == "head" else 1)


@dataclass(frozen=True, order=True)
class Edge:
    """An edge of the circuit graph: ``src`` writes into the residual stream that ``dst`` reads.

    ``src`` is ``input``, a head or an MLP; ``dst`` a head, an MLP or ``logits``; ``dst`` comes
    later in the forward pass (a head reads earlier layers only; an MLP also its own layer's
    heads). Anything else raises `ComponentError`.
    """

    src: Component
    dst: Component

    def __post_init__(self) -> None:
        for side, c, allowed in (("source", self.src, _EDGE_SOURCES),
                                 ("target", self.dst, _EDGE_TARGETS)):
            if not isinstance(c, Component):
                raise ComponentError(f"an edge's {side} is a Component, got {type(c).__name__}")
            if c.kind not in allowed:
                what = f"{c} (a whole layer)" if c.kind == "layer" else str(c)
                raise ComponentError(
                    f"{what} cannot be an edge's {side}: a source is input, a head or an "
                    f"MLP; a target is a head, an MLP or logits ({_EDGE_HELP})")
        if self.src == self.dst:
            raise ComponentError(f"{self.src}->{self.dst} is a self edge: an edge joins two "
                                 "different components")
        if _depth(self.src) >= _depth(self.dst):
            why = (f"heads of one layer read the same stream, so {self.dst} cannot read {self.src}"
                   if self.src.is_head and self.dst.is_head and self.src.layer == self.dst.layer
                   else f"{self.dst} runs before {self.src} writes"
                   if _depth(self.src) > _depth(self.dst) else "")
            raise ComponentError(f"{self.src}->{self.dst} goes backwards: an edge must go "
                                 f"forward in depth ({why})" if why else
                                 f"{self.src}->{self.dst} does not go forward in depth")

    def __str__(self) -> str:
        return f"{self.src}->{self.dst}"


def edge(src: "str | Component", dst: "str | Component") -> Edge:
    """The edge from ``src`` to ``dst`` (component names in any spelling `parse` reads)."""
    return Edge(parse(src), parse(dst))


def parse_edge(text: "str | Edge") -> Edge:
    """Read an edge ``SRC->DST`` (each side any spelling `parse` reads; ``→`` also works).

    Raises `ComponentError` for a missing arrow, an unreadable endpoint, a layer endpoint, a
    self edge or one that goes backwards.
    """
    if isinstance(text, Edge):
        return text
    if not isinstance(text, str):
        raise ComponentError(f"an edge is a string such as 'L3.H1->L5.MLP', got "
                             f"{type(text).__name__}")
    parts = _ARROW.split(text.strip())
    if len(parts) != 2 or not all(parts):
        raise ComponentError(f"cannot read edge {text.strip()[:60]!r}: {_EDGE_HELP}")
    try:
        src, dst = parse(parts[0]), parse(parts[1])
    except ComponentError as exc:
        raise ComponentError(f"cannot read edge {text.strip()[:60]!r}: {exc}") from None
    return Edge(src, dst)


def check_edge_in_model(e: "str | Edge", n_layers: int, n_heads: int, *,
                        parallel: bool = False) -> Edge:
    """Parse ``e`` and check both ends exist in a model of this shape; with ``parallel``
    (attention and MLP read the same stream, GPT-J style) an MLP does not read its own
    layer's heads."""
    e = parse_edge(e)
    check_in_model(e.src, n_layers, n_heads)
    check_in_model(e.dst, n_layers, n_heads)
    if parallel and e.src.is_head and e.dst.kind == "mlp" and e.src.layer == e.dst.layer:
        raise ComponentError(f"{e} is not an edge of this model: its MLP reads what its "
                             "layer's heads read, not their output")
    return e


# -- token positions ----------------------------------------------------------------------------

_POSITION = re.compile(r"^(?:p|pos)?\s*[=:]?\s*(\d+)$")
_POSITION_HELP = "write a token position as P5 (or pos 5), 0-based"


@dataclass(frozen=True, order=True)
class Position:
    """A token position of the prompt, 0-based (the ``pos`` index of every result)."""

    index: int

    def __post_init__(self) -> None:
        if isinstance(self.index, bool) or not isinstance(self.index, int) or self.index < 0:
            raise ComponentError(f"a token position is an int >= 0, got {self.index!r}")

    def __str__(self) -> str:
        return f"P{self.index}"


def parse_position(text: "str | int | Position") -> Position:
    """Read a token position: ``P5``, ``pos 5``, ``pos5``, ``pos=5``, ``5`` or an int."""
    if isinstance(text, Position):
        return text
    if isinstance(text, int) and not isinstance(text, bool):
        return Position(text)
    if not isinstance(text, str):
        raise ComponentError(f"a token position is a string such as 'P5' or an int, got "
                             f"{type(text).__name__}")
    m = _POSITION.match(text.strip().lower())
    if not m:
        raise ComponentError(f"cannot read token position {text.strip()[:40]!r}: "
                             f"{_POSITION_HELP}")
    return Position(int(m.group(1)))


def check_position(p: "str | int | Position", n_tokens: int | None) -> Position:
    """Parse ``p`` and, when the prompt's length ``n_tokens`` is known, check it is inside."""
    p = parse_position(p)
    if n_tokens is not None and not p.index < n_tokens:
        raise ComponentError(
            f"{p} is out of range: the prompt has {n_tokens} token{'s' if n_tokens != 1 else ''}"
            + (f" (positions P0..P{n_tokens - 1})" if n_tokens else ""))
    return p


# -- dictionary features -------------------------------------------------------------------------

_FEATURE = re.compile(r"^l\s*(\d+)\s*[.\s]\s*f\s*(\d+)$")


@dataclass(frozen=True, order=True)
class Feature:
    """Feature ``index`` of the dictionary read at layer ``layer``'s residual stream."""

    layer: int
    index: int

    def __post_init__(self) -> None:
        for name in ("layer", "index"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ComponentError(f"a feature's {name} is an int >= 0, got {value!r}")

    def __str__(self) -> str:
        return f"L{self.layer}.F{self.index}"


def parse_feature(text: "str | Feature") -> Feature:
    """Read a dictionary feature: ``L5.F123`` (also ``l5.f123``, ``L5 F123``)."""
    if isinstance(text, Feature):
        return text
    if not isinstance(text, str):
        raise ComponentError(f"a feature is a string such as 'L5.F123', got {type(text).__name__}")
    m = _FEATURE.match(text.strip().lower())
    if not m:
        raise ComponentError(f"cannot read feature {text.strip()[:40]!r}: write a dictionary "
                             "feature as L5.F123 (feature 123 of the layer-5 dictionary)")
    return Feature(int(m.group(1)), int(m.group(2)))


def check_feature(f: "str | Feature", n_layers: int | None) -> Feature:
    """Parse ``f`` and, when the model's depth ``n_layers`` is known, check its layer."""
    f = parse_feature(f)
    if n_layers is not None and not f.layer < n_layers:
        raise ComponentError(f"{f} is out of range: the model has {n_layers} layers "
                             f"(L0..L{n_layers - 1})")
    return f


# -- any selectable thing ------------------------------------------------------------------------

def parse_any(text: "str | int | Component | Edge | Position | Feature"
              ) -> "Component | Edge | Position | Feature":
    """A component, an edge (has an arrow), a token position (``P5`` / ``pos 5`` / an int) or
    a dictionary feature (``L5.F123``)."""
    if isinstance(text, (Component, Edge, Position, Feature)):
        return text
    if isinstance(text, int) and not isinstance(text, bool):
        return Position(text)
    if not isinstance(text, str):
        raise ComponentError(f"a name is a string such as 'L3.H1', got {type(text).__name__}")
    if _ARROW.search(text):
        return parse_edge(text)
    key = text.strip().lower()
    if key.startswith(("p", "pos")) and _POSITION.match(key):
        return parse_position(text)
    if _FEATURE.match(key):
        return parse_feature(text)
    try:
        return parse(text)
    except ComponentError:
        raise ComponentError(
            f"cannot read {text.strip()[:40]!r}: write a head as L17.H3, an MLP as L17.MLP, a "
            "layer as L17, input / logits, an edge as L3.H1->L5.MLP, a token position as "
            "P5, a dictionary feature as L5.F123") from None


def canonical_any(text: "str | int | Component | Edge | Position") -> str:
    """The one spelling of a component, edge or position: ``canonical_any("a3.h1->m5")``
    is ``"L3.H1->L5.MLP"``, ``canonical_any("pos 2")`` is ``"P2"``."""
    return str(parse_any(text))


def check_any(text: "str | int | Component | Edge | Position", n_layers: int | None,
              n_heads: int | None, n_tokens: int | None = None, *,
              parallel: bool = False) -> "Component | Edge | Position":
    """`parse_any`, then the check that applies (model shape when known, prompt length)."""
    x = parse_any(text)
    if isinstance(x, Position):
        return check_position(x, n_tokens)
    if isinstance(x, Feature):
        return check_feature(x, n_layers)
    if n_layers is None or n_heads is None:
        return x
    if isinstance(x, Edge):
        return check_edge_in_model(x, n_layers, n_heads, parallel=parallel)
    return check_in_model(x, n_layers, n_heads)
