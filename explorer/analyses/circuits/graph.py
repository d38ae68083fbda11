"""The circuit graph at head/MLP granularity: its nodes, its edges and which edges can exist."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import xarray as xr

from explorer._checks import InputError
from explorer.heads import ENGINE_FAMILIES, check_engine_family, parallel_attn_mlp
from explorer.models import Model

__all__ = [
    'SUPPORTED_FAMILIES', 'CircuitGraph', 'QKV', 'node_of', 'input_of', 'is_split', 'node_layer',
    'valid_edge_mask', 'circuit_graph',
]


SUPPORTED_FAMILIES = ENGINE_FAMILIES


@dataclass(frozen=True)
class CircuitGraph:
    """Nodes and edges of a model's computational graph at head/MLP granularity.

    ``nodes`` is ``("input", "a0.h0", ..., "a0.h{H-1}", "m0", "a1.h0", ..., "logits")``;
    ``edges`` holds ``(src, dst)`` for every src that writes before dst reads (sequential
    blocks: an MLP reads the heads of its own layer; heads read only earlier layers). With
    ``parallel`` (GPT-NeoX's parallel attention and MLP) an MLP reads the same stream as its
    layer's heads, so it reads only earlier layers too.
    """

    nodes: tuple[str, ...]
    edges: tuple[tuple[str, str], ...]
    n_layers: int
    n_heads: int
    parallel: bool = False
    split_qkv: bool = False

    def layer_of(self, node: str) -> int:
        """Layer of a node: ``a{L}.h{H}`` and ``m{L}`` -> L, ``input`` -> 0, ``logits`` -> last.

        This is the CircuitLoRA convention (Wang et al. 2025) for per-layer sums.
        """
        return node_layer(node, self.n_layers)

    @property
    def sources(self) -> tuple[str, ...]:
        """Nodes that write to the residual stream (all but ``logits``), in forward order."""
        return self.nodes[:-1]

    @property
    def destinations(self) -> tuple[str, ...]:
        """Node inputs that read the residual stream, in forward order: every node but
        ``input``; with ``split_qkv`` each layer's heads as their query inputs
        (``a{L}.h{H}<q>``), then their key and their value inputs, then the MLP."""
        if not self.split_qkv:
            return self.nodes[1:]
        return _destinations(self.n_layers, self.n_heads, True)


QKV = ("q", "k", "v")


def _destinations(n_layers: int, n_heads: int, split_qkv: bool) -> tuple[str, ...]:
    out = []
    for layer in range(n_layers):
        heads = [f"a{layer}.h{h}" for h in range(n_heads)]
        out += [f"{n}<{part}>" for part in QKV for n in heads] if split_qkv else heads
        out.append(f"m{layer}")
    return tuple(out + ["logits"])


def node_of(dst: str) -> str:
    """The node a destination belongs to: ``a3.h1<k>`` -> ``a3.h1``; other names unchanged."""
    return dst[:-3] if dst.endswith(("<q>", "<k>", "<v>")) else dst


def input_of(dst: str) -> str:
    """Which input of its head a destination is: ``"q"``, ``"k"``, ``"v"``, or ``""`` (a
    combined head input, an MLP, the logits)."""
    return dst[-2] if dst.endswith(("<q>", "<k>", "<v>")) else ""


def is_split(scores: xr.Dataset) -> bool:
    """Whether edge scores are over the q/k/v-split graph (`edge_scores(split_qkv=True)`)."""
    if "split_qkv" in scores.attrs:
        return bool(scores.attrs["split_qkv"])
    return any(input_of(str(d)) for d in scores["dst"].values)


def node_layer(node: str, n_layers: int) -> int:
    """The layer a graph node belongs to (``"input"`` 0, ``"logits"`` ``n_layers``)."""
    node = node_of(node)
    if node == "input":
        return 0
    if node == "logits":
        return n_layers - 1
    try:
        if node.startswith("a") and ".h" in node:
            return int(node[1:node.index(".h")])
        if node.startswith("m"):
            return int(node[1:])
    except ValueError:
        pass
    raise InputError(f"unknown node {node!r}; nodes are 'input', 'a{{layer}}.h{{head}}', "
                     "'m{layer}' and 'logits'.")


def _graph(n_layers: int, n_heads: int, parallel: bool = False,
           split_qkv: bool = False) -> CircuitGraph:
    nodes = ["input"]
    for layer in range(n_layers):
        nodes += [f"a{layer}.h{h}" for h in range(n_heads)] + [f"m{layer}"]
    nodes.append("logits")
    valid = valid_edge_mask(n_layers, n_heads, parallel, split_qkv)
    src, dst = nodes[:-1], _destinations(n_layers, n_heads, split_qkv)
    s_idx, t_idx = np.nonzero(valid)
    edges = tuple((src[s], dst[t]) for s, t in zip(s_idx, t_idx))
    return CircuitGraph(tuple(nodes), edges, n_layers, n_heads, parallel, split_qkv)


def _dst_layout(n_heads: int, split_qkv: bool) -> tuple[int, int]:
    """(destinations per layer, head inputs per layer): (H+1, H), or split (3H+1, 3H)."""
    n_in = 3 * n_heads if split_qkv else n_heads
    return n_in + 1, n_in


def valid_edge_mask(n_layers: int, n_heads: int, parallel: bool = False,
                    split_qkv: bool = False) -> np.ndarray:
    """[src, dst] True where src writes before dst reads.

    src index: 0 input, 1 + l*(H+1) + h head, 1 + l*(H+1) + H MLP. dst index: layer l's head
    inputs from l*S (S = H+1: one per head; split, S = 3H+1: the H query, H key, H value
    inputs), its MLP at l*S + S-1, the logits at L*S. With ``parallel`` an MLP reads what its
    layer's heads read (not their writes).
    """
    stride = n_heads + 1
    d_stride, n_in = _dst_layout(n_heads, split_qkv)
    n_src = 1 + n_layers * stride
    n_dst = n_layers * d_stride + 1
    valid = np.zeros((n_src, n_dst), dtype=bool)
    for layer in range(n_layers):
        base, dbase = layer * stride, layer * d_stride
        valid[:1 + base, dbase:dbase + n_in] = True         # heads read earlier layers
        # the MLP reads its own layer's heads, or (parallel) only what they read
        valid[:1 + base + (0 if parallel else n_heads), dbase + n_in] = True
    valid[:, n_dst - 1] = True                               # logits read everything
    return valid


def circuit_graph(model: Model, *, split_qkv: bool = False) -> CircuitGraph:
    """The head/MLP graph of ``model`` (see the module docstring for which edges exist);
    ``split_qkv``: each head's query, key and value inputs are separate destinations."""
    check_engine_family(model)  # raises for unsupported families
    return _graph(model.n_layers, model.spec.n_heads, parallel_attn_mlp(model),
                  _check_bool("split_qkv", split_qkv))


def _check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"`{name}` must be True or False; got {value!r}.")
    return bool(value)
