"""``explorer bench patching``: the full activation-patching grid against one plain forward
and against TransformerLens' ``get_act_patch_resid_pre`` on the same weights."""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from explorer._checks import InputError, check_choice, check_int
from explorer.benches.peers import transformer_lens_bridge
from explorer.benches.timing import interleaved_times, median_ms, paired_ratio
from explorer.defaults import DEFAULT_MODEL
from explorer.patching import PATCHING_KINDS, activation_patching

__all__ = ["bench_patching", "IOI_CLEAN", "IOI_CORRUPT"]

# an indirect-object pair of 16 SmolLM2 tokens: the second mention of the subject changes
# (position 11), which moves the answer from " Mary" to " John"
IOI_CLEAN = "Then, when Mary and John went to the store, John gave a drink to"
IOI_CORRUPT = "Then, when Mary and John went to the store, Mary gave a drink to"

_TL_FUNCTIONS = {"resid_pre": "get_act_patch_resid_pre", "attn_out": "get_act_patch_attn_out",
                 "mlp_out": "get_act_patch_mlp_out",
                 "heads": "get_act_patch_attn_head_out_all_pos"}


def bench_patching(model: Any = None, **kw: Any) -> dict[str, Any]:
    """The ``kind`` grid (default resid_pre: every layer x position of the ioi pair) timed
    against one plain forward of the corrupted prompt and against TransformerLens'
    ``get_act_patch_*`` (one hooked forward per cell) on a copy of the same weights, rounds
    interleaved. ``grid_vs_forward_ratio``: the grid's median over one forward's;
    ``peer_over_ours_ratio``: TransformerLens' median over ours (above 1: ours is faster);
    ``accuracy.max_abs_diff``: the largest difference of the normalised logit difference
    between the two. Options: ``repeats`` (rounds, default 3), ``kind``, ``peer``
    (default True), ``clean`` / ``corrupt`` (prompts of one token length).
    """
    from explorer.models import load_model

    if model is None or isinstance(model, str):
        model = load_model(model or DEFAULT_MODEL)
    repeats = check_int("repeats", kw.pop("repeats", 3), low=1)
    kind = check_choice("kind", kw.pop("kind", "resid_pre"), [k for k in PATCHING_KINDS
                                                              if k in _TL_FUNCTIONS])
    peer = bool(kw.pop("peer", True))
    clean, corrupt = kw.pop("clean", IOI_CLEAN), kw.pop("corrupt", IOI_CORRUPT)
    if kw:
        raise InputError(f"unknown bench option(s) {sorted(kw)}; allowed: repeats, kind, peer, "
                         "clean, corrupt.")
    corrupt_batch = model.tokenize([corrupt])
    ours: dict[str, Any] = {}

    def plain():
        model.hf(**corrupt_batch.model_inputs())

    def grid():
        ours["ds"] = activation_patching(model, clean, corrupt, kind=kind)

    fns = {"plain": plain, "grid": grid}
    notes: dict[str, str] = {}
    theirs: dict[str, Any] = {}
    if peer:
        bridge, reason = transformer_lens_bridge(model)
        if reason:
            notes["peer"] = reason
        else:
            from importlib.metadata import version

            from transformer_lens import patching

            grid()                                    # the answer, alternative, baselines
            p = ours["ds"].attrs["params"]
            a, b = p["answer_id"], p["alternative_id"]
            lo, hi = p["corrupt_logit_diff"], p["clean_logit_diff"]
            clean_ids = torch.tensor([p["clean_ids"]])
            corrupt_ids = torch.tensor([p["corrupt_ids"]])

            def metric(logits):
                return ((logits[0, -1, a] - logits[0, -1, b]) - lo) / (hi - lo)

            def peer_grid():
                _, cache = bridge.run_with_cache(clean_ids)
                theirs["grid"] = getattr(patching, _TL_FUNCTIONS[kind])(
                    bridge, corrupt_ids, cache, metric)

            fns["peer"] = peer_grid
            notes["peer"] = (f"TransformerLens {version('transformer-lens')} "
                             f"{_TL_FUNCTIONS[kind]} on a TransformerBridge over a copy of the "
                             "same weights (one hooked forward per cell; its clean cache "
                             "included), the same normalised logit difference as the metric")
    else:
        notes["peer"] = "not measured (peer=False)"
    wall, cpu = interleaved_times(fns, repeats=repeats, warmup=0)
    ds = ours["ds"]
    cells = int(np.isfinite(ds.effect.values).sum())
    figures = {
        "grid_vs_forward_ratio": paired_ratio(wall["grid"], wall["plain"]),
        "grid_vs_forward_cpu_ratio": paired_ratio(cpu["grid"], cpu["plain"]),
        "grid_ms": median_ms(wall["grid"]),
        "plain_forward_ms": median_ms(wall["plain"]),
    }
    accuracy = {}
    if "peer" in wall:
        figures.update(peer_over_ours_ratio=paired_ratio(wall["peer"], wall["grid"]),
                       peer_over_ours_cpu_ratio=paired_ratio(cpu["peer"], cpu["grid"]),
                       peer_ms=median_ms(wall["peer"]))
        diff = np.abs(ds.effect.values - theirs["grid"].double().numpy())
        accuracy = {"max_abs_diff": float(diff.max()),
                    "max_abs_effect": float(np.abs(ds.effect.values).max())}
    p = ds.attrs["params"]
    return {"params": {"kind": kind, "cells": cells, "tokens": len(p["clean_ids"]),
                       "clean": clean, "corrupt": corrupt, "answer": p["answer"],
                       "alternative": p["alternative"], "repeats": repeats},
            "figures": figures, "notes": notes, "accuracy": accuracy}
