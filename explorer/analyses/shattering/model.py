"""The model of the shattering study: `KnowledgeGPT` (a GPT-style decoder in plain torch),
`KnowledgeModel` (a trained one with its graph, parameters and loss history) and its training
from scratch on random walks (`train_knowledge_model`).
"""
from __future__ import annotations

import hashlib
import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from explorer._checks import InputError, check_float, check_int
from explorer.analyses.shattering.graph import (
    DEFAULTS,
    KnowledgeGraph,
    ProgressCallback,
    knowledge_graph,
    random_walks,
)

__all__ = ["KnowledgeGPT", "KnowledgeModel", "train_knowledge_model"]


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
