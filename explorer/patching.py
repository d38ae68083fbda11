"""Activation patching: which activations carry the difference between two prompts.

A clean prompt and a corrupted one of the same token length (e.g. the indirect-object
pair "... John gave a drink to" / "... Mary gave a drink to") make the model give
different answers. Patching copies one activation (one site at one layer and position, or
one head) from one run into the other and measures how much of the answer moves with it
(Vig et al., NeurIPS 2020; Meng et al., "Locating and editing factual associations in
GPT", NeurIPS 2022; Wang et al., "Interpretability in the wild", ICLR 2023; Heimersheim &
Nanda, "How to use and interpret activation patching", 2024).

``direction="denoising"`` writes the clean run's activation into the corrupted run (which
components suffice to restore the answer); ``"noising"`` writes the corrupted run's
activation into the clean run (which are necessary to keep it). The metric is the
normalised logit difference (patched - corrupted) / (clean - corrupted) of an answer
token against an alternative at the last position, in both directions (1: the clean
run's difference, 0: the corrupted run's), or the answer's probability.

`activation_patching` runs two plain forwards (the clean and the corrupted prompt, keeping
every layer's activations) and then every cell of the grid as one copy of the target
prompt in a few batched traces: the copies resume from the target's cached residual at
the first layer any of them patches (`explorer.trace.CleanRun.repeat`), each copy with one
`explorer.interventions.Set` edit restricted to its row (``prompts=``), and only the last
position is unembedded. Cells are grouped by layer so that late layers' copies skip the
layers before them, in batches of at most ``batch_tokens`` tokens. A cell whose source
value equals the target's (every position before the first changed token) is not run: its
patched run is the unpatched one.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import torch
import xarray as xr

from ._checks import InputError, check_choice, check_int
from .interventions import Edit, Set
from .models import Batch, Model
from .trace import (CleanRun, TraceRequest, as_batch, check_edit_rows, check_edits, check_layers,
                    clean_run, progress_steps, provenance, run_batch)

__all__ = ["activation_patching", "PATCHING_KINDS", "PATCHING_METRICS",
           "PATCHING_DIRECTIONS"]

PATCHING_KINDS = ("resid_pre", "attn_out", "mlp_out", "heads", "heads_by_pos")
"""Grids: a site over (layer, pos); each head's output over (layer, head) at every position,
or over (layer, pos, head) one position at a time."""
PATCHING_METRICS = ("logit_diff", "prob")
PATCHING_DIRECTIONS = ("denoising", "noising")

# the site each grid writes: the attention output is the output projection of ``attn_z``
# (all heads at one position), a head's output its slice of ``attn_z``
_KIND_SITE = {"resid_pre": "resid_pre", "attn_out": "attn_z", "mlp_out": "mlp_out",
              "heads": "attn_z", "heads_by_pos": "attn_z"}
_KIND_DIMS = {"resid_pre": ("layer", "pos"), "attn_out": ("layer", "pos"),
              "mlp_out": ("layer", "pos"), "heads": ("layer", "head"),
              "heads_by_pos": ("layer", "pos", "head")}
CITATION = ("Heimersheim & Nanda, How to use and interpret activation patching (2024); "
            "Meng et al., NeurIPS 2022; Wang et al., ICLR 2023")


def activation_patching(model: Model, clean: Any, corrupt: Any, *, kind: str = "resid_pre",
                        metric: str = "logit_diff", direction: str = "denoising",
                        answer: Any = None, alternative: Any = None, layers: Any = None,
                        positions: Sequence[int] | None = None, edits: Sequence[Edit] = (),
                        batch_tokens: int = 8192, progress: Any = None) -> xr.Dataset:
    """Patch one activation at a time between a clean and a corrupted prompt; the answer's
    recovery per cell.

    Parameters
    ----------
    model : Model
    clean, corrupt : str or sequence of int
        One prompt each, as text or token ids, of the same number of tokens.
    kind : {"resid_pre", "attn_out", "mlp_out", "heads", "heads_by_pos"}, default="resid_pre"
        The grid: a site over (layer, pos); "heads" patches one head's output at every
        position, over (layer, head); "heads_by_pos" one head at one position, over (layer,
        pos, head). TransformerLens' ``get_act_patch_resid_pre``, ``_attn_out``,
        ``_mlp_out``, ``_attn_head_out_all_pos`` and ``_attn_head_out_by_pos``.
    metric : {"logit_diff", "prob"}, default="logit_diff"
        What ``effect`` holds: the normalised logit difference (patched - corrupted) /
        (clean - corrupted) of ``answer`` against ``alternative`` at the last position, or
        the patched run's probability of ``answer`` there.
    direction : {"denoising", "noising"}, default="denoising"
        Denoising writes the clean run's activation into the corrupted run; noising writes
        the corrupted run's into the clean run.
    answer, alternative : int or str, optional
        Token ids, or text of one token (" Mary"). Default: the clean run's top token, and
        the corrupted run's top token (its second where that is the answer).
    layers : int or sequence of int, optional
        Layers of the grid (default all).
    positions : sequence of int, optional
        Positions of the grid (negative from the end; default all). Not for "heads".
    edits : sequence of Edit
        Edits applied to every run (the clean, the corrupted and each patched one) before
        the patch; a ``prompts`` restriction may name row 0 only.
    batch_tokens : int, default=8192
        At most this many tokens (copies x prompt length) per batched trace.
    progress : bool or callable(done, total), optional

    Returns
    -------
    xarray.Dataset
        ``effect`` (the metric), ``logit_diff`` (the patched run's logit(answer) -
        logit(alternative)) and ``prob`` (its probability of ``answer``), over the grid's
        dims: (layer, pos), (layer, head) or (layer, pos, head). Coords ``token`` /
        ``token_id`` (pos: the clean prompt's) and ``corrupt_token`` / ``corrupt_token_id``.
        Attrs: provenance with the kind, metric, direction, site, prompts, answer and
        alternative, the positions where the prompts differ (``changed_positions``) and
        the two unpatched runs' values (``clean_logit_diff``, ``corrupt_logit_diff``,
        ``clean_prob``, ``corrupt_prob``).
    """
    kind = check_choice("kind", kind, PATCHING_KINDS)
    metric = check_choice("metric", metric, PATCHING_METRICS)
    direction = check_choice("direction", direction, PATCHING_DIRECTIONS)
    batch_tokens = check_int("batch_tokens", batch_tokens, low=1)
    clean_b, clean_text = _one_prompt(model, clean, "clean")
    corrupt_b, corrupt_text = _one_prompt(model, corrupt, "corrupt")
    n = clean_b.lengths[0]
    if corrupt_b.lengths[0] != n:
        raise InputError(
            f"`clean` and `corrupt` must have the same number of tokens; clean has {n} "
            f"({_tokens_text(clean_b)}), corrupt has {corrupt_b.lengths[0]} "
            f"({_tokens_text(corrupt_b)}).")
    changed = [p for p in range(n) if clean_b.token_ids[0][p] != corrupt_b.token_ids[0][p]]
    if not changed:
        raise InputError("`corrupt` has the same tokens as `clean`; change at least one token.")
    layers = check_layers(model, layers)
    if kind == "heads" and positions is not None:
        raise InputError("kind 'heads' patches every position; use kind 'heads_by_pos' to "
                         "patch one position at a time.")
    pos = _check_grid_positions(positions, n)
    base = _base_edits(edits)
    site = _KIND_SITE[kind]
    keep = () if site == "resid_pre" else (site,)

    runs = {"clean": clean_run(model, clean_b, edits=base, keep=keep),
            "corrupt": clean_run(model, corrupt_b, edits=base, keep=keep)}
    last = {k: r.logits[0, -1].float() for k, r in runs.items()}   # [vocab] each
    answer_id = _token_id(model, answer, "answer", default=int(last["clean"].argmax()))
    alt_default = [int(t) for t in last["corrupt"].topk(2).indices]
    alt_id = _token_id(model, alternative, "alternative",
                       default=alt_default[1] if alt_default[0] == answer_id else alt_default[0])
    if alt_id == answer_id:
        raise InputError(f"`alternative` must differ from `answer` (both are token {answer_id}"
                         f", {model.token_strings([answer_id])[0]!r}).")
    ids = torch.tensor([answer_id, alt_id])
    base_ld = {k: float(lg[ids[0]] - lg[ids[1]]) for k, lg in last.items()}
    base_prob = {k: float(torch.softmax(lg, -1)[answer_id]) for k, lg in last.items()}
    if metric == "logit_diff" and math.isclose(base_ld["clean"], base_ld["corrupt"],
                                               abs_tol=1e-6):
        raise InputError(
            f"the clean and corrupted runs give the same logit difference ({base_ld['clean']:.4g}"
            ") between the answer and the alternative, so the normalised metric is undefined; "
            "choose another alternative or corruption, or metric 'prob'.")

    source, target = ((runs["clean"], runs["corrupt"]) if direction == "denoising"
                      else (runs["corrupt"], runs["clean"]))
    cells = _cells(kind, layers, pos, model.spec.n_heads)
    ld, prob = _patched_runs(model, cells, kind, source, target, base, ids, batch_tokens,
                             progress)
    effect = (ld - base_ld["corrupt"]) / (base_ld["clean"] - base_ld["corrupt"]) \
        if metric == "logit_diff" else prob
    return _dataset(model, kind, cells, layers, pos, effect, ld, prob, clean_b, corrupt_b,
                    attrs=dict(
                        edits=base, kind=kind, metric=metric, direction=direction, site=site,
                        clean=clean_text, corrupt=corrupt_text,
                        clean_ids=clean_b.token_ids[0], corrupt_ids=corrupt_b.token_ids[0],
                        answer_id=answer_id, alternative_id=alt_id,
                        answer=model.token_strings([answer_id])[0],
                        alternative=model.token_strings([alt_id])[0],
                        changed_positions=changed, layers=layers, positions=pos,
                        clean_logit_diff=base_ld["clean"],
                        corrupt_logit_diff=base_ld["corrupt"],
                        clean_prob=base_prob["clean"], corrupt_prob=base_prob["corrupt"],
                        batch_tokens=batch_tokens))


def _one_prompt(model: Model, prompt: Any, name: str) -> tuple[Batch, str | None]:
    """One prompt given as text or token ids, as a batch of one (ids checked in the vocab)."""
    if isinstance(prompt, str):
        if not prompt:
            raise InputError(f"`{name}` is empty; give a prompt.")
        return as_batch(model, prompt)[0], prompt
    if isinstance(prompt, torch.Tensor | np.ndarray):
        prompt = prompt.reshape(-1).tolist()
    if not isinstance(prompt, Sequence) or not all(
            isinstance(t, int | np.integer) and not isinstance(t, bool) for t in prompt):
        raise TypeError(f"`{name}` must be a prompt (str) or a list of token ids; got "
                        f"{type(prompt).__name__}.")
    if not prompt:
        raise InputError(f"`{name}` holds no tokens.")
    bad = [int(t) for t in prompt if not 0 <= int(t) < model.vocab_size]
    if bad:
        raise InputError(f"`{name}` holds token id {bad[0]}, outside [0, {model.vocab_size}).")
    return as_batch(model, [[int(t) for t in prompt]])[0], None


def _tokens_text(b: Batch) -> str:
    return "|".join(b.tokens[0])


def _check_grid_positions(positions: Sequence[int] | None, n: int) -> list[int]:
    """The grid's positions as distinct indices in [0, n), in the order given."""
    if positions is None:
        return list(range(n))
    if isinstance(positions, int | np.integer):
        positions = [positions]
    if isinstance(positions, str | bytes) or not isinstance(positions, Sequence):
        raise TypeError(f"`positions` must be a list of ints; got {type(positions).__name__}.")
    out = []
    for i, p in enumerate(positions):
        p = check_int(f"positions[{i}]", p, low=-n, high=n - 1)
        out.append(p + n if p < 0 else p)
    if not out:
        raise InputError("`positions` is empty; pass None for every position.")
    if len(set(out)) != len(out):
        raise InputError(f"`positions` names position {next(p for i, p in enumerate(out) if p in out[:i])}"
                         " twice.")
    return out


def _base_edits(edits: Sequence[Edit]) -> list[Edit]:
    """The run's own edits, applying to every copy (row 0 of one prompt is every row)."""
    edits = check_edits(edits)
    check_edit_rows(edits, 1)
    return [replace(e, prompts=None) if getattr(e, "prompts", None) is not None else e
            for e in edits]


def _token_id(model: Model, token: Any, name: str, *, default: int) -> int:
    """A token id from an int or one token's text; ``default`` for None."""
    if token is None:
        return default
    if isinstance(token, str):
        ids = model.tokenizer(token, add_special_tokens=False)["input_ids"]
        if len(ids) != 1:
            raise InputError(f"`{name}` must be one token; {token!r} is {len(ids)} tokens "
                             f"({'|'.join(model.token_strings(ids))}).")
        return int(ids[0])
    return check_int(name, token, low=0, high=model.vocab_size - 1)


def _cells(kind: str, layers: list[int], pos: list[int], n_heads: int) -> list[tuple]:
    """The grid's cells in layer order: (layer, pos), (layer, head) or (layer, pos, head)."""
    if kind == "heads":
        return [(layer, h) for layer in layers for h in range(n_heads)]
    if kind == "heads_by_pos":
        return [(layer, p, h) for layer in layers for p in pos for h in range(n_heads)]
    return [(layer, p) for layer in layers for p in pos]


def _cell_value(kind: str, cell: tuple, run: CleanRun, d_head: int) -> torch.Tensor:
    """``run``'s activation that ``cell`` patches: [d] at one position, or one head's
    [pos, d_head] at every position ("heads")."""
    site = _KIND_SITE[kind]
    layer = cell[0]
    act = run.resid_pre[layer] if site == "resid_pre" else run.kept[site][layer]
    act = act[0]                                          # [pos, d] (one prompt, unpadded)
    if kind in ("heads", "heads_by_pos"):
        h = cell[-1]
        act = act[:, h * d_head:(h + 1) * d_head]         # [pos, d_head]
    return act if kind == "heads" else act[cell[1]]


def _cell_edit(kind: str, cell: tuple, value: torch.Tensor, row: int) -> Set:
    """The `Set` writing ``value`` (see `_cell_value`) into ``cell`` of copy ``row``."""
    site, layer = _KIND_SITE[kind], cell[0]
    head = cell[-1] if kind in ("heads", "heads_by_pos") else None
    positions = None if kind == "heads" else (cell[1],)
    return Set(site, layer, value, head=head, positions=positions, prompts=(row,))


def _chunks(cells: list[tuple], n_layers: int, max_copies: int) -> list[list[tuple]]:
    """Cells (in layer order) split into batched runs: each run resumes at its first cell's
    layer, so it costs its copies times the layers from there on, plus a trace's fixed cost
    (about one copy through every layer). Groups of whole layers are chosen to minimise
    that sum (dynamic programming over layer boundaries); a group larger than
    ``max_copies`` is split into even runs."""
    by_layer: dict[int, list[tuple]] = {}
    for c in cells:
        by_layer.setdefault(c[0], []).append(c)
    layers = sorted(by_layer)
    counts = [len(by_layer[layer]) for layer in layers]

    def cost(a: int, b: int) -> float:   # layers[a:b] as one group
        k = sum(counts[a:b])
        runs = -(-k // max_copies)
        return runs * n_layers + k * (n_layers - layers[a])

    best = [0.0] + [math.inf] * len(layers)
    cut = [0] * (len(layers) + 1)
    for b in range(1, len(layers) + 1):
        for a in range(b):
            c = best[a] + cost(a, b)
            if c < best[b]:
                best[b], cut[b] = c, a
    groups, b = [], len(layers)
    while b:
        a = cut[b]
        groups.append([c for layer in layers[a:b] for c in by_layer[layer]])
        b = a
    out = []
    for g in reversed(groups):
        runs = -(-len(g) // max_copies)
        size = -(-len(g) // runs)
        out += [g[i:i + size] for i in range(0, len(g), size)]
    return out


def _patched_runs(model: Model, cells: list[tuple], kind: str, source: CleanRun,
                  target: CleanRun, base: list[Edit], ids: torch.Tensor, batch_tokens: int,
                  progress: Any) -> tuple[np.ndarray, np.ndarray]:
    """Each cell's patched run of the target prompt: logit(ids[0]) - logit(ids[1]) and the
    probability of ids[0] at the last position, in cell order (float64).

    A cell whose source value equals the target's own (every cell before the first changed
    position, where both prompts are the same so far, and the embedding of an unchanged
    token) is not run: writing an equal value changes nothing, so its patched run is the
    unpatched target run.
    """
    n = target.batch.lengths[0]
    d_head = model.spec.d_head
    step = progress_steps(len(cells), progress, unit="run", desc="patching")
    lg0 = target.logits[0, -1].float()
    ld = np.full(len(cells), float(lg0[ids[0]] - lg0[ids[1]]))
    prob = np.full(len(cells), float(torch.softmax(lg0, -1)[ids[0]]))
    values = {}
    for i, c in enumerate(cells):
        value = _cell_value(kind, c, source, d_head)
        if not torch.equal(value, _cell_value(kind, c, target, d_head)):
            values[i] = value
    step(len(cells) - len(values))
    todo = list(values)
    for chunk in _chunks([(*cells[i], i) for i in todo], model.n_layers,
                         max(1, batch_tokens // n)):
        big = target.repeat(len(chunk))
        edits = base + [_cell_edit(kind, c[:-1], values[c[-1]], j)
                        for j, c in enumerate(chunk)]
        out = run_batch(model, big.batch, edits=edits, resume=big,
                        readouts=TraceRequest(save_positions=[-1]))
        lg = out["logits"][:, -1].float()                       # [copies, vocab]
        rows = [c[-1] for c in chunk]
        ld[rows] = (lg[:, ids[0]] - lg[:, ids[1]]).double().numpy()
        prob[rows] = torch.softmax(lg, -1)[:, ids[0]].double().numpy()
        step(len(chunk))
    return ld, prob


def _dataset(model: Model, kind: str, cells: list[tuple], layers: list[int], pos: list[int],
             effect: np.ndarray, ld: np.ndarray, prob: np.ndarray, clean_b: Batch,
             corrupt_b: Batch, *, attrs: dict[str, Any]) -> xr.Dataset:
    """The flat per-cell values laid out over the grid's dims, with coords and provenance."""
    dims = _KIND_DIMS[kind]
    heads = list(range(model.spec.n_heads))
    axes = {"layer": layers, "pos": pos, "head": heads}
    shape = tuple(len(axes[d]) for d in dims)
    index = {d: {v: i for i, v in enumerate(axes[d])} for d in dims}
    flat = np.array([np.ravel_multi_index(tuple(index[d][v] for d, v in zip(dims, c)), shape)
                     for c in cells])

    def grid(values: np.ndarray) -> np.ndarray:
        out = np.full(int(np.prod(shape)), np.nan)
        out[flat] = values
        return out.reshape(shape)

    coords: dict[str, Any] = {d: np.array(axes[d]) for d in dims}
    if "pos" in dims:
        coords.update(
            token=("pos", np.array([clean_b.tokens[0][p] for p in pos], dtype=str)),
            token_id=("pos", np.array([clean_b.token_ids[0][p] for p in pos])),
            corrupt_token=("pos", np.array([corrupt_b.tokens[0][p] for p in pos], dtype=str)),
            corrupt_token_id=("pos", np.array([corrupt_b.token_ids[0][p] for p in pos])))
    edits = attrs.pop("edits")
    return xr.Dataset(
        {"effect": (dims, grid(effect)), "logit_diff": (dims, grid(ld)),
         "prob": (dims, grid(prob))},
        coords=coords,
        attrs={**provenance(model, method="activation_patching", edits=edits, **attrs),
               "citation": CITATION})
