"""Representation shattering: knowledge editing on a transformer trained on a cyclic knowledge graph.

Nishi et al. (ICML 2025) train a small transformer from scratch on random walks over a
synthetic knowledge graph whose entities sit on several cyclic orders, with relations "k
steps clockwise / anticlockwise" (k = 1..4) on each order. The entity representations then
form rings. A knowledge edit (ROME, MEMIT, ...) that rewrites one fact distorts these
rings: the pairwise-distance matrix ``D`` of the entity representations moves away from
the unedited ``D0``. The shattering ratio ``R = ||D* - D0||_F / ||D0||_F`` grows with the
counterfactual distance of the edit (how far along the cycle the new object is from the
true one) and tracks the loss of accuracy on facts that were not edited.

This module holds the graph generator (`knowledge_graph`, `random_walks`), the model
(`KnowledgeGPT`) and its training (`train_knowledge_model`), storage of a trained model as
safetensors in the cache folder (`save_knowledge_model`, `load_knowledge_model`,
`knowledge_model`), accuracy on direct recall / logical / compositional inference
(`fact_accuracy`), three edit methods (`rome_edit`: the closed-form rank-one update at one
MLP; `memit_edit` / `memit_edits`: MEMIT's least-squares update of one or several facts,
spread over the MLPs of several blocks; `finetune_edit`: gradient steps on one MLP only),
the shattering ratio
(`shattering_ratio`, `entity_representations`, `edit_embedding`) and the sweep of many
edits (`edit_sweep`, cached by `stored_edit_sweep`).

References
----------
K. Nishi, R. Ramesh, M. Okawa, M. Khona, H. Tanaka, E. S. Lubana, "Representation
Shattering in Transformers: A Synthetic Study with Knowledge Editing", ICML 2025.
K. Meng, D. Bau, A. Andonian, Y. Belinkov, "Locating and Editing Factual Associations in
GPT" (ROME), NeurIPS 2022.
K. Meng, A. S. Sharma, A. Andonian, Y. Belinkov, D. Bau, "Mass-Editing Memory in a
Transformer" (MEMIT), ICLR 2023.
"""
from __future__ import annotations

import copy
import hashlib
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xarray as xr
from torch import nn

from explorer._checks import InputError, check_choice, check_float, check_int

__all__ = [
    "CITATION",
    "DEFAULTS",
    "EDIT_METHODS",
    "SPLITS",
    "KnowledgeGraph",
    "knowledge_graph",
    "random_walks",
    "KnowledgeGPT",
    "KnowledgeModel",
    "train_knowledge_model",
    "save_knowledge_model",
    "load_knowledge_model",
    "knowledge_model",
    "is_stored",
    "fact_accuracy",
    "entity_representations",
    "distance_matrix",
    "shattering_ratio",
    "key_covariance",
    "rome_update",
    "memit_update",
    "KnowledgeEdit",
    "counterfactual_target",
    "rome_edit",
    "memit_edits",
    "memit_edit",
    "finetune_edit",
    "edit_fact",
    "edited_model",
    "edit_embedding",
    "PROJECTIONS",
    "edit_sweep",
    "stored_edit_sweep",
    "sweep_summary",
]

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

_MODEL_FORMAT = 1


# -- knowledge graph ------------------------------------------------------------------

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


# -- model ----------------------------------------------------------------------------

class _Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int, d_mlp: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = nn.MultiheadAttention(d_model, n_heads, batch_first=True)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.ModuleDict({"fc": nn.Linear(d_model, d_mlp), "proj": nn.Linear(d_mlp, d_model)})

    def mlp_keys(self, x: torch.Tensor) -> torch.Tensor:
        """The MLP's hidden activations: the "keys" its output projection reads."""
        return nn.functional.gelu(self.mlp["fc"](self.ln2(x)))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp["proj"](self.mlp_keys(x))


class KnowledgeGPT(nn.Module):
    """A GPT-style decoder (pre-LayerNorm, learned positions, GELU MLPs, untied unembedding).

    The MLP of block ``l`` is ``blocks[l].mlp``: ``fc`` (d_model -> d_mlp), GELU, ``proj``
    (d_mlp -> d_model). ROME edits ``proj.weight``.
    """

    def __init__(self, vocab_size: int, *, d_model: int = 128, n_layers: int = 2, n_heads: int = 4,
                 d_mlp: int = 512, n_ctx: int = 32) -> None:
        super().__init__()
        if d_model % n_heads:
            raise InputError(f"`d_model` must be divisible by `n_heads`; got {d_model} and {n_heads}.")
        self.config = {"vocab_size": vocab_size, "d_model": d_model, "n_layers": n_layers,
                       "n_heads": n_heads, "d_mlp": d_mlp, "n_ctx": n_ctx}
        self.embed = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(n_ctx, d_model)
        self.blocks = nn.ModuleList(_Block(d_model, n_heads, d_mlp) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.unembed = nn.Linear(d_model, vocab_size, bias=False)
        nn.init.normal_(self.embed.weight, std=0.02)
        nn.init.normal_(self.pos.weight, std=0.02)

    def forward(self, tokens: torch.Tensor, *, mlp_delta: tuple[int, int, torch.Tensor] | None = None,
                resid_layer: int | None = None) -> torch.Tensor:
        """Logits ``[batch, pos, vocab]``, or the residual stream after block ``resid_layer``.

        ``mlp_delta = (layer, pos, delta)`` adds ``delta`` [d_model] to that block's MLP
        output at one position (how ROME finds the value it writes).
        """
        t = tokens.shape[1]
        x = self.embed(tokens) + self.pos.weight[:t]                       # [batch, pos, d_model]
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool, device=tokens.device), 1)
        for i, block in enumerate(self.blocks):
            if mlp_delta is not None and mlp_delta[0] == i:
                h = block.ln1(x)
                x = x + block.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
                out = block.mlp["proj"](block.mlp_keys(x))
                bump = torch.zeros_like(out)
                bump[:, mlp_delta[1]] = mlp_delta[2]
                x = x + out + bump
            else:
                x = block(x, mask)
            if resid_layer == i:
                return x
        return self.unembed(self.ln_f(x))

    def mlp_keys(self, tokens: torch.Tensor, layer: int) -> torch.Tensor:
        """Hidden activations of block ``layer``'s MLP, ``[batch, pos, d_mlp]``."""
        t = tokens.shape[1]
        x = self.embed(tokens) + self.pos.weight[:t]
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool, device=tokens.device), 1)
        for i, block in enumerate(self.blocks):
            if i == layer:
                h = block.ln1(x)
                x = x + block.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
                return block.mlp_keys(x)
            x = block(x, mask)
        raise InputError(f"`layer` must be an int in [0, {len(self.blocks) - 1}]; got {layer}.")


@dataclass
class KnowledgeModel:
    """A trained `KnowledgeGPT` with its graph, training parameters and loss history."""

    model: KnowledgeGPT
    graph: KnowledgeGraph
    params: dict[str, Any]
    history: dict[str, list[float]] = field(default_factory=dict)
    train_seconds: float = 0.0

    @property
    def n_layers(self) -> int:
        return len(self.model.blocks)

    def weights_sha256(self) -> str:
        digest = hashlib.sha256()
        for name, tensor in sorted(self.model.state_dict().items()):
            digest.update(name.encode())
            digest.update(tensor.detach().float().contiguous().numpy().tobytes())
        return digest.hexdigest()[:32]


def _graph_from_params(params: dict[str, Any]) -> KnowledgeGraph:
    return knowledge_graph(params["n_entities"], params["n_orders"], max_hops=params["max_hops"],
                           heldout_fraction=params["heldout_fraction"], seed=params["seed"])


def _check_params(params: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(params) - set(DEFAULTS))
    if unknown:
        raise InputError(f"unknown training parameter {unknown[0]!r}; allowed: {', '.join(DEFAULTS)}.")
    full = {**DEFAULTS, **params}
    for name in ("n_entities", "n_orders", "max_hops", "walk_length", "d_model", "n_layers",
                 "n_heads", "d_mlp", "batch_size"):
        full[name] = check_int(name, full[name], low=1)
    full["steps"] = check_int("steps", full["steps"], low=0)
    full["seed"] = check_int("seed", full["seed"])
    full["lr"] = check_float("lr", full["lr"], low=0.0)
    full["weight_decay"] = check_float("weight_decay", full["weight_decay"], low=0.0)
    full["heldout_fraction"] = check_float("heldout_fraction", full["heldout_fraction"], low=0.0, high=0.45)
    if full["walk_length"] < 2:
        raise InputError(f"`walk_length` must be an int in [2, inf]; got {full['walk_length']}.")
    return full


def train_knowledge_model(*, progress: ProgressCallback | None = None, **params: Any) -> KnowledgeModel:
    """Train a `KnowledgeGPT` from scratch on random walks of a `knowledge_graph`.

    The loss is the cross-entropy of the next entity at every relation token of a walk
    (relations themselves are random and not predicted). AdamW with a linear warm-up over
    the first 5% of steps and a cosine decay; fresh walks every step.

    Parameters
    ----------
    progress : callable, optional
        ``progress(steps_done, steps)`` every 10 steps; returning ``False`` stops early.
    **params
        Keys of `DEFAULTS` (graph, model and optimiser settings; ``seed`` seeds all three).

    Returns
    -------
    KnowledgeModel
        ``history`` holds ``step`` and ``loss`` every 10 steps; ``train_seconds`` the time.
    """
    p = _check_params(params)
    graph = _graph_from_params(p)
    torch.manual_seed(p["seed"])
    n_ctx = 2 * p["walk_length"] - 1
    model = KnowledgeGPT(graph.n_entities + graph.n_relations, d_model=p["d_model"],
                         n_layers=p["n_layers"], n_heads=p["n_heads"], d_mlp=p["d_mlp"], n_ctx=n_ctx)
    opt = torch.optim.AdamW(model.parameters(), lr=p["lr"], weight_decay=p["weight_decay"],
                            betas=(0.9, 0.98))
    warm = max(1, p["steps"] // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (
        1 + math.cos(math.pi * min(1.0, s / max(1, p["steps"])))))
    rng = np.random.default_rng(p["seed"] + 1)
    history: dict[str, list[float]] = {"step": [], "loss": []}
    start = time.perf_counter()
    running = 0.0
    with torch.enable_grad():
        model.train()
        for step in range(1, p["steps"] + 1):
            walks = torch.as_tensor(random_walks(graph, p["batch_size"], p["walk_length"], rng=rng))
            logits = model(walks[:, :-1])                                  # [batch, pos, vocab]
            rel_pos = torch.arange(1, walks.shape[1] - 1, 2)                # relation tokens
            loss = nn.functional.cross_entropy(logits[:, rel_pos].reshape(-1, logits.shape[-1]),
                                               walks[:, rel_pos + 1].reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            running += loss.item()
            if step % 10 == 0 or step == p["steps"]:
                history["step"].append(step)
                history["loss"].append(running / (10 if step % 10 == 0 else step % 10))
                running = 0.0
                if progress is not None and progress(step, p["steps"]) is False:
                    break
    model.eval()
    return KnowledgeModel(model, graph, p, history, round(time.perf_counter() - start, 3))


# -- storage (safetensors, never pickle) -----------------------------------------------

def save_knowledge_model(km: KnowledgeModel, path: str | Path) -> Path:
    """Write the weights as safetensors; parameters and history go in its JSON metadata."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {"format": str(_MODEL_FORMAT), "params": json.dumps(km.params),
            "config": json.dumps(km.model.config), "history": json.dumps(km.history),
            "train_seconds": str(km.train_seconds), "citation": CITATION}
    tensors = {k: v.detach().contiguous().clone() for k, v in km.model.state_dict().items()}
    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp), metadata=meta)
    tmp.replace(path)
    return path


def load_knowledge_model(path: str | Path) -> KnowledgeModel:
    """Read a model written by `save_knowledge_model` (the graph is rebuilt from its seed)."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_file():
        raise InputError(f"no stored knowledge model at {str(path)!r}.")
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    if meta.get("format") != str(_MODEL_FORMAT):
        raise InputError(f"{str(path)!r} is not a knowledge model of format {_MODEL_FORMAT}.")
    params, config = json.loads(meta["params"]), json.loads(meta["config"])
    model = KnowledgeGPT(**config)
    model.load_state_dict(load_file(str(path)))
    model.eval()
    return KnowledgeModel(model, _graph_from_params(params), params, json.loads(meta["history"]),
                          float(meta["train_seconds"]))


def _model_path(store, params: dict[str, Any]) -> Path:
    key = store.key({"method": "knowledge_gpt", "format": _MODEL_FORMAT, **params})
    return Path(store.path) / "shattering" / f"{key}.safetensors"


def knowledge_model(*, store=None, retrain: bool = False, progress: ProgressCallback | None = None,
                    **params: Any) -> KnowledgeModel:
    """The trained model for ``params`` from the cache folder, or trained now and saved.

    Parameters
    ----------
    store : explorer.store.ActivationStore, optional
        Its folder holds ``shattering/<key>.safetensors``; default: the cache folder.
    retrain : bool, default=False
    **params
        Keys of `DEFAULTS`; missing ones take the defaults.
    """
    from explorer.store import ActivationStore

    full = _check_params(params)
    store = ActivationStore() if store is None else store
    path = _model_path(store, full)
    if path.is_file() and not retrain:
        return load_knowledge_model(path)
    km = train_knowledge_model(progress=progress, **full)
    if km.history["step"] and km.history["step"][-1] == full["steps"]:  # not cancelled
        save_knowledge_model(km, path)
    return km


def is_stored(*, store=None, **params: Any) -> bool:
    """Whether a trained model for ``params`` is in the cache folder."""
    from explorer.store import ActivationStore

    store = ActivationStore() if store is None else store
    return _model_path(store, _check_params(params)).is_file()


# -- evaluation ----------------------------------------------------------------------

def _fact_logits(model: KnowledgeGPT, graph: KnowledgeGraph) -> torch.Tensor:
    """Logits over entities after the prompt ``e r`` for every fact, ``[entity, relation, entity]``."""
    n, n_rel = graph.n_entities, graph.n_relations
    e = torch.arange(n).repeat_interleave(n_rel)
    r = torch.arange(n_rel).repeat(n) + n
    with torch.no_grad():
        logits = model(torch.stack([e, r], 1))[:, -1, :n]                  # [fact, entity]
    return logits.reshape(n, n_rel, n)


def fact_accuracy(km: KnowledgeModel, model: KnowledgeGPT | None = None, *,
                  exclude: Sequence[tuple[int, int]] = ()) -> xr.Dataset:
    """Top-1 accuracy on every fact ``e r -> e'``, by split.

    Parameters
    ----------
    km : KnowledgeModel
    model : KnowledgeGPT, optional
        An edited copy to score (default ``km.model``).
    exclude : sequence of (entity, relation)
        Facts left out of the split accuracies (the edited fact).

    Returns
    -------
    xarray.Dataset
        ``correct`` (entity, relation) bool; ``accuracy`` (split) over direct, logical,
        compositional facts and ``all``.
    """
    graph = km.graph
    model = km.model if model is None else model
    pred = _fact_logits(model, graph).argmax(-1).numpy()
    correct = pred == graph.objects()
    keep = np.ones_like(correct)
    for e, r in exclude:
        keep[e, r] = False
    acc = []
    for split in (*SPLITS, "all"):
        sel = keep & ((graph.split == split) if split != "all" else True)
        acc.append(float(correct[sel].mean()) if sel.any() else float("nan"))
    return xr.Dataset(
        {"correct": (("entity", "relation"), correct), "accuracy": (("split",), np.asarray(acc)),
         "prediction": (("entity", "relation"), pred)},
        coords={"entity": graph.entity_names, "relation": graph.relation_names,
                "split": [*SPLITS, "all"]},
        attrs=_attrs("fact_accuracy", km))


def entity_representations(model: KnowledgeGPT, n_entities: int, *, layer: int | None = None) -> torch.Tensor:
    """Residual stream after block ``layer`` (default: the last) at entity tokens on their own.

    Returns ``[entity, d_model]``: the prompt is the single entity token, so the rows are
    what any fact about that entity starts from.
    """
    n_layers = len(model.blocks)
    layer = n_layers - 1 if layer is None else check_int("layer", layer, low=0, high=n_layers - 1)
    with torch.no_grad():
        return model(torch.arange(n_entities)[:, None], resid_layer=layer)[:, 0]


def distance_matrix(reps: torch.Tensor | np.ndarray) -> np.ndarray:
    """Pairwise Euclidean distances between rows, ``[entity, entity]`` (float64)."""
    x = np.asarray(reps, dtype=np.float64)
    sq = (x * x).sum(1)
    d2 = np.maximum(sq[:, None] + sq[None, :] - 2 * x @ x.T, 0.0)
    np.fill_diagonal(d2, 0.0)
    return np.sqrt(d2)


def shattering_ratio(d0: np.ndarray, d_edit: np.ndarray) -> float:
    """``R = ||D* - D0||_F / ||D0||_F`` (Nishi et al., ICML 2025)."""
    d0, d_edit = np.asarray(d0, dtype=np.float64), np.asarray(d_edit, dtype=np.float64)
    if d0.shape != d_edit.shape or d0.ndim != 2:
        raise InputError(f"distance matrices must be 2-D and of one shape; got {d0.shape} and {d_edit.shape}.")
    norm = np.linalg.norm(d0)
    if norm == 0:
        raise InputError("the unedited distance matrix is all zero; R is undefined.")
    return float(np.linalg.norm(d_edit - d0) / norm)


# -- edits ---------------------------------------------------------------------------

def key_covariance(km: KnowledgeModel, layer: int, *, n_walks: int = 2000, seed: int = 0) -> torch.Tensor:
    """Second moment ``C = E[k k^T]`` of block ``layer``'s MLP keys over random walks.

    ROME's covariance over "generic text"; here every position of ``n_walks`` fresh walks.
    """
    layer = check_int("layer", layer, low=0, high=km.n_layers - 1)
    n_walks = check_int("n_walks", n_walks, low=1)
    walks = torch.as_tensor(random_walks(km.graph, n_walks, km.params["walk_length"],
                                         rng=np.random.default_rng(seed + 12345)))
    with torch.no_grad():
        keys = km.model.mlp_keys(walks, layer).reshape(-1, km.model.config["d_mlp"]).double()
    return keys.T @ keys / keys.shape[0]                                    # [d_mlp, d_mlp]


def rome_update(weight: torch.Tensor, cov: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """ROME's rank-one change ``Δ`` with ``(W + Δ) k* = v*``, minimising ``Δ`` in the C-norm.

    ``Δ = (v* - W k*) (C^{-1} k*)^T / ((C^{-1} k*)^T k*)`` (Meng et al., NeurIPS 2022, eq. 2).
    Keys ``k`` with ``(C^{-1} k*)^T k = 0`` are mapped as before.

    Parameters
    ----------
    weight : torch.Tensor, shape (d_out, d_in)
    cov : torch.Tensor, shape (d_in, d_in)
        Key second moment (symmetric positive definite).
    key, value : torch.Tensor, shapes (d_in,), (d_out,)
    """
    if weight.ndim != 2 or cov.shape != (weight.shape[1], weight.shape[1]) \
            or key.shape != (weight.shape[1],) or value.shape != (weight.shape[0],):
        raise InputError(f"shapes must be W (d_out, d_in), C (d_in, d_in), k (d_in,), v (d_out,); got "
                         f"{tuple(weight.shape)}, {tuple(cov.shape)}, {tuple(key.shape)}, {tuple(value.shape)}.")
    w, c, k, v = (t.double() for t in (weight, cov, key, value))
    u = torch.linalg.solve(c, k)                                            # C^{-1} k*
    denom = u @ k
    if not torch.isfinite(denom) or denom <= 0:
        raise InputError("the key covariance is singular along the edited key; ROME is undefined.")
    return (torch.outer(v - w @ k, u) / denom).to(weight.dtype)


@dataclass
class KnowledgeEdit:
    """One edit: new object for ``(entity, relation)`` and the parameter changes that make it."""

    entity: int
    relation: int
    true_object: int
    new_object: int
    distance: int
    method: str
    layer: int
    delta: dict[str, torch.Tensor]
    info: dict[str, Any] = field(default_factory=dict)


def counterfactual_target(graph: KnowledgeGraph, entity: int, relation: int, distance: int) -> int:
    """The entity ``distance`` steps (clockwise) from the true object, on the relation's cycle."""
    n = graph.n_entities
    entity = check_int("entity", entity, low=0, high=n - 1)
    relation = check_int("relation", relation, low=0, high=graph.n_relations - 1)
    distance = check_int("distance", distance, low=1, high=n - 1)
    o, _ = graph.relations[relation]
    return graph.step(int(graph.objects()[entity, relation]), o, distance)


def _target_value(km: KnowledgeModel, layer: int, prompt: torch.Tensor, target: int, *, pos: int,
                  steps: int = 100, lr: float = 0.5, l2: float = 0.01) -> tuple[torch.Tensor, float]:
    """ROME's v*: the MLP output at position ``pos`` that makes ``target`` the next token.

    Optimises an additive change δ to the MLP output at that position for
    ``-log p(target) + l2 ||δ||² / ||v0||²``, with Adam (ROME's learning rate, 0.5).
    """
    model = km.model
    d = model.config["d_model"]
    delta = torch.zeros(d, requires_grad=True)
    opt = torch.optim.Adam([delta], lr=lr)
    with torch.no_grad():
        v0 = model.blocks[layer].mlp["proj"](model.mlp_keys(prompt, layer))[0, pos]
    scale = float(v0.norm() ** 2) + 1e-8
    for _ in range(steps):
        logits = model(prompt, mlp_delta=(layer, pos, delta))[0, -1, :km.graph.n_entities]
        logp = torch.log_softmax(logits, -1)[target]
        loss = -logp + l2 * (delta @ delta) / scale
        opt.zero_grad()
        loss.backward()
        opt.step()
        if logp.item() > math.log(0.99):
            break
    return (v0 + delta.detach()), math.exp(logp.item())


def rome_edit(km: KnowledgeModel, entity: int, relation: int, new_object: int, *, layer: int = 0,
              cov: torch.Tensor | None = None, steps: int = 100, position: str = "last") -> KnowledgeEdit:
    """ROME at block ``layer``'s MLP output projection: ``e r -> new_object``.

    The key k* is the MLP's hidden activation in the prompt ``e r`` at the relation token
    (``position="last"``, the default) or at the entity (``"subject"``, ROME's choice for
    multi-token subjects); v* comes from `_target_value`; the update is `rome_update`.
    In the two-token prompt the subject's MLP output reaches the answer only through one
    attention read in the next block, which here cannot carry a new object (the best v*
    found gives it p ~ 0.1); after the first block's attention, the relation token's key
    holds both the entity and the relation, and an edit there succeeds.
    """
    layer = check_int("layer", layer, low=0, high=km.n_layers - 1)
    check_choice("position", position, ["last", "subject"])
    pos = 1 if position == "last" else 0
    prompt = torch.tensor([[entity, km.graph.n_entities + relation]])
    cov = key_covariance(km, layer) if cov is None else cov
    with torch.enable_grad():
        value, p_opt = _target_value(km, layer, prompt, new_object, pos=pos, steps=steps)
    with torch.no_grad():
        key = km.model.mlp_keys(prompt, layer)[0, pos]
        proj = km.model.blocks[layer].mlp["proj"]
        # The layer computes W k + b: W must map k* to v* - b.
        delta = rome_update(proj.weight, cov, key, value - proj.bias)
    return KnowledgeEdit(entity, relation, -1, new_object, 0, "rome", layer,
                         {f"blocks.{layer}.mlp.proj.weight": delta},
                         {"p_target_at_value": p_opt, "key": key, "value": value, "position": position})


def finetune_edit(km: KnowledgeModel, entity: int, relation: int, new_object: int, *, layer: int = 0,
                  steps: int = 100, lr: float = 2e-3) -> KnowledgeEdit:
    """Fine-tune block ``layer``'s MLP (both matrices and biases) on ``e r -> new_object``.

    Adam on the cross-entropy of the new object for at most ``steps`` steps (stops once its
    probability passes 0.99); every other parameter stays frozen.
    """
    layer = check_int("layer", layer, low=0, high=km.n_layers - 1)
    steps = check_int("steps", steps, low=1)
    lr = check_float("lr", lr, low=0.0)
    model = copy.deepcopy(km.model)
    mlp = model.blocks[layer].mlp
    for par in model.parameters():
        par.requires_grad_(False)
    names = [f"blocks.{layer}.mlp.{n}" for n, _ in mlp.named_parameters()]
    for par in mlp.parameters():
        par.requires_grad_(True)
    opt = torch.optim.Adam(mlp.parameters(), lr=lr)
    prompt = torch.tensor([[entity, km.graph.n_entities + relation]])
    target = torch.tensor([new_object])
    p = 0.0
    with torch.enable_grad():
        for _ in range(steps):
            logits = model(prompt)[:, -1, :km.graph.n_entities]
            loss = nn.functional.cross_entropy(logits, target)
            opt.zero_grad()
            loss.backward()
            opt.step()
            p = math.exp(-loss.item())
            if p > 0.99:
                break
    before = dict(km.model.named_parameters())
    after = dict(model.named_parameters())
    delta = {n: (after[n] - before[n]).detach() for n in names}
    return KnowledgeEdit(entity, relation, -1, new_object, 0, "finetune", layer, delta,
                         {"p_target_before_last_step": p})


def memit_update(cov: torch.Tensor, keys: torch.Tensor, residuals: torch.Tensor) -> torch.Tensor:
    """MEMIT's least-squares change of one layer: ``Δ = R K^T (C + K K^T)^{-1}``.

    ``Δ`` minimises ``||Δ K - R||_F² + tr(Δ C Δ^T)``: it writes the residuals ``R`` on the
    edited keys ``K`` while staying small on the keys the layer usually sees (C-norm)
    (Meng et al., ICLR 2023, eq. 14). By the Woodbury identity
    ``Δ = R (I + K^T C^{-1} K)^{-1} K^T C^{-1}``, so keys ``x`` with ``K^T C^{-1} x = 0``
    (C^{-1}-orthogonal to every edited key) are mapped as before, and for one key
    ``Δ k = r s / (1 + s)`` with ``s = k^T C^{-1} k``.

    Parameters
    ----------
    cov : torch.Tensor, shape (d_in, d_in)
        Key second moment C (symmetric positive definite).
    keys : torch.Tensor, shape (d_in, n_edits)
        Edited keys K, one column per edit (``n_edits`` may be 0).
    residuals : torch.Tensor, shape (d_out, n_edits)
        What the layer's output must gain on each key, R.

    Returns
    -------
    torch.Tensor, shape (d_out, d_in), float64
    """
    if cov.ndim != 2 or cov.shape[0] != cov.shape[1] or keys.ndim != 2 or residuals.ndim != 2 \
            or keys.shape[0] != cov.shape[0] or residuals.shape[1] != keys.shape[1]:
        raise InputError(f"shapes must be C (d_in, d_in), K (d_in, n_edits), R (d_out, n_edits); got "
                         f"{tuple(cov.shape)}, {tuple(keys.shape)}, {tuple(residuals.shape)}.")
    c, k, r = (t.double() for t in (cov, keys, residuals))
    if k.shape[1] == 0:
        return torch.zeros(r.shape[0], c.shape[0], dtype=torch.float64)
    # Δ (C + K K^T) = R K^T; C + K K^T is symmetric, so solve for Δ^T.
    return torch.linalg.solve(c + k @ k.T, k @ r.T).T


def memit_edits(km: KnowledgeModel, requests: Sequence[tuple[int, int, int]], *, layer: int | None = None,
                layers: Sequence[int] | None = None, covs: dict[int, torch.Tensor] | None = None,
                steps: int = 100, position: str = "last") -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """MEMIT (Meng et al., ICLR 2023): several facts ``(entity, relation, new_object)`` at once.

    1. For each fact, the target residual ``z_i = h_i^L + δ_i`` after the last critical block
       ``L`` (``layer``, default the last of ``layers``) at the key position, ``δ_i`` found as
       ROME's v* (`_target_value`: an additive change to block L's output there).
    2. For each block ``l`` of ``layers`` in increasing order, on the model edited so far: the
       keys ``K_l`` at that block's MLP, the remaining residuals ``r_i = z_i - h_i^L``, and
       the change ``Δ_l = R_l K_l^T (C_l + K_l K_l^T)^{-1}`` to its MLP output projection, with
       ``R_l = r / (number of blocks left, this one included)`` (`memit_update`).

    ``layers`` defaults to all blocks up to ``layer``; ``C_l`` is `key_covariance` of the
    unedited model (pass ``covs`` to reuse them). Returns the parameter changes (one entry
    per block of ``layers``, zero for no requests) and info (keys, targets, p at z, layers).
    """
    n_layers = km.n_layers
    if layers is None:
        top = n_layers - 1 if layer is None else check_int("layer", layer, low=0, high=n_layers - 1)
        layers = list(range(top + 1))
    layers = sorted({check_int("layers[i]", l, low=0, high=n_layers - 1) for l in layers})
    if not layers:
        raise InputError("`layers` must name at least one block; got none.")
    critical = layers[-1] if layer is None else check_int("layer", layer, low=0, high=n_layers - 1)
    if critical < layers[-1]:
        raise InputError(f"`layer` (the last critical block) must be >= every edited block; got {critical} "
                         f"with layers {layers}.")
    check_choice("position", position, ["last", "subject"])
    pos = 1 if position == "last" else 0
    n, n_rel = km.graph.n_entities, km.graph.n_relations
    for i, (e, r, t) in enumerate(requests):
        check_int(f"requests[{i}] entity", e, low=0, high=n - 1)
        check_int(f"requests[{i}] relation", r, low=0, high=n_rel - 1)
        check_int(f"requests[{i}] new object", t, low=0, high=n - 1)
    names = [f"blocks.{l}.mlp.proj.weight" for l in layers]
    delta = {name: torch.zeros_like(dict(km.model.named_parameters())[name]) for name in names}
    info: dict[str, Any] = {"layers": layers, "critical_layer": critical, "position": position,
                            "p_target_at_z": [], "targets": None}
    if not requests:
        return delta, info
    covs = {} if covs is None else dict(covs)
    for l in layers:
        if l not in covs:
            covs[l] = key_covariance(km, l)
    prompts = torch.tensor([[e, n + r] for e, r, _ in requests])             # [edit, 2]
    targets = []
    with torch.enable_grad():
        for i, (_, _, t) in enumerate(requests):
            value, p_opt = _target_value(km, critical, prompts[i:i + 1], int(t), pos=pos, steps=steps)
            with torch.no_grad():
                v0 = km.model.blocks[critical].mlp["proj"](km.model.mlp_keys(prompts[i:i + 1], critical))[0, pos]
            targets.append(value - v0)                                       # δ_i
            info["p_target_at_z"].append(p_opt)
    with torch.no_grad():
        z = km.model(prompts, resid_layer=critical)[:, pos].double() + torch.stack(targets).double()  # [edit, d_model]
        model = copy.deepcopy(km.model)
        for j, l in enumerate(layers):
            keys = model.mlp_keys(prompts, l)[:, pos].double()                # [edit, d_mlp]
            resid = z - model(prompts, resid_layer=critical)[:, pos].double()  # [edit, d_model]
            step = memit_update(covs[l], keys.T, resid.T / (len(layers) - j))
            proj = model.blocks[l].mlp["proj"]
            proj.weight.add_(step.to(proj.weight.dtype))
            delta[names[j]] = proj.weight.detach() - km.model.blocks[l].mlp["proj"].weight.detach()
        info["targets"] = z
        info["final_residual_norm"] = float((z - model(prompts, resid_layer=critical)[:, pos].double()).norm())
    return delta, info


def memit_edit(km: KnowledgeModel, entity: int, relation: int, new_object: int, *, layer: int = 0,
               layers: Sequence[int] | None = None, cov: torch.Tensor | dict[int, torch.Tensor] | None = None,
               steps: int = 100, position: str = "last") -> KnowledgeEdit:
    """MEMIT for one fact: `memit_edits` over ``layers`` (default: blocks 0..layer), with the
    critical block ``layer`` or the last of ``layers``, whichever is later.
    ``cov``: one tensor (one block) or a dict by block."""
    layer = check_int("layer", layer, low=0, high=km.n_layers - 1)
    if layers is not None:
        layers = [check_int("layers[i]", l, low=0, high=km.n_layers - 1) for l in layers]
        layer = max([layer, *layers])
    covs = cov
    if isinstance(cov, torch.Tensor):
        blocks = sorted(set(range(layer + 1) if layers is None else layers))
        if len(blocks) != 1:
            raise InputError(f"MEMIT over blocks {blocks} needs `cov` as a dict by block; got one tensor.")
        covs = {blocks[0]: cov}
    delta, info = memit_edits(km, [(entity, relation, new_object)], layer=layer, layers=layers, covs=covs,
                              steps=steps, position=position)
    return KnowledgeEdit(entity, relation, -1, new_object, 0, "memit", layer, delta, info)


#: Edit methods by name: ``method(km, entity, relation, new_object, layer=...)``.
EDIT_METHODS: dict[str, Callable[..., KnowledgeEdit]] = {"rome": rome_edit, "memit": memit_edit,
                                                          "finetune": finetune_edit}


def edit_fact(km: KnowledgeModel, entity: int, relation: int, distance: int, *, method: str = "rome",
              layer: int = 0, cov: torch.Tensor | dict[int, torch.Tensor] | None = None,
              layers: Sequence[int] | None = None) -> KnowledgeEdit:
    """A counterfactual edit: ``e r`` now points ``distance`` steps past its true object.

    ``layer`` is the edited block (ROME, fine-tuning) or MEMIT's last critical block;
    ``layers`` (MEMIT only) the blocks MEMIT spreads the edit over (default 0..layer).
    ``cov``: the key covariance (ROME), or a dict of them by block (MEMIT).
    """
    check_choice("method", method, EDIT_METHODS)
    graph = km.graph
    entity = check_int("entity", entity, low=0, high=graph.n_entities - 1)
    relation = check_int("relation", relation, low=0, high=graph.n_relations - 1)
    distance = check_int("distance", distance, low=1, high=graph.n_entities - 1)
    layer = check_int("layer", layer, low=0, high=km.n_layers - 1)
    new = counterfactual_target(graph, entity, relation, distance)
    if layers is not None and method != "memit":
        raise InputError(f"`layers` is for method 'memit' only; got method {method!r}.")
    kwargs: dict[str, Any] = {"cov": cov} if method in ("rome", "memit") else {}
    if method == "memit":
        kwargs["layers"] = layers
    edit = EDIT_METHODS[method](km, entity, relation, new, layer=layer, **kwargs)
    edit.true_object = int(graph.objects()[entity, relation])
    edit.distance = distance
    return edit


def edited_model(km: KnowledgeModel, edit: KnowledgeEdit, strength: float = 1.0) -> KnowledgeGPT:
    """A copy of the model with ``strength`` times the edit's parameter changes added."""
    strength = check_float("strength", strength)
    model = copy.deepcopy(km.model)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, delta in edit.delta.items():
            params[name].add_(strength * delta)
    return model


#: Projections offered by `edit_embedding`.
PROJECTIONS: tuple[str, ...] = ("pca", "isomap")


def edit_embedding(km: KnowledgeModel, edit: KnowledgeEdit, strengths: Sequence[float] = (0.0, 1.0), *,
                   layer: int | None = None, projection: str = "pca", n_components: int = 3,
                   n_neighbors: int = 8) -> xr.Dataset:
    """Entity representations along the edit, projected with a map fitted on the unedited ones.

    Parameters
    ----------
    strengths : sequence of float
        Multiples of the edit's parameter change (0 = unedited, 1 = the edit).
    layer : int, optional
        Block whose output is read (default: the last).
    projection : {"pca", "isomap"}, default="pca"
        ``"pca"``: the principal components of the unedited representations (each signed so
        that its largest loading is positive); every strength is projected on them.
        ``"isomap"``: scikit-learn's Isomap (Nishi et al.'s picture) fitted on the unedited
        representations with ``n_neighbors`` neighbours; edited ones are placed with its
        out-of-sample ``transform``.
    n_components : int, default=3
        Number of components kept (1 to min(entities - 1, d_model)).

    Returns
    -------
    xarray.Dataset
        ``projection`` (strength, entity, component) the projected coordinates (components
        ``PC1``, ``PC2``, ... or ``Isomap1``, ...); ``R`` (strength) the shattering ratio, on
        the full representations; ``cycle_position`` (order, entity) the place of each entity
        on each cycle; ``explained_variance_ratio`` (component), NaN for Isomap.
    """
    strengths = [check_float("strengths[i]", s) for s in strengths]
    check_choice("projection", projection, PROJECTIONS)
    n = km.graph.n_entities
    base = entity_representations(km.model, n, layer=layer).double().numpy()
    n_components = check_int("n_components", n_components, low=1, high=min(n - 1, base.shape[1]))
    reps_at = [base if a == 0.0 else entity_representations(edited_model(km, edit, a), n, layer=layer)
               .double().numpy() for a in strengths]
    d0 = distance_matrix(base)
    ratios = [shattering_ratio(d0, distance_matrix(reps)) for reps in reps_at]
    if projection == "pca":
        mean = base.mean(0)
        _, s, vt = np.linalg.svd(base - mean, full_matrices=False)
        basis = vt[:n_components]                                           # [component, d_model]
        rows = np.arange(n_components)
        basis = basis * np.sign(basis[rows, np.abs(basis).argmax(1)])[:, None]
        coords = [(reps - mean) @ basis.T for reps in reps_at]
        var = s ** 2
        ratio = var[:n_components] / var.sum()
        names = [f"PC{i + 1}" for i in range(n_components)]
    else:
        from sklearn.manifold import Isomap

        n_neighbors = check_int("n_neighbors", n_neighbors, low=2, high=n - 1)
        iso = Isomap(n_neighbors=n_neighbors, n_components=n_components).fit(base)
        coords = [iso.transform(reps) for reps in reps_at]
        ratio = np.full(n_components, np.nan)
        names = [f"Isomap{i + 1}" for i in range(n_components)]
    return xr.Dataset(
        {"projection": (("strength", "entity", "component"), np.asarray(coords)),
         "R": (("strength",), np.asarray(ratios)),
         "cycle_position": (("order", "entity"), km.graph.position),
         "explained_variance_ratio": (("component",), ratio)},
        coords={"strength": strengths, "entity": km.graph.entity_names, "component": names,
                "order": list(range(km.graph.orders.shape[0]))},
        attrs=_attrs("edit_embedding", km, {"strengths": strengths, "layer": layer, "projection": projection,
                                            "n_components": n_components,
                                            **({"n_neighbors": n_neighbors} if projection == "isomap" else {})},
                     edit=_edit_attrs(km, edit)))


def _edit_attrs(km: KnowledgeModel, edit: KnowledgeEdit) -> dict[str, Any]:
    g = km.graph
    return {"entity": g.entity_names[edit.entity], "relation": g.relation_names[edit.relation],
            "true_object": g.entity_names[edit.true_object], "new_object": g.entity_names[edit.new_object],
            "distance": edit.distance, "method": edit.method, "layer": edit.layer,
            "layers": [int(l) for l in edit.info.get("layers", [edit.layer])]}


# -- many edits ------------------------------------------------------------------------

def edit_sweep(km: KnowledgeModel, *, n_edits: int = 80, distances: Sequence[int] = (1, 2, 3, 4),
               method: str = "rome", layer: int = 0, layers: Sequence[int] | None = None, seed: int = 0,
               progress: ProgressCallback | None = None) -> xr.Dataset:
    """Many single counterfactual edits (each on the unedited model): R and accuracy drops.

    Edited facts are drawn at random from the correctly recalled direct facts; edit ``i``
    uses distance ``distances[i % len(distances)]``, so every distance gets the same
    number of edits. ``layer``: the edited block, or MEMIT's last critical block, with
    ``layers`` the blocks MEMIT spreads each edit over (default 0..layer).

    Returns
    -------
    xarray.Dataset
        Over ``edit``: ``entity``, ``relation``, ``distance``, ``R``, ``success`` (the edited
        fact now gives the new object), ``accuracy_after`` (edit, split) on all other facts;
        ``accuracy_before`` (split); ``accuracy_drop`` (edit, split). Attrs: the least-squares
        fit of the ``all`` accuracy drop on R (``slope``, ``intercept``, ``r2``) and
        ``R_by_distance`` (mean R per distance).
    """
    check_choice("method", method, EDIT_METHODS)
    n_edits = check_int("n_edits", n_edits, low=2)
    distances = [check_int("distances[i]", d, low=1, high=km.graph.n_entities - 1) for d in distances]
    if not distances:
        raise InputError("`distances` must hold at least one distance; got none.")
    layer = check_int("layer", layer, low=0, high=km.n_layers - 1)
    graph = km.graph
    base = fact_accuracy(km)
    base_correct = base["correct"].values
    candidates = np.argwhere((graph.split == "direct") & base_correct)
    if len(candidates) == 0:
        raise InputError("the model recalls no direct fact correctly; train it longer.")
    rng = np.random.default_rng(seed)
    picks = candidates[rng.choice(len(candidates), size=n_edits, replace=len(candidates) < n_edits)]
    if method == "memit":
        layers = sorted({check_int("layers[i]", l, low=0, high=km.n_layers - 1)
                         for l in (range(layer + 1) if layers is None else layers)})
        cov: Any = {l: key_covariance(km, l) for l in layers}
    elif layers is not None:
        raise InputError(f"`layers` is for method 'memit' only; got method {method!r}.")
    else:
        cov = key_covariance(km, layer) if method == "rome" else None
    n = graph.n_entities
    d0 = distance_matrix(entity_representations(km.model, n))
    rows: dict[str, list] = {k: [] for k in ("entity", "relation", "distance", "new_object", "R",
                                             "success", "before", "after")}
    for i, (e, r) in enumerate(picks):
        dist = distances[i % len(distances)]
        edit = edit_fact(km, int(e), int(r), dist, method=method, layer=layer, cov=cov, layers=layers)
        model = edited_model(km, edit)
        acc = fact_accuracy(km, model, exclude=[(int(e), int(r))])
        before = _split_accuracy(graph, base_correct, (int(e), int(r)))
        rows["entity"].append(int(e))
        rows["relation"].append(int(r))
        rows["distance"].append(dist)
        rows["new_object"].append(edit.new_object)
        rows["R"].append(shattering_ratio(d0, distance_matrix(entity_representations(model, n))))
        rows["success"].append(int(acc["prediction"].values[e, r]) == edit.new_object)
        rows["before"].append(before)
        rows["after"].append(acc["accuracy"].values)
        if progress is not None and progress(i + 1, n_edits) is False:
            break
    R = np.asarray(rows["R"])
    before = np.asarray(rows["before"])
    after = np.asarray(rows["after"])
    drop = before - after                                                   # [edit, split]
    fit = _linear_fit(R, drop[:, -1])
    by_distance = {int(d): float(R[np.asarray(rows["distance"]) == d].mean())
                   for d in sorted(set(rows["distance"]))}
    drop_by_distance = {int(d): float(drop[np.asarray(rows["distance"]) == d, -1].mean())
                        for d in sorted(set(rows["distance"]))}
    return xr.Dataset(
        {"entity": (("edit",), np.asarray(rows["entity"])),
         "relation": (("edit",), np.asarray(rows["relation"])),
         "distance": (("edit",), np.asarray(rows["distance"])),
         "new_object": (("edit",), np.asarray(rows["new_object"])),
         "R": (("edit",), R), "success": (("edit",), np.asarray(rows["success"])),
         "accuracy_before": (("split",), base["accuracy"].values),
         "accuracy_after": (("edit", "split"), after),
         "accuracy_drop": (("edit", "split"), drop)},
        coords={"edit": np.arange(len(R)), "split": [*SPLITS, "all"]},
        attrs=_attrs("edit_sweep", km, {"n_edits": n_edits, "distances": distances,
                                        "edit_method": method, "layer": layer, "sweep_seed": seed,
                                        **({"layers": list(layers)} if method == "memit" else {})},
                     **fit,
                     R_by_distance={str(k): v for k, v in by_distance.items()},
                     accuracy_drop_by_distance={str(k): v for k, v in drop_by_distance.items()},
                     success_rate=float(np.mean(rows["success"]))))


def _split_accuracy(graph: KnowledgeGraph, correct: np.ndarray, skip: tuple[int, int]) -> np.ndarray:
    keep = np.ones_like(correct)
    keep[skip] = False
    return np.asarray([correct[keep & ((graph.split == s) if s != "all" else True)].mean()
                       for s in (*SPLITS, "all")])


def _linear_fit(x: np.ndarray, y: np.ndarray) -> dict[str, float]:
    """Least-squares line ``y = slope x + intercept`` and its r²."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    if len(x) < 2 or np.ptp(x) == 0:
        return {"slope": float("nan"), "intercept": float("nan"), "r2": float("nan")}
    slope, intercept = np.polyfit(x, y, 1)
    resid = y - (slope * x + intercept)
    ss_tot = float(((y - y.mean()) ** 2).sum())
    r2 = 1 - float((resid ** 2).sum()) / ss_tot if ss_tot > 0 else float("nan")
    return {"slope": float(slope), "intercept": float(intercept), "r2": r2}


def stored_edit_sweep(km: KnowledgeModel, *, store=None, progress: ProgressCallback | None = None,
                      **options: Any) -> xr.Dataset:
    """`edit_sweep` from the store, or computed and stored (keyed by the model's weights)."""
    from explorer.store import ActivationStore

    store = ActivationStore() if store is None else store
    opts = {"n_edits": 80, "distances": [1, 2, 3, 4], "method": "rome", "layer": 0, "seed": 0, **options}
    opts["distances"] = [int(d) for d in opts["distances"]]
    if opts.get("layers") is not None:
        opts["layers"] = sorted({int(l) for l in opts["layers"]})
    else:
        opts.pop("layers", None)   # no key change for sweeps stored before MEMIT
    parts = {"method": "shattering_edit_sweep", "format": 1, "params": km.params,
             "weights_sha256": km.weights_sha256(), **{f"sweep_{k}": v for k, v in opts.items()}}
    return store.get_or_compute(parts, lambda: edit_sweep(km, progress=progress, **opts)).load()


def sweep_summary(sweep: xr.Dataset) -> dict[str, Any]:
    """Headline numbers of an `edit_sweep`, JSON-able."""
    a = sweep.attrs
    return {"method": a["params"]["edit_method"], "n_edits": int(sweep.sizes["edit"]),
            "layer": a["params"]["layer"], **({"layers": list(a["params"]["layers"])}
                                              if "layers" in a["params"] else {}),
            "success_rate": a["success_rate"],
            "accuracy_before": dict(zip(sweep["split"].values.tolist(),
                                        map(float, sweep["accuracy_before"].values))),
            "mean_accuracy_drop": dict(zip(sweep["split"].values.tolist(),
                                           map(float, sweep["accuracy_drop"].mean("edit").values))),
            "r2": a["r2"], "slope": a["slope"], "intercept": a["intercept"],
            "R_by_distance": a["R_by_distance"], "accuracy_drop_by_distance": a["accuracy_drop_by_distance"]}


def _attrs(method: str, km: KnowledgeModel, params: dict[str, Any] | None = None,
           **results: Any) -> dict[str, Any]:
    import explorer

    return {**results, "method": method, "model": "knowledge_gpt", "model_params": dict(km.params),
            "params": params or {}, "seed": km.params["seed"], "citation": CITATION,
            "versions": {"explorer": getattr(explorer, "__version__", "0"), "torch": torch.__version__,
                         "numpy": np.__version__}}
