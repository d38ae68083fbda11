"""JuICE head selection: heads scored by additive scaling, the top K consistently helpful
across the three prompt types, and the search for the scaling strengths."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import xarray as xr

from explorer._checks import InputError, check_choice, check_float, check_int
from explorer.analyses.conflicts.facts import (CITATION, DIRECTIONS, ENHANCE_ALPHAS, Fact, Heads,
                                               PROMPT_KINDS, Progress, SUPPRESS_ALPHAS,
                                               _first_token, conflict_prompt)
from explorer.analyses.conflicts.runs import (_check_heads, _last_logits, juice_first_run,
                                              juice_logits, single_run_logits)
from explorer.interventions import AddHead, position_index
from explorer.models import Model
from explorer.trace import CleanRun, provenance

__all__ = ['juice_head_selection', 'selected_heads', 'juice_alpha_search']


def juice_head_selection(model: Model, facts: Sequence[Fact], *, direction: str = "parametric",
                         k: int = 5, enhance_alphas: Sequence[float] = ENHANCE_ALPHAS,
                         suppress_alphas: Sequence[float] = SUPPRESS_ALPHAS,
                         layers: Sequence[int] | None = None, prune: bool = False,
                         progress: Progress = None) -> xr.Dataset:
    """JuICE head scoring by additive scaling on a few examples (Li et al., ICML 2025).

    For each head and prompt type c, Delta+_c is the mean over ``enhance_alphas`` and facts
    of p(target | o_proj.out += alpha * h) - p(target), with p the probability of the
    target answer's first token (the memory answer for ``direction="parametric"``, the
    context answer for ``"context"``); Delta-_c likewise over ``suppress_alphas``. Heads
    with Delta_c > 0 for every c are ranked by the sum over c; the top ``k`` form S+ / S-.

    Each head takes one run per prompt type: the facts are repeated once per alpha in the
    batch and the run resumes from the clean residual at the head's layer, where adding
    ``alpha`` times the clean head output equals scaling the head by ``1 + alpha``.
    ``prune=True`` scores the prompt types in order (clean, substitution, coherent:
    shortest first) and drops a head from the later ones once it has failed the
    consistency test for both S+ and S-; the chosen heads are the same, the skipped
    entries hold NaN.

    Returns
    -------
    xr.Dataset
        ``delta_plus``, ``delta_minus`` (kind, layer, head); ``consistent_plus``,
        ``consistent_minus`` (layer, head) bool; ``plus_layer``, ``plus_head`` (rank) and
        ``minus_layer``, ``minus_head`` (rank): the chosen heads, -1 where fewer qualify.
        Layers not scored (and heads pruned) hold NaN.
    """
    facts = list(facts)
    if not facts:
        raise InputError("`facts` must hold at least one fact; got an empty list.")
    check_choice("direction", direction, DIRECTIONS)
    k = check_int("k", k, low=1, high=model.n_layers * model.spec.n_heads)
    enhance = [check_float("enhance_alphas[]", a) for a in enhance_alphas]
    suppress = [check_float("suppress_alphas[]", a) for a in suppress_alphas]
    if not enhance or not suppress:
        raise InputError("`enhance_alphas` and `suppress_alphas` must each hold at least one value.")
    layers = list(range(model.n_layers)) if layers is None else [model.check_layer(x) for x in layers]
    L, H, d = model.n_layers, model.spec.n_heads, model.spec.d_head
    n = len(facts)
    alphas = enhance + suppress
    n_a = len(alphas)
    target = [_first_token(model, f.memory if direction == "parametric" else f.context)
              for f in facts]
    tgt = torch.tensor(target * n_a)
    idx = torch.arange(n * n_a)
    delta = np.full((2, len(PROMPT_KINDS), L, H), np.nan)
    todo = [(layer, head) for layer in layers for head in range(H)]
    total = len(PROMPT_KINDS) * len(todo)
    done = 0
    for ki, kind in enumerate(PROMPT_KINDS):
        run1 = juice_first_run(model, [conflict_prompt(f, kind) for f in facts])
        p0 = torch.softmax(run1.logits, -1)[torch.arange(n), torch.tensor(target)]  # [fact]
        ids = run1.batch.token_ids
        big = model.batch_from_ids(ids * n_a)                      # alpha-major: [alpha*fact]
        clean = CleanRun(big, [r.repeat(n_a, 1, 1) for r in run1.clean.resid_pre],
                         run1.clean.logits[:0])
        rows, cols = position_index(big.lengths, big.width, None)
        scale = torch.tensor(alphas).repeat_interleave(n)[rows]   # [n_tokens]
        for layer, head in todo:
            z = run1.attn_z[layer].repeat(n_a, 1, 1)[rows, cols, head * d:(head + 1) * d]
            edit = AddHead(layer, head, (scale[:, None] * z).reshape(-1), alpha=1.0)
            lg = _last_logits(model, big, [edit], resume=clean)
            p = torch.softmax(lg, -1)[idx, tgt].reshape(n_a, n)
            gain = (p - p0[None]).mean(1).double()                 # [alpha]
            delta[0, ki, layer, head] = float(gain[:len(enhance)].mean())
            delta[1, ki, layer, head] = float(gain[len(enhance):].mean())
            done += 1
            if progress:
                progress(done, total)
        if prune:
            seen = np.nan_to_num(delta[:, :ki + 1], nan=-1.0) > 0   # [set, kind, layer, head]
            alive = seen.all(1).any(0)                               # [layer, head]
            kept = [(x, h) for x, h in todo if alive[x, h]]
            done += len(todo) - len(kept)
            todo = kept
    chosen = []
    consistent = []
    for si in range(2):
        dd = delta[si]                                        # [kind, layer, head]
        ok = np.all(np.nan_to_num(dd, nan=-1.0) > 0, axis=0)  # [layer, head]
        score = np.where(ok, np.nan_to_num(dd).sum(0), -np.inf)
        order = [int(i) for i in np.argsort(-score, axis=None, kind="stable") if ok.flat[i]][:k]
        heads = [divmod(i, H) for i in order] + [(-1, -1)] * (k - len(order))
        chosen.append(np.array(heads, dtype=int))
        consistent.append(ok)
    ds = xr.Dataset(
        {
            "delta_plus": (("kind", "layer", "head"), delta[0]),
            "delta_minus": (("kind", "layer", "head"), delta[1]),
            "consistent_plus": (("layer", "head"), consistent[0]),
            "consistent_minus": (("layer", "head"), consistent[1]),
            "plus_layer": ("rank", chosen[0][:, 0]),
            "plus_head": ("rank", chosen[0][:, 1]),
            "minus_layer": ("rank", chosen[1][:, 0]),
            "minus_head": ("rank", chosen[1][:, 1]),
        },
        coords={"kind": list(PROMPT_KINDS), "layer": np.arange(L), "head": np.arange(H),
                "rank": np.arange(k)},
        attrs=provenance(model, method="juice_head_selection", direction=direction, k=k,
                         enhance_alphas=enhance, suppress_alphas=suppress, layers=layers,
                         prune=prune, n_facts=n),
    )
    ds.attrs["citation"] = CITATION
    return ds


def selected_heads(selection: xr.Dataset) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(S+, S-) as lists of (layer, head) from a `juice_head_selection` Dataset.

    A pair (S+, S-): the two head lists the JuICE runs take as ``heads_plus`` and
    ``heads_minus``.
    """
    out = []
    for s in ("plus", "minus"):
        pairs = zip(selection[f"{s}_layer"].values.tolist(), selection[f"{s}_head"].values.tolist())
        out.append([(int(a), int(b)) for a, b in pairs if a >= 0])
    return out[0], out[1]


def juice_alpha_search(model: Model, facts: Sequence[Fact], heads_plus: Heads = (),
                       heads_minus: Heads = (), *, direction: str = "parametric",
                       alpha_s_grid: Sequence[float] = (0.0, 1.0, 2.0, 3.0),
                       alpha_l_grid: Sequence[float] = (0.0, 1.0, 2.0, 3.0, 4.0, 5.0),
                       kinds: Sequence[str] = ("substitution", "coherent"),
                       method: str = "juice", progress: Progress = None) -> xr.Dataset:
    """Pick alpha_s and alpha_l on held-out facts, as JuICE does on its validation split.

    For every (alpha_s, alpha_l) of the grid (the paper's: alpha_s in 0..3, alpha_l in
    0..5) the intervention (``method`` "juice": the dual run, or "single") runs on every
    fact and prompt type; ``accuracy`` is the share whose top next token is the first
    token of the target answer (memory for ``direction="parametric"``, context for
    ``"context"``) and ``target_prob`` its mean probability. The best pair maximises
    accuracy, then probability (attrs ``best_alpha_s``, ``best_alpha_l``). Run 1 is
    computed once per prompt type; every grid point resumes from it.

    Returns
    -------
    xr.Dataset
        ``accuracy``, ``target_prob`` (alpha_s, alpha_l).
    """
    facts = list(facts)
    if not facts:
        raise InputError("`facts` must hold at least one fact; got an empty list.")
    check_choice("direction", direction, DIRECTIONS)
    check_choice("method", method, ("juice", "single"))
    kinds = [check_choice("kind", x, PROMPT_KINDS) for x in kinds]
    if not kinds:
        raise InputError("`kinds` must name at least one prompt type.")
    grid_s = [check_float("alpha_s_grid[]", x) for x in alpha_s_grid]
    grid_l = [check_float("alpha_l_grid[]", x) for x in alpha_l_grid]
    if not grid_s or not grid_l:
        raise InputError("`alpha_s_grid` and `alpha_l_grid` must each hold at least one value.")
    plus = _check_heads(model, heads_plus, "heads_plus")
    minus = _check_heads(model, heads_minus, "heads_minus")
    run = juice_logits if method == "juice" else single_run_logits
    tgt = torch.tensor([_first_token(model, f.memory if direction == "parametric" else f.context)
                        for f in facts])
    idx = torch.arange(len(facts))
    acc = np.zeros((len(grid_s), len(grid_l)))
    prob = np.zeros_like(acc)
    total, done = len(kinds) * acc.size, 0
    for kind in kinds:
        run1 = juice_first_run(model, [conflict_prompt(f, kind) for f in facts])
        for i, a_s in enumerate(grid_s):
            for j, a_l in enumerate(grid_l):
                lg = run(model, None, plus, minus, alpha_l=a_l, alpha_s=a_s, run1=run1)
                acc[i, j] += float((lg.argmax(-1) == tgt).float().mean()) / len(kinds)
                prob[i, j] += float(torch.softmax(lg, -1)[idx, tgt].mean()) / len(kinds)
                done += 1
                if progress:
                    progress(done, total)
    best = max(((acc[i, j], prob[i, j], -i - j, i, j) for i in range(len(grid_s))
                for j in range(len(grid_l))))
    ds = xr.Dataset({"accuracy": (("alpha_s", "alpha_l"), acc),
                     "target_prob": (("alpha_s", "alpha_l"), prob)},
                    coords={"alpha_s": grid_s, "alpha_l": grid_l},
                    attrs=provenance(model, method="juice_alpha_search", direction=direction,
                                     intervention=method, heads_plus=plus, heads_minus=minus,
                                     kinds=kinds, n_facts=len(facts)))
    ds.attrs["best_alpha_s"] = grid_s[best[3]]
    ds.attrs["best_alpha_l"] = grid_l[best[4]]
    ds.attrs["citation"] = CITATION
    return ds
