"""The cyclic knowledge graph of the shattering study: `KnowledgeGraph` (entities on several
cyclic orders, relations "k hops clockwise / anticlockwise", held-out facts for logical and
compositional inference), its generator `knowledge_graph` and `random_walks` over the trained
facts; also the study's defaults (`DEFAULTS`), fact splits (`SPLITS`) and `CITATION`.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from explorer._checks import InputError, check_choice, check_float, check_int

__all__ = ["CITATION", "DEFAULTS", "SPLITS", "KnowledgeGraph", "knowledge_graph", "random_walks"]


CITATION = ("K. Nishi, R. Ramesh, M. Okawa, M. Khona, H. Tanaka, E. S. Lubana, \"Representation "
            "Shattering in Transformers: A Synthetic Study with Knowledge Editing\", ICML 2025.")


#: A CPU-sized version of the paper's setting (METHODS.md section 3): the paper uses 2,048
#: entities, 3 orders and a 2-layer nanoGPT trained for 150k steps of batch 256. Strong weight
#: decay and a long run are what make this model infer held-out facts (docs/editing.md); with
#: weight decay 0.1 and 800 steps it only memorised the trained ones.
DEFAULTS: dict[str, Any] = {
    "n_entities": 64,
    "n_orders": 3,
    "max_hops": 4,
    "heldout_fraction": 0.1,
    "walk_length": 8,        # entities per walk: 8 entities + 7 relations = 15 tokens
    "d_model": 64,
    "n_layers": 2,
    "n_heads": 4,
    "d_mlp": 256,
    "steps": 12000,
    "batch_size": 64,
    "lr": 2e-3,
    "weight_decay": 2.0,
    "seed": 0,
}


#: Fact splits scored by `fact_accuracy`.
SPLITS: tuple[str, ...] = ("direct", "logical", "compositional")

ProgressCallback = Callable[[int, int], Any]


@dataclass(frozen=True)
class KnowledgeGraph:
    """Entities on ``n_orders`` cyclic orders; relations "k hops clockwise/anticlockwise".

    Attributes
    ----------
    orders : numpy.ndarray of int, shape (n_orders, n_entities)
        ``orders[o, i]`` is the entity at place ``i`` of cycle ``o``.
    position : numpy.ndarray of int, shape (n_orders, n_entities)
        ``position[o, e]``: the place of entity ``e`` on cycle ``o`` (inverse of ``orders``).
    relations : list of (order, hops) with hops in ``±1..±max_hops``
        Relation ``r`` maps ``e`` to the entity ``hops`` places further on cycle ``order``.
    split : numpy.ndarray of str, shape (n_entities, n_relations)
        ``"direct"`` (trained), ``"logical"`` (held out, its inverse trained) or
        ``"compositional"`` (held out with its inverse; only compositions are trained).
    """

    orders: np.ndarray
    position: np.ndarray
    relations: list[tuple[int, int]]
    split: np.ndarray
    seed: int

    @property
    def n_entities(self) -> int:
        return int(self.orders.shape[1])

    @property
    def n_relations(self) -> int:
        return len(self.relations)

    @property
    def relation_names(self) -> list[str]:
        return [f"{'ABCDEFGHIJKLMNOPQRSTUVWXYZ'[o % 26]}{h:+d}" for o, h in self.relations]

    @property
    def entity_names(self) -> list[str]:
        return [f"e{i}" for i in range(self.n_entities)]

    def relation_index(self, name: str) -> int:
        """The index of relation ``name`` (e.g. ``"A+1"``, ``"B-3"``)."""
        check_choice("relation", name, self.relation_names)
        return self.relation_names.index(name)

    def inverse(self, r: int) -> int:
        """The relation that undoes ``r`` (same order, opposite hops)."""
        o, h = self.relations[r]
        return self.relations.index((o, -h))

    def objects(self) -> np.ndarray:
        """``objects[e, r]``: the entity that relation ``r`` maps ``e`` to."""
        n = self.n_entities
        out = np.empty((n, self.n_relations), dtype=np.int64)
        for r, (o, h) in enumerate(self.relations):
            out[:, r] = self.orders[o, (self.position[o] + h) % n]
        return out

    def step(self, entity: int, order: int, hops: int) -> int:
        """The entity ``hops`` places from ``entity`` on cycle ``order``."""
        return int(self.orders[order, (self.position[order, entity] + hops) % self.n_entities])


def knowledge_graph(n_entities: int = DEFAULTS["n_entities"], n_orders: int = DEFAULTS["n_orders"], *,
                    max_hops: int = DEFAULTS["max_hops"],
                    heldout_fraction: float = DEFAULTS["heldout_fraction"],
                    seed: int = 0) -> KnowledgeGraph:
    """A random cyclic knowledge graph with held-out facts for the inference tests.

    Each order is a random permutation of the entities, read as a cycle. Facts come in
    inverse pairs ``(e, o+k, e')`` / ``(e', o-k, e)``. A ``heldout_fraction`` of the pairs
    loses one of its two facts at random (the lost fact is "logical": inferable from its
    inverse), another ``heldout_fraction`` loses both ("compositional": inferable only by
    composing other relations of the order, e.g. +2 = +1 then +1).

    Parameters
    ----------
    n_entities : int, default=64
    n_orders : int, default=3
    max_hops : int, default=4
    heldout_fraction : float, default=0.1
    seed : int, default=0
    """
    n_entities = check_int("n_entities", n_entities, low=2 * 4 + 1, high=100_000)
    n_orders = check_int("n_orders", n_orders, low=1, high=26)
    max_hops = check_int("max_hops", max_hops, low=1, high=(n_entities - 1) // 2)
    heldout_fraction = check_float("heldout_fraction", heldout_fraction, low=0.0, high=0.45)
    seed = check_int("seed", seed)
    rng = np.random.default_rng(seed)
    orders = np.stack([rng.permutation(n_entities) for _ in range(n_orders)])
    position = np.argsort(orders, axis=1)
    relations = [(o, s * k) for o in range(n_orders) for k in range(1, max_hops + 1) for s in (1, -1)]
    graph = KnowledgeGraph(orders, position, relations,
                           np.full((n_entities, len(relations)), "direct", dtype="<U13"), seed)
    objects = graph.objects()
    # One pair per (entity, clockwise relation): (e, +k) and its inverse (e', -k).
    pairs = [(e, r) for r, (o, h) in enumerate(relations) if h > 0 for e in range(n_entities)]
    chosen = rng.permutation(len(pairs))
    n_held = int(round(heldout_fraction * len(pairs)))
    for i, p in enumerate(chosen[:2 * n_held]):
        e, r = pairs[p]
        inv = (int(objects[e, r]), graph.inverse(r))
        if i < n_held:  # logical: drop one of the two, at random
            drop = (e, r) if rng.random() < 0.5 else inv
            graph.split[drop] = "logical"
        else:
            graph.split[e, r] = "compositional"
            graph.split[inv] = "compositional"
    return graph


def random_walks(graph: KnowledgeGraph, n_walks: int, walk_length: int = DEFAULTS["walk_length"], *,
                 rng: np.random.Generator) -> np.ndarray:
    """Random walks over the trained (direct) facts, as token ids.

    A walk is ``e0 r1 e1 r2 e2 ...`` with ``e_i = r_i(e_{i-1})`` (the paper's Algorithm 1);
    entity ids are ``0..n_entities-1``, relation ``r`` is token ``n_entities + r``. Each
    step picks uniformly among the trained relations of the current entity.

    Returns
    -------
    numpy.ndarray of int64, shape (n_walks, 2 * walk_length - 1)
    """
    n, n_rel = graph.n_entities, graph.n_relations
    objects = graph.objects()
    allowed = graph.split == "direct"                                   # [entity, relation]
    counts = allowed.sum(1)
    if (counts == 0).any():
        raise InputError("every entity needs at least one trained relation; lower `heldout_fraction`.")
    table = np.zeros((n, n_rel), dtype=np.int64)                        # allowed relations, packed left
    for e in range(n):
        rel = np.nonzero(allowed[e])[0]
        table[e, :len(rel)] = rel
    tokens = np.empty((n_walks, 2 * walk_length - 1), dtype=np.int64)
    cur = rng.integers(0, n, size=n_walks)
    tokens[:, 0] = cur
    for i in range(1, walk_length):
        pick = (rng.random(n_walks) * counts[cur]).astype(np.int64)
        rel = table[cur, pick]
        cur = objects[cur, rel]
        tokens[:, 2 * i - 1] = n + rel
        tokens[:, 2 * i] = cur
    return tokens
