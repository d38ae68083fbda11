"""``explorer bench icl-heads``: the FV head scoring of `explorer.analyses.icl_heads` (batched
chunks of heads, one trace per head, and the last-token path) against one clean forward.
"""
from __future__ import annotations

import time
from typing import Any

import torch

from explorer._checks import check_int
from explorer.analyses.icl_heads import head_chunks, heads_of_layers, last_token_probs
from explorer.analyses.icl_heads import answer_token_ids, fv_last_token_probs, fv_patched_probs
from explorer.analyses.icl_heads import icl_prompts, last_token_cache, last_token_problem
from explorer.analyses.icl_heads import task_mean_z
from explorer.defaults import DEFAULT_MODEL
from explorer.trace import clean_run

__all__ = ["bench_icl_heads"]


def bench_icl_heads(model: Any = None, *, task: str = "antonym", n_prompts: int = 8,
                    n_shots: int = 5, n_heads: int = 6, max_rows: int = 256,
                    **kw: Any) -> dict[str, Any]:
    """Time per FV head-task pair vs one clean forward of the same prompts.

    ``fv_head_task_pair_ms``: scoring every head of the model as `fv_scores` does (chunks
    of heads, one batched trace per chunk, ``max_rows`` rows at most), divided by the number
    of heads. ``per_head_trace_ms``: the one-trace-per-head path (a single-head patched
    trace resumed at the head's layer) over ``n_heads`` heads, one in each of ``n_heads``
    equal layer bands (at the band's middle layer, so their mean depth is that of all
    heads). ``forward_ms``: the clean batched forward (last-token logits). ``accuracy``:
    the largest difference in answer probability between the two paths on those heads.
    ``fv_last_token_pair_ms`` (the `LAST_TOKEN_FAMILIES` only): every head scored by the last-token
    path (`fv_last_token_probs`, same chunks), including the once-per-task key/value cache
    of the earlier positions, divided by the number of heads; its accuracy figure compares
    it with the per-head traces.
    """
    from explorer.models import load_model

    if model is None or isinstance(model, str):
        model = load_model(model or DEFAULT_MODEL)
    check_int("max_rows", max_rows, low=1)
    prompts, answers = icl_prompts(task, n_prompts=n_prompts, n_shots=n_shots, seed=0)
    target = torch.tensor(answer_token_ids(model, answers))
    mz = task_mean_z(model, prompts)
    cache = clean_run(model, prompts)
    heads = heads_of_layers(model, None)
    n_layers, n_h = model.spec.n_layers, model.spec.n_heads
    n_heads = check_int("n_heads", n_heads, low=1, high=n_layers)
    picked = [((2 * i + 1) * n_layers // (2 * n_heads), i % n_h) for i in range(n_heads)]
    last_token_probs(model, cache.batch)  # warm-up
    t0 = time.perf_counter()
    for _ in range(3):
        last_token_probs(model, cache.batch)
    forward = (time.perf_counter() - t0) / 3
    t0 = time.perf_counter()
    single = [fv_patched_probs(model, cache, [h], mz, target)[0] for h in picked]
    per_head = (time.perf_counter() - t0) / len(picked)
    chunks = head_chunks(heads, max(1, max_rows // len(target)))
    t0 = time.perf_counter()
    batched = {}
    for chunk in chunks:
        p = fv_patched_probs(model, cache, chunk, mz, target)
        batched.update(zip(chunk, p))
    pair = (time.perf_counter() - t0) / len(heads)
    err = max(float((batched[h] - s).abs().max()) for h, s in zip(picked, single))
    figures = {"fv_head_task_pair_vs_forward_ratio": pair / forward,
               "fv_head_task_pair_ms": pair * 1e3,
               "per_head_trace_vs_forward_ratio": per_head / forward,
               "per_head_trace_ms": per_head * 1e3,
               "batched_vs_per_head_ratio": pair / per_head,
               "forward_ms": forward * 1e3}
    accuracy = {"max_abs_prob_diff_batched_vs_per_head": err}
    if last_token_problem(model) is None:
        fv_last_token_probs(model, last_token_cache(model, cache.batch), chunks[0], mz,
                            target)  # warm-up
        t0 = time.perf_counter()
        prefix = last_token_cache(model, cache.batch)
        fast = {}
        for chunk in chunks:
            p = fv_last_token_probs(model, prefix, chunk, mz, target)
            fast.update(zip(chunk, p))
        last = (time.perf_counter() - t0) / len(heads)
        figures.update({"fv_last_token_pair_vs_forward_ratio": last / forward,
                        "fv_last_token_pair_ms": last * 1e3,
                        "last_token_vs_batched_ratio": last / pair})
        accuracy["max_abs_prob_diff_last_token_vs_per_head"] = max(
            float((fast[h] - s).abs().max()) for h, s in zip(picked, single))
    return {"params": {"task": task, "n_prompts": n_prompts, "n_shots": n_shots,
                       "width": cache.batch.width, "n_heads_scored": len(heads),
                       "n_traces": len(chunks), "max_rows": max_rows,
                       "n_heads_timed_per_head": len(picked)},
            "figures": figures, "accuracy": accuracy}
