"""The comparison of localizations: the relearning attack (`relearn_halves`, `relearn`) and
`unlearning_comparison`, which localizes, trains and evaluates each method with the same
parameter budget (accuracy by `METRICS`, perplexity on held-out general text).
"""
from __future__ import annotations

import copy
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch
import xarray as xr

from explorer._checks import InputError, check_choice, check_float, check_int
from explorer.analyses.unlearning.facts import (
    CITATION,
    METHODS,
    AttributeFact,
    Progress,
    ShouldStop,
    UnlearningCancelled,
    format_accuracy,
)
from explorer.analyses.unlearning.components import (
    component_label,
    component_masks,
    localized_components,
)
from explorer.analyses.unlearning.finetune import _answer_batch, localized_finetune
from explorer.analyses.unlearning.text import text_perplexity
from explorer.models import Model
from explorer.trace import provenance

__all__ = ["METRICS", "relearn_halves", "relearn", "trained_parameters", "unlearning_comparison",
           "mean_interval"]


def mean_interval(values: Sequence[float], level: float = 0.95) -> tuple[float, float, float]:
    """(mean, low, high): Student's t interval for the mean of ``values`` (e.g. one value per
    seed), mean +/- t_{(1+level)/2, n-1} * sd / sqrt(n) with sd at ddof 1; the bounds are
    NaN for fewer than 2 values.

    A tuple: (mean, low, high), as an estimate with its interval is.
    """
    from scipy import stats

    v = np.asarray(values, dtype=float)
    if v.ndim != 1 or not len(v):
        raise InputError(f"`values` must be a non-empty 1-d sequence; got shape {v.shape}.")
    level = check_float("level", level, low=0.0, high=1.0)
    mean = float(v.mean())
    if len(v) < 2:
        return mean, float("nan"), float("nan")
    half = float(stats.t.ppf((1 + level) / 2, len(v) - 1) * v.std(ddof=1) / np.sqrt(len(v)))
    return mean, mean - half, mean + half


def relearn_halves(facts: Sequence[AttributeFact]) -> tuple[list[AttributeFact],
                                                          list[AttributeFact]]:
    """Split a forget set into the half a relearning attack trains on and the half it is
    judged on, stratified by attribute: facts of each attribute (in the order given) go
    to the two halves in turn, with one alternation running across attributes, so both
    halves hold the same mix of answers (within one fact per attribute). A training half
    with another mix would shift the answer prior and move the held-out answers for
    that reason alone.

    A tuple: the two halves of one split, always used as a pair.
    """
    learn: list[AttributeFact] = []
    heldout: list[AttributeFact] = []
    turn = 0
    for attr in dict.fromkeys(f.attribute for f in facts):
        for f in facts:
            if f.attribute == attr:
                (learn if turn % 2 == 0 else heldout).append(f)
                turn += 1
    return learn, heldout


def relearn(model: Model, hf: torch.nn.Module, facts: Sequence[AttributeFact], *, steps: int,
            lr: float, should_stop: ShouldStop = None,
            on_step: Callable[[int, torch.nn.Module], None] | None = None) -> list[float]:
    """Relearning attack: fine-tune every parameter of ``hf`` in place toward the true
    answers of ``facts`` (trained format, cross-entropy over the vocabulary as in
    training, full batch, AdamW without weight decay, gradient clipping at 1). ``on_step``
    is called after each step with (steps done, hf). Returns the loss per step."""
    steps = check_int("steps", steps, low=0)
    lr = check_float("lr", lr, low=0.0)
    facts = list(facts)
    for p in hf.parameters():
        p.requires_grad_(True)
    opt = torch.optim.AdamW(list(hf.parameters()), lr=lr, weight_decay=0.0)
    batch, ids = _answer_batch(model, facts, [f.attribute for f in facts])
    losses = []
    try:
        with torch.enable_grad():
            for step in range(steps):
                if should_stop is not None and should_stop():
                    raise UnlearningCancelled(f"relearning stopped after {step} of {steps} steps.")
                logp = torch.log_softmax(hf(**batch.model_inputs()).logits[:, -1].float(), -1)
                loss = -logp[torch.arange(len(facts)), ids].mean()
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(list(hf.parameters()), 1.0)
                opt.step()
                losses.append(float(loss.detach()))
                if on_step is not None:
                    with torch.no_grad():
                        on_step(step + 1, hf)
    finally:
        for p in hf.parameters():
            p.requires_grad_(False)
    return losses


def _layer_label(method: str, components: Sequence[str]) -> str:
    """The MLP layers trained (comma-separated), or "all"."""
    if method == "all":
        return "all"
    return ",".join(c[1:].split(".")[0] for c in components if c.endswith("MLP"))


def trained_parameters(model: Model, method: str, components: Sequence[str]
                       ) -> tuple[list[str], dict[str, torch.Tensor | None], int]:
    """(parameter names, masks, number of trained entries) of a localization: every
    parameter for ``all``, else the components' (`component_masks`).

    A tuple: names, masks and a count are different kinds of value, read together.
    """
    params = dict(model.hf.named_parameters())
    if method == "all":
        return list(params), {}, int(sum(p.numel() for p in params.values()))
    masks = component_masks(model, components)
    n = sum(params[k].numel() if m is None else int(m.sum()) for k, m in masks.items())
    return sorted(masks), masks, int(n)


METRICS = ("forget", "forget_mc", "forget_mc_known", "retain", "retain_mc",
           "relearn_heldout_before", "relearn_heldout", "relearn_learned")


def unlearning_comparison(model: Model, forget: Sequence[AttributeFact],
                          retain: Sequence[AttributeFact], *, methods: Sequence[str] = METHODS,
                          n_layers: int = 4, objective: str = "unlearn", steps: int = 8,
                          lr: float = 2e-4, retain_weight: float = 1.0, relearn_steps: int = 3,
                          relearn_lr: float = 3e-5, probe: xr.Dataset | None = None,
                          trace: xr.Dataset | None = None, attribution: xr.Dataset | None = None,
                          text: torch.Tensor | None = None, text_weight: float = 1.0,
                          text_batch: int = 4, heldout_text: torch.Tensor | None = None,
                          seed: int = 0, original: bool = True, progress: Progress = None,
                          should_stop: ShouldStop = None) -> xr.Dataset:
    """Localize, train and evaluate each method with the same parameter budget (Guo et al.,
    ICML 2025).

    For each method: the components it picks for the budget of ``n_layers`` MLP layers
    (`localized_components`: MLPs, and heads for causal tracing and attribution patching;
    ``all`` trains every parameter), `localized_finetune` on a copy restricted to them
    (with the general-text retain term when ``text`` is given), then the perplexity on
    ``heldout_text`` (before the relearning attack; NaN without it) and accuracy (top candidate among the
    attributes) on the forget set in the trained format (``forget``) and the
    multiple-choice format (``forget_mc``; ``forget_mc_known`` over only the forget facts
    the original model answers right in multiple choice, so the original row reads 1),
    on the retain set (``retain``, ``retain_mc``), and a relearning attack (`relearn`):
    every parameter is fine-tuned toward the true answers of one half of the forget set
    (`relearn_halves`, stratified by attribute) for ``relearn_steps``; accuracy on the
    other half is read before (``relearn_heldout_before``) and after
    (``relearn_heldout``), and on the trained half after (``relearn_learned``, whether
    the attack learned what it was shown). Row ``original`` is the model before any
    training; its relearn rows are the same attack on the original model, the control
    that the attack itself does not move held-out answers. ``original=False`` leaves that
    row out (to split one comparison over several calls).

    A remote model trains each method on the server with its updates held apart
    (`localized_finetune`); there ``relearn_steps`` must be 0 and ``"all"`` is refused,
    since both train every parameter and would need a second copy of the weights on the
    server. The relearn rows then read the same facts untouched by any attack.

    Returns
    -------
    xr.Dataset
        ``accuracy`` (localization, metric); ``perplexity`` (localization); ``loss``
        (localization, step); ``n_params``, ``n_heads``, ``seconds_per_step``
        (localization); coords ``trained_layers`` (the MLP layers, a string) and
        ``trained_components`` (a short label, `component_label`); attr ``components``
        (the full component list per localization).
    """
    forget, retain = list(forget), list(retain)
    if len(forget) < 2:
        raise InputError(f"`forget` must hold at least 2 facts (half are relearned); got {len(forget)}.")
    methods = [check_choice("method", m, METHODS) for m in methods]
    if not methods:
        raise InputError(f"`methods` must name at least one of {', '.join(METHODS)}.")
    steps = check_int("steps", steps, low=1)
    relearn_steps = check_int("relearn_steps", relearn_steps, low=0)
    if model.remote:  # training runs on the server with updates held apart (WeightDeltas)
        if relearn_steps:
            raise InputError(
                "the relearning attack fine-tunes every parameter; on a remote (NDIF) model "
                "that needs a second copy of all the weights (and its optimiser state) on "
                "the server, so it does not run there: pass relearn_steps=0 (--relearn-steps 0).")
        if "all" in methods:
            raise InputError(
                "method 'all' trains every parameter; on a remote (NDIF) model that needs a "
                "second copy of all the weights on the server. The MLP localizations "
                f"({', '.join(m for m in METHODS if m != 'all')}) train there (--methods).")
    chosen = {m: localized_components(model, m, n_layers, probe=probe, trace=trace,
                                      attribution=attribution, seed=seed) for m in methods}
    learn, heldout = relearn_halves(forget)
    mc_known = format_accuracy(model, forget, "mc")[0]
    rows = ["original", *methods] if original else list(methods)
    acc = np.full((len(rows), len(METRICS)), np.nan)
    loss = np.full((len(rows), steps), np.nan)
    n_params = np.zeros(len(rows), dtype=np.int64)
    n_heads = np.zeros(len(rows), dtype=np.int64)
    ppl = np.full(len(rows), np.nan)
    per_step = np.full(len(rows), np.nan)
    total = len(methods) * (steps + relearn_steps) + (relearn_steps if original else 0)
    done = [0]

    def tick(k=1):
        done[0] += k
        if progress:
            progress(done[0], total)

    def evaluate(hf, i):
        col = {k: j for j, k in enumerate(METRICS)}
        if heldout_text is not None and not model.remote:
            ppl[i] = text_perplexity(model, heldout_text, hf=hf)
        acc[i, col["forget"]] = format_accuracy(model, forget, "trained", hf=hf)[0].mean()
        mc = format_accuracy(model, forget, "mc", hf=hf)[0]
        acc[i, col["forget_mc"]] = mc.mean()
        acc[i, col["forget_mc_known"]] = mc[mc_known].mean() if mc_known.any() else np.nan
        if retain:
            acc[i, col["retain"]] = format_accuracy(model, retain, "trained", hf=hf)[0].mean()
            acc[i, col["retain_mc"]] = format_accuracy(model, retain, "mc", hf=hf)[0].mean()
        acc[i, col["relearn_heldout_before"]] = format_accuracy(model, heldout, "trained", hf=hf)[0].mean()
        if relearn_steps:
            relearn(model, hf, learn, steps=relearn_steps, lr=relearn_lr, should_stop=should_stop)
            tick(relearn_steps)
        acc[i, col["relearn_heldout"]] = format_accuracy(model, heldout, "trained", hf=hf)[0].mean()
        acc[i, col["relearn_learned"]] = format_accuracy(model, learn, "trained", hf=hf)[0].mean()

    torch.manual_seed(seed)
    if original and model.remote:  # the served weights as they are (nothing to relearn)
        evaluate(None, 0)
    elif original:
        with model.lock:
            base = copy.deepcopy(model.hf)
        evaluate(base, 0)
        del base
    for i, m in enumerate(methods, start=1 if original else 0):
        names, masks, n_params[i] = trained_parameters(model, m, chosen[m])
        n_heads[i] = sum(not c.endswith("MLP") for c in chosen[m]) if m != "all" else \
            model.n_layers * model.spec.n_heads
        t0 = time.perf_counter()
        hf, losses = localized_finetune(
            model, forget, retain, names, objective=objective, steps=steps, lr=lr,
            retain_weight=retain_weight, masks=masks, text=text, text_weight=text_weight,
            text_batch=text_batch, should_stop=should_stop,
            progress=lambda d, t: tick())
        per_step[i] = (time.perf_counter() - t0) / steps
        loss[i] = losses
        evaluate(hf, i)
        del hf
    ds = xr.Dataset(
        {"accuracy": (("localization", "metric"), acc), "loss": (("localization", "step"), loss),
         "perplexity": ("localization", ppl),
         "n_params": ("localization", n_params), "n_heads": ("localization", n_heads),
         "seconds_per_step": ("localization", per_step)},
        coords={"localization": rows, "metric": list(METRICS), "step": np.arange(steps),
                "trained_layers": ("localization", ["-"] * original + [
                    _layer_label(m, chosen[m]) for m in methods]),
                "trained_components": ("localization", ["-"] * original + [
                    "all" if m == "all" else component_label(chosen[m]) for m in methods])},
        attrs=provenance(model, method="unlearning_comparison", methods=methods,
                         n_layers=n_layers, objective=objective, steps=steps, lr=lr,
                         retain_weight=retain_weight, text_weight=text_weight,
                         text_batch=text_batch,
                         n_text_windows=0 if text is None else int(len(text)),
                         n_heldout_windows=0 if heldout_text is None else int(len(heldout_text)),
                         components={m: list(chosen[m]) if m != "all" else "all"
                                     for m in methods},
                         relearn_steps=relearn_steps,
                         relearn_lr=relearn_lr, seed=seed, original=original, n_forget=len(forget),
                         n_retain=len(retain),
                         forget=[f.subject for f in forget], retain=[f.subject for f in retain],
                         relearn_on=[f.subject for f in learn],
                         relearn_heldout=[f.subject for f in heldout]),
    )
    ds.attrs["citation"] = CITATION
    return ds
