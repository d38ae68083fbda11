"""The latent probe after unlearning (Guo et al., ICML 2025): is a forgotten fact still
linearly decodable from the residual stream?

Guo et al. fit per-layer logistic-regression probes for the attribute on the unlearned
model's residual stream (``resid_post``, at the prompt's last position in their
``weight_masking_probing.py``) and read them on the forgotten facts: a probe that still
finds the attribute means unlearning hid the fact from the output rather than removing it.
Here the probe of each layer is trained on facts that were *not* forgotten (the unlearned
model's own representations of them) and applied to the forget facts, at the last position
and at the last subject token (where the fact-lookup MLPs write). `latent_probe_after_unlearning`
trains each localization with the comparison's settings (`localized_finetune`) and probes
the result, beside the original model.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import xarray as xr

from explorer._checks import InputError, check_choice, check_int
from explorer.analyses._intervals import wilson_interval
from explorer.analyses.unlearning.facts import (
    CITATION,
    METHODS,
    AttributeFact,
    Progress,
    fact_prompt,
    format_accuracy,
    subject_positions,
)
from explorer.analyses.unlearning.comparison import _layer_label, trained_parameters
from explorer.analyses.unlearning.components import localized_components
from explorer.analyses.unlearning.finetune import localized_finetune
from explorer.models import Model
from explorer.trace import provenance, trace

__all__ = ["PROBE_POSITIONS", "fact_residuals", "transfer_probe_accuracy",
           "latent_probe_after_unlearning"]

PROBE_POSITIONS = ("last", "subject")
"""Where the residual is read: the prompt's last token (Guo et al.'s code) or the subject's."""


def fact_residuals(model: Model, facts: Sequence[AttributeFact], *,
                   hf: torch.nn.Module | None = None, batch_size: int = 32) -> np.ndarray:
    """Every layer's output (``resid_post``) of the trained-format prompts of ``facts``, run
    through ``hf`` (a trained copy, traced as `Model.over`; default the model's own module),
    at the last token and the last subject token: [fact, position (`PROBE_POSITIONS`),
    layer, d_model] float32."""
    facts = list(facts)
    traced = model if hf is None else model.over(hf)
    read = trace(traced, [fact_prompt(f, "trained") for f in facts], sites=("resid_post",),
                 batch_size=batch_size, progress=False)
    resid = read.resid_post.values                       # [fact, pos, layer, d_model]
    lengths = read["mask"].values.sum(1)
    out = np.zeros((len(facts), len(PROBE_POSITIONS), model.n_layers, model.spec.d_model),
                   dtype=np.float32)
    for i, f in enumerate(facts):
        out[i, 0] = resid[i, int(lengths[i]) - 1]
        out[i, 1] = resid[i, subject_positions(model, f)[-1]]
    return out


def transfer_probe_accuracy(train_x: np.ndarray, train_y: Sequence[str], test_x: np.ndarray,
                            test_y: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """Per-layer probes fitted on ``train_x`` [example, layer, d] and scored on ``test_x``:
    (accuracy [layer], correct [layer, test example]). The probe is the fact-lookup one
    (`probe_accuracy`: standardised features, L2 logistic regression, C = 0.1).

    A tuple: two arrays of different shapes, read together.
    """
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    train_y, test_y = np.asarray(train_y), np.asarray(test_y)
    if train_x.ndim != 3 or test_x.ndim != 3 or train_x.shape[1:] != test_x.shape[1:]:
        raise InputError(f"`train_x` and `test_x` must be [example, layer, d] alike; got "
                         f"{train_x.shape} and {test_x.shape}.")
    if len(np.unique(train_y)) < 2:
        raise InputError("the probe needs training facts of at least 2 attributes; got "
                         f"{sorted(set(train_y.tolist()))}.")
    correct = np.zeros((train_x.shape[1], len(test_y)), dtype=bool)
    for li in range(train_x.shape[1]):
        probe = make_pipeline(StandardScaler(), LogisticRegression(C=0.1, max_iter=2000))
        probe.fit(train_x[:, li].astype(np.float64), train_y)
        correct[li] = probe.predict(test_x[:, li].astype(np.float64)) == test_y
    return correct.mean(1), correct


def latent_probe_after_unlearning(model: Model, forget: Sequence[AttributeFact],
                                  retain: Sequence[AttributeFact],
                                  probe_facts: Sequence[AttributeFact], *,
                                  methods: Sequence[str] = METHODS, n_layers: int = 4,
                                  objective: str = "unlearn", steps: int = 8, lr: float = 2e-4,
                                  retain_weight: float = 1.0, probe: xr.Dataset | None = None,
                                  trace: xr.Dataset | None = None,
                                  attribution: xr.Dataset | None = None,
                                  text: torch.Tensor | None = None, text_weight: float = 1.0,
                                  text_batch: int = 4, seed: int = 0,
                                  progress: Progress = None) -> xr.Dataset:
    """Probe accuracy on the forget facts after each localization's unlearning, per layer.

    Each method is trained as in `unlearning_comparison` (same layers, budget and
    settings, components and text retain term); then, on the trained copy, per-layer probes are fitted on the residuals of
    ``probe_facts`` (facts not in ``forget``, e.g. the other known facts) and read on the
    forget facts' residuals. Row ``original`` is the model before unlearning.

    Returns
    -------
    xr.Dataset
        ``probe_forget_accuracy`` (localization, position, layer) with Wilson 95 % bounds
        ``*_low`` / ``*_high`` over the forget facts; ``best_layer_accuracy``
        (localization, position): the highest layer's accuracy (chosen on the forget facts,
        so optimistic); ``forget_accuracy`` (localization): the model's own trained-format
        answers; ``chance``: the share of the forget facts of the probe's most frequent
        training attribute (what a constant probe scores).
    """
    forget, retain, probe_facts = list(forget), list(retain), list(probe_facts)
    if len(forget) < 1:
        raise InputError("`forget` must hold at least 1 fact.")
    overlap = {f.subject for f in forget} & {f.subject for f in probe_facts}
    if overlap:
        raise InputError(f"`probe_facts` must not hold forget facts; both hold {sorted(overlap)[:3]}.")
    methods = [check_choice("method", m, METHODS) for m in methods]
    steps = check_int("steps", steps, low=1)
    chosen = {m: localized_components(model, m, n_layers, probe=probe, trace=trace,
                                      attribution=attribution, seed=seed) for m in methods}
    rows = ["original", *methods]
    L, P = model.n_layers, len(PROBE_POSITIONS)
    acc = np.full((len(rows), P, L), np.nan)
    behaviour = np.full(len(rows), np.nan)
    ty = [f.attribute for f in probe_facts]
    fy = [f.attribute for f in forget]
    torch.manual_seed(seed)
    for i, m in enumerate(rows):
        if m == "original":
            hf = None
        else:
            names, masks, _ = trained_parameters(model, m, chosen[m])
            hf, _ = localized_finetune(model, forget, retain, names, objective=objective,
                                       steps=steps, lr=lr, retain_weight=retain_weight,
                                       masks=masks, text=text, text_weight=text_weight,
                                       text_batch=text_batch)
        behaviour[i] = format_accuracy(model, forget, "trained", hf=hf)[0].mean()
        tx = fact_residuals(model, probe_facts, hf=hf)
        fx = fact_residuals(model, forget, hf=hf)
        for p in range(P):
            acc[i, p] = transfer_probe_accuracy(tx[:, p], ty, fx[:, p], fy)[0]
        del hf
        if progress:
            progress(i + 1, len(rows))
    low, high = wilson_interval(acc * len(forget), len(forget))
    values, counts = np.unique(ty, return_counts=True)
    chance = float(np.mean(np.asarray(fy) == values[np.argmax(counts)]))
    ds = xr.Dataset(
        {"probe_forget_accuracy": (("localization", "position", "layer"), acc),
         "probe_forget_accuracy_low": (("localization", "position", "layer"), low),
         "probe_forget_accuracy_high": (("localization", "position", "layer"), high),
         "best_layer_accuracy": (("localization", "position"), acc.max(-1)),
         "forget_accuracy": (("localization",), behaviour), "chance": chance},
        coords={"localization": rows, "position": list(PROBE_POSITIONS), "layer": np.arange(L),
                "trained_layers": ("localization", ["-"] + [
                    _layer_label(m, chosen[m]) for m in methods])},
        attrs=provenance(model, method="latent_probe_after_unlearning", methods=methods,
                         n_layers=n_layers, objective=objective, steps=steps, lr=lr,
                         retain_weight=retain_weight, seed=seed, n_forget=len(forget),
                         n_probe_facts=len(probe_facts)))
    ds.attrs["citation"] = CITATION
    return ds
