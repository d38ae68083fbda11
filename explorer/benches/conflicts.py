"""``explorer bench conflicts``: the JuICE dual run of `explorer.analyses.conflicts` against
two plain forwards, and the time of one alpha-slider update of the conflicts page's maths.
"""
from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from explorer._checks import InputError, check_int
from explorer.analyses.conflicts import answer_probabilities, conflict_prompt, juice_first_run
from explorer.analyses.conflicts import juice_logits, load_facts
from explorer.defaults import DEFAULT_MODEL

__all__ = ["bench_conflicts"]


def bench_conflicts(model: Any = None, **kw: Any) -> dict[str, Any]:
    """JuICE dual run vs two plain forwards on one conflict prompt, and the slider update.

    ``dual_vs_two_forwards_ratio``: median dual run (5 heads, run 1 plus run 2, edit
    construction included) over the median of two plain ``model.hf`` forwards of the same
    prompt. ``slider_update_ms``: median time of what the view does when an alpha slider
    moves (run 1 cached per example, so one run 2 resumed at the first chosen layer, plus
    the answer probabilities), for 5 heads in layers 20-29 of the 51-token coherent prompt
    (``slider_update_ms``) and the 16-token substitution prompt
    (``slider_update_substitution_ms``), and for heads from layer 0 on
    (``slider_update_from_layer0_ms``, the worst case: a whole forward).
    """
    from explorer.models import load_model

    if model is None or isinstance(model, str):
        model = load_model(model or DEFAULT_MODEL)
    repeats = check_int("repeats", kw.pop("repeats", 7), low=1)
    if kw:
        raise InputError(f"unknown bench option(s) {sorted(kw)}; allowed: repeats.")
    fact = load_facts(["country_capital"])[0]
    prompt = conflict_prompt(fact, "coherent")
    L, H = model.n_layers, model.spec.n_heads
    heads = [((i * 7) % L, (i * 5) % H) for i in range(5)]
    late = [(L - 1 - (i * 2) % max(L // 3, 1), (i * 5) % H) for i in range(5)]
    batch = model.tokenize([prompt])
    sub = conflict_prompt(fact, "substitution")
    run1 = juice_first_run(model, [prompt])
    run1_sub = juice_first_run(model, [sub])
    fwd, dual, slider, slider_sub, slider0 = [], [], [], [], []

    def slide(r1, hs, alpha):
        t = time.perf_counter()
        lg = juice_logits(model, None, hs[:3], hs[3:], alpha_l=alpha, alpha_s=1.0, run1=r1)
        answer_probabilities(model, lg, [fact])
        return time.perf_counter() - t

    for r in range(repeats + 1):
        t0 = time.perf_counter()
        with torch.no_grad():
            model.hf(**batch.model_inputs())
            model.hf(**batch.model_inputs())
        t1 = time.perf_counter()
        juice_logits(model, [prompt], heads[:3], heads[3:], alpha_l=2.0, alpha_s=1.0)
        t2 = time.perf_counter()
        times = (slide(run1, late, 1.0 + r), slide(run1_sub, late, 1.0 + r),
                 slide(run1, heads, 1.0 + r))
        if r:  # the first round warms up
            fwd.append(t1 - t0)
            dual.append(t2 - t1)
            slider.append(times[0])
            slider_sub.append(times[1])
            slider0.append(times[2])
    med = statistics.median
    return {
        "params": {"model": model.spec.name, "prompt_tokens": batch.lengths[0],
                   "substitution_tokens": run1_sub.batch.lengths[0], "heads": heads,
                   "slider_heads": late, "repeats": repeats},
        "figures": {
            "two_forwards_ms": 1e3 * med(fwd),
            "dual_run_ms": 1e3 * med(dual),
            "dual_vs_two_forwards_ratio": med(dual) / med(fwd),
            "slider_update_ms": 1e3 * med(slider),
            "slider_update_substitution_ms": 1e3 * med(slider_sub),
            "slider_update_from_layer0_ms": 1e3 * med(slider0),
            "slider_vs_two_forwards_ratio": med(slider) / med(fwd),
        },
    }
