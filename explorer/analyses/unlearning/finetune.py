"""Localized training: the parameters a localization trains (`component_parameters`) and
gradient steps on a copy of the model restricted to them (`localized_finetune`); for a remote
model, the same steps on hooked weight updates in jobs where the weights are.
"""
from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from explorer._checks import InputError, check_choice, check_float, check_int
from explorer.analyses.unlearning.facts import (
    METHODS,
    OBJECTIVES,
    AttributeFact,
    Progress,
    ShouldStop,
    UnlearningCancelled,
    attribute_token_ids,
    fact_prompt,
)
from explorer.analyses.unlearning.localization import _mlp_module
from explorer.analyses.unlearning.text import text_loss, windows_for_step
from explorer.lora import WeightDeltas, adamw, adamw_step, remove_hooks
from explorer.models import Model
from explorer.trace import run_on_weights

__all__ = ["component_parameters", "localized_finetune"]


def component_parameters(model: Model, method: str, layers: Sequence[int]) -> list[str]:
    """Names of the parameters a localization trains: every weight of the chosen MLP
    layers (whole matrices), or every parameter of the model for ``all``."""
    check_choice("method", method, METHODS)
    if method == "all":
        return [n for n, _ in model.hf.named_parameters()]
    names = []
    for layer in layers:
        layer = model.check_layer(layer)
        mlp = _mlp_module(model, layer)
        ids = {id(p) for p in mlp.parameters()}
        names += [n for n, p in model.hf.named_parameters() if id(p) in ids]
    return names


def _answer_batch(model: Model, facts: Sequence[AttributeFact], targets: Sequence[str]):
    batch = model.tokenize([fact_prompt(f, "trained") for f in facts])
    ids = torch.tensor([model.tokenizer(" " + t, add_special_tokens=False)["input_ids"][0]
                        for t in targets])
    return batch, ids


def _edit_targets(facts: Sequence[AttributeFact]) -> list[str]:
    """The edit label of each fact: the next attribute of the relation (a fixed rotation)."""
    return [f.attributes[(f.attributes.index(f.attribute) + 1) % len(f.attributes)] for f in facts]


def localized_finetune(model: Model, forget: Sequence[AttributeFact],
                       retain: Sequence[AttributeFact], parameters: Sequence[str], *,
                       objective: str = "unlearn", steps: int = 8, lr: float = 2e-4,
                       retain_weight: float = 1.0, clip: float = 1.0,
                       masks: Mapping[str, torch.Tensor | None] | None = None,
                       text: torch.Tensor | None = None, text_weight: float = 1.0,
                       text_batch: int = 4,
                       hf: torch.nn.Module | None = None, progress: Progress = None,
                       should_stop: ShouldStop = None) -> tuple[torch.nn.Module, list[float]]:
    """Train a copy of the model on the forget facts, updating only ``parameters``.

    A tuple: the trained copy and its losses are different kinds of value.

    Loss per step = L_forget + retain_weight * CE(retain answers) + text_weight *
    CE(general text), with L_forget = -log(1 - p(answer)) for ``unlearn`` (p among the
    relation's attributes, the quantity the accuracy reads) and CE toward the next
    attribute for ``edit`` (Guo et al., ICML 2025, whose retain terms are the maintained
    facts and the Pile). The facts are one full batch; the text term reads ``text_batch``
    windows of ``text`` ([window, n_tokens], `text.text_windows`) per step, cycling.
    AdamW (no weight decay), gradient clipping at ``clip``. ``masks`` (from
    `components.component_masks`) restricts a parameter to some entries (an attention
    head's slice): its gradient is multiplied by the mask, so AdamW leaves every other
    entry exactly as it was. The model's own weights are never touched: training runs on
    ``copy.deepcopy(model.hf)`` (or on ``hf``).

    A remote model trains on the server instead, where its weights cannot be copied: the
    updates of ``parameters`` are `explorer.lora.WeightDeltas` held in the jobs and added
    by hooks (the model computes as if each weight were W + dW), up to
    `explorer.lora.STEPS_PER_JOB` steps per job, the updates and AdamW's state carried
    between jobs. The same optimiser on dW from zero gives W + dW the steps AdamW gives W,
    up to float rounding. Only linear maps inside layers can be updated this way (the MLP
    localizations; not ``"all"``).

    Returns (trained module, loss per step); for a remote model (WeightDeltas, loss per
    step), which `format_accuracy`'s ``hf`` takes.
    """
    check_choice("objective", objective, OBJECTIVES)
    steps = check_int("steps", steps, low=1)
    lr = check_float("lr", lr, low=0.0)
    retain_weight = check_float("retain_weight", retain_weight, low=0.0)
    text_weight = check_float("text_weight", text_weight, low=0.0)
    text_batch = check_int("text_batch", text_batch, low=1)
    forget, retain = list(forget), list(retain)
    if not forget:
        raise InputError("`forget` must hold at least one fact; got an empty list.")
    names = set(parameters)
    if not names:
        raise InputError("`parameters` must name at least one parameter to train.")
    bad = sorted(names - {n for n, _ in (model.hf if hf is None else hf).named_parameters()})
    if bad:
        raise InputError(f"unknown parameter name {bad[0]!r}; names come from "
                         "`component_parameters`.")
    masks = {k: v for k, v in (masks or {}).items() if v is not None}
    stray = sorted(set(masks) - names)
    if stray:
        raise InputError(f"mask for {stray[0]!r}, which is not among `parameters`.")
    if text is not None and text_weight > 0:
        text = torch.as_tensor(text, dtype=torch.long)
        if text.ndim != 2 or text.shape[1] < 2:
            raise InputError(f"`text` must be token windows [window, n_tokens] with n_tokens "
                             f">= 2; got shape {tuple(text.shape)}.")
    else:
        text = None
    if hf is None and model.remote:
        return _finetune_by_deltas(model, forget, retain, sorted(names), objective=objective,
                                   steps=steps, lr=lr, retain_weight=retain_weight, clip=clip,
                                   masks=masks, text=text, text_weight=text_weight,
                                   text_batch=text_batch,
                                   progress=progress, should_stop=should_stop)
    if hf is None:
        with model.lock:
            hf = copy.deepcopy(model.hf)
    known = dict(hf.named_parameters())
    for n, p in known.items():
        p.requires_grad_(n in names)
    trainable = [known[n] for n in sorted(names)]
    handles = [known[n].register_hook(lambda g, m=m: g * m.to(g.device, g.dtype))
               for n, m in masks.items()]
    opt = torch.optim.AdamW(trainable, lr=lr, weight_decay=0.0)
    data = _training_batch(model, forget, retain, objective)
    losses = []
    hf.train(False)
    try:
        with torch.enable_grad():
            for step in range(steps):
                if should_stop is not None and should_stop():
                    raise UnlearningCancelled(f"training stopped after {step} of {steps} steps.")
                logits = hf(**data["batch"].model_inputs()).logits[:, -1].float()  # [fact, vocab]
                loss = _unlearning_loss(logits, data, objective, retain_weight)
                if text is not None:
                    loss = loss + text_weight * text_loss(hf, windows_for_step(text, step, text_batch))
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(trainable, clip)
                opt.step()
                losses.append(float(loss.detach()))
                if progress:
                    progress(step + 1, steps)
    finally:
        remove_hooks(handles)
        for p in hf.parameters():
            p.requires_grad_(False)
    return hf, losses


def _training_batch(model: Model, forget: list[AttributeFact], retain: list[AttributeFact],
                    objective: str) -> dict[str, Any]:
    """What every training step scores: the forget and retain prompts in one batch
    ([forget..., retain...], trained format), each row's target token, the attributes'
    tokens and each forget fact's answer among them."""
    f_targets = [f.attribute for f in forget] if objective == "unlearn" else _edit_targets(forget)
    batch, ids = _answer_batch(model, forget + retain, f_targets + [f.attribute for f in retain])
    return {"batch": batch, "ids": ids,
            "cand": torch.tensor(attribute_token_ids(model, forget[0].attributes)),
            "f_pos": torch.tensor([f.attributes.index(f.attribute) for f in forget]),
            "nf": len(forget), "n_retain": len(retain)}


def _unlearning_loss(logits: torch.Tensor, data: dict[str, Any], objective: str,
                     retain_weight: float) -> torch.Tensor:
    """L_forget + retain_weight * CE(retain answers) from the last-position logits
    [fact, vocab] of `_training_batch`'s prompts (see `localized_finetune`)."""
    device = logits.device
    nf, ids = data["nf"], data["ids"].to(device)
    lp = torch.log_softmax(logits, -1)[torch.arange(len(ids), device=device), ids]  # [fact]
    if objective == "unlearn":
        # p(answer) among the attributes, the quantity the accuracy reads
        pc = torch.softmax(logits[:nf][:, data["cand"].to(device)], -1)[
            torch.arange(nf, device=device), data["f_pos"].to(device)]
        loss = -torch.log1p(-pc.clamp(max=1 - 1e-6)).mean()
    else:
        loss = -lp[:nf].mean()
    if data["n_retain"] and retain_weight > 0:
        loss = loss - retain_weight * lp[nf:].mean()
    return loss


def _finetune_by_deltas(model: Model, forget: list[AttributeFact], retain: list[AttributeFact],
                        names: list[str], *, objective: str, steps: int, lr: float,
                        retain_weight: float, clip: float, progress: Progress,
                        should_stop: ShouldStop, masks: Mapping[str, torch.Tensor] | None = None,
                        text: torch.Tensor | None = None, text_weight: float = 1.0,
                        text_batch: int = 4) -> tuple[WeightDeltas, list[float]]:
    """`localized_finetune` with the updates held apart (`WeightDeltas`), in jobs where the
    weights are."""
    from explorer import lora as lora_jobs

    deltas = WeightDeltas.zeros(model, names)
    setup = {"data": _training_batch(model, forget, retain, objective), "objective": objective,
             "retain_weight": retain_weight, "clip": clip, "lr": lr,
             "masks": dict(masks or {}), "text": text, "text_weight": text_weight,
             "text_batch": text_batch}
    losses: list[float] = []
    opt_state = None
    done = 0
    while done < steps:
        if should_stop is not None and should_stop():
            raise UnlearningCancelled(f"training stopped after {done} of {steps} steps.")
        n = min(lora_jobs.STEPS_PER_JOB, steps - done)
        with model.lock:
            out = run_on_weights(model, _delta_steps, deltas, opt_state, setup, n, done)
        deltas = WeightDeltas(out["deltas"], deltas.transposed)
        opt_state = out["opt"]
        losses += out["loss"]
        done += n
        if progress:
            for k in range(done - n + 1, done + 1):
                progress(k, steps)
    return deltas, losses


def _delta_steps(weights: Model, deltas: WeightDeltas, opt_state: dict | None,
                 setup: dict[str, Any], n_steps: int, first_step: int = 0) -> dict[str, Any]:
    """``n_steps`` steps of `localized_finetune`'s loss on hook-applied updates (one job).
    Gradients are taken with respect to the updates only: the served weights, shared by
    every request, are neither written nor given a ``.grad``."""
    device = weights.hf.device
    deltas = deltas.to(device).trainable()
    params = deltas.parameters()
    for name, mask in (setup.get("masks") or {}).items():
        deltas.deltas[name].register_hook(lambda g, m=mask.to(device): g * m.to(g.dtype))
    text = setup.get("text")
    opt = adamw(params, setup["lr"], opt_state)
    data = setup["data"]
    batch = data["batch"].to(device)
    losses = []
    handles = deltas.hooks(weights)
    try:
        with torch.enable_grad():
            for k in range(n_steps):
                logits = weights.hf(**batch.model_inputs()).logits[:, -1].float()
                loss = _unlearning_loss(logits, data, setup["objective"], setup["retain_weight"])
                if text is not None:
                    loss = loss + setup["text_weight"] * text_loss(
                        weights.hf, windows_for_step(text, first_step + k, setup["text_batch"]))
                adamw_step(loss, params, opt, clip=setup["clip"])
                losses.append(float(loss.detach()))
    finally:
        remove_hooks(handles)
    return {"deltas": {k: v.detach() for k, v in deltas.deltas.items()},
            "opt": opt.state_dict(), "loss": losses}
