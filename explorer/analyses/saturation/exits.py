"""Token-level early exit of the saturation analysis: exit rules, their accuracy and speed-up.

* `exit_layers`, `exit_metrics`: the first layer a score reaches a threshold, and an exit rule's
  agreement with the full model, with the true next token, and its speed-up ``L N / sum(e + 1)``.
* `early_exit`: the task probe vs softmax margin vs consecutive-layer cosine vs the oracle s_1,
  as accuracy/speed-up curves over thresholds.
* `speedup_at_accuracy`: each rule's speed-up at fixed accuracy targets, read from stored curves.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import numpy as np
import xarray as xr

from explorer._checks import InputError, check_choice, check_float

__all__ = ["exit_layers", "exit_metrics", "early_exit", "EXIT_ACCURACY_TARGETS",
           "speedup_at_accuracy"]

_MARGIN_THETAS = tuple(np.round(np.arange(0.0, 1.0001, 0.02), 2).tolist())
_COSINE_THETAS = tuple(np.round(np.concatenate([
    np.arange(0.50, 0.95, 0.05), 1.0 - np.logspace(np.log10(0.05), -4, 22)]), 6).tolist())


def exit_layers(score: Any, theta: float) -> np.ndarray:
    """First layer whose score reaches ``theta`` (``score >= theta``), else the last layer.

    ``score`` is [position, layer]; NaN never reaches. Returns [position] int64.
    """
    sc = np.asarray(score, dtype=np.float64)
    hit = sc >= theta
    first = hit.argmax(-1)
    return np.where(hit.any(-1), first, sc.shape[-1] - 1).astype(np.int64)


def exit_metrics(exit_layer: Any, layer_top1: Any, final_top1: Any, next_token: Any,
                 n_layers: int) -> dict[str, float]:
    """Accuracy and speed-up of an early-exit rule.

    A dict of scalars: the two numbers of one rule, read by name.

    Exiting at layer e (0-based) means running e + 1 layers and emitting the lens top-1 of
    layer e. ``speedup = L * N / sum(e + 1)`` (Lioubashevski et al., ICML 2025).

    Parameters
    ----------
    exit_layer : array-like of int, shape [position]
    layer_top1 : array-like of int, shape [position, layer]
        Lens top-1 token id per layer.
    final_top1 : array-like of int, shape [position]
        The full model's next-token prediction.
    next_token : array-like of int, shape [position]
        The true next token (negative where there is none; left out of ``accuracy_true``).
    n_layers : int

    Returns
    -------
    dict
        ``accuracy`` (agreement with the full model), ``accuracy_true`` (with the true next
        token), ``speedup``, ``mean_exit_layer``.
    """
    e = np.asarray(exit_layer, dtype=np.int64)
    top = np.asarray(layer_top1)
    chosen = np.take_along_axis(top, e[:, None], axis=1)[:, 0]
    final = np.asarray(final_top1)
    nxt = np.asarray(next_token)
    has = nxt >= 0
    return {
        "accuracy": float(np.mean(chosen == final)),
        "accuracy_true": float(np.mean(chosen[has] == nxt[has])) if has.any() else float("nan"),
        "speedup": float(n_layers * len(e) / np.sum(e + 1)),
        "mean_exit_layer": float(np.mean(e)),
    }


def early_exit(layer_top1: Any, top_prob: Any, cosine: Any, sat_top1: Any, probe_task: Any,
               next_token: Any, *, margin_thetas: Sequence[float] = _MARGIN_THETAS,
               cosine_thetas: Sequence[float] = _COSINE_THETAS) -> xr.Dataset:
    """Token-level early exit: probe vs softmax margin vs state cosine vs oracle.

    * probe: exit at the first layer the probe says the top-1 is decided (task >= 1);
    * margin: first layer with ``p1 - p2 >= theta`` (softmax response);
    * cosine: first layer with ``cos(h_l, h_{l-1}) >= theta`` (state saturation);
    * oracle: exit at the true s_1 (agrees with the full model by construction).

    Parameters
    ----------
    layer_top1 : [position, layer] int
    top_prob : [position, layer, rank>=2] float
        Lens probabilities of the top-2 tokens per layer.
    cosine : [position, layer] float
        Cosine between consecutive layers' residuals (NaN at layer 0).
    sat_top1 : [position] int
        s_1 (`NEVER` exits at the last layer).
    probe_task : [position, layer] int
    next_token : [position] int
    margin_thetas, cosine_thetas : sequence of float

    Returns
    -------
    xarray.Dataset
        ``margin_accuracy``, ``margin_accuracy_true``, ``margin_speedup`` (theta_margin);
        ``cosine_*`` likewise (theta_cosine); attrs ``probe`` and ``oracle`` (dicts of
        `exit_metrics`) and ``equal_accuracy``: each baseline's best speed-up at an
        accuracy at least the probe's.
    """
    top1 = np.asarray(layer_top1)
    n, n_layers = top1.shape
    final = top1[:, -1]
    p = np.asarray(top_prob, dtype=np.float64)
    margin = p[..., 0] - p[..., 1]
    cos = np.asarray(cosine, dtype=np.float64)
    s1 = np.asarray(sat_top1)
    nxt = np.asarray(next_token)

    def curve(score, thetas):
        rows = [exit_metrics(exit_layers(score, t), top1, final, nxt, n_layers) for t in thetas]
        return {key: np.array([r[key] for r in rows]) for key in ("accuracy", "accuracy_true", "speedup")}

    m = curve(margin, margin_thetas)
    c = curve(cos, cosine_thetas)
    probe_exit = exit_layers(np.asarray(probe_task) >= 1, 0.5)
    oracle_exit = np.where(s1 >= 0, s1, n_layers - 1)
    probe = exit_metrics(probe_exit, top1, final, nxt, n_layers)
    oracle = exit_metrics(oracle_exit, top1, final, nxt, n_layers)

    def at_accuracy(cv, target):
        ok = cv["accuracy"] >= target - 1e-12
        return float(cv["speedup"][ok].max()) if ok.any() else float("nan")

    equal = {"target_accuracy": probe["accuracy"], "probe": probe["speedup"],
             "margin": at_accuracy(m, probe["accuracy"]), "cosine": at_accuracy(c, probe["accuracy"]),
             "oracle": oracle["speedup"]}
    return xr.Dataset(
        {
            "margin_accuracy": (("theta_margin",), m["accuracy"]),
            "margin_accuracy_true": (("theta_margin",), m["accuracy_true"]),
            "margin_speedup": (("theta_margin",), m["speedup"]),
            "cosine_accuracy": (("theta_cosine",), c["accuracy"]),
            "cosine_accuracy_true": (("theta_cosine",), c["accuracy_true"]),
            "cosine_speedup": (("theta_cosine",), c["speedup"]),
        },
        coords={"theta_margin": np.asarray(margin_thetas, float),
                "theta_cosine": np.asarray(cosine_thetas, float)},
        attrs={"probe": probe, "oracle": oracle, "equal_accuracy": equal, "n_positions": n},
    )


#: Accuracy targets of `speedup_at_accuracy`.
EXIT_ACCURACY_TARGETS = (0.8, 0.9, 0.95, 0.99)


def speedup_at_accuracy(ds: xr.Dataset, targets: Sequence[float] = EXIT_ACCURACY_TARGETS, *,
                        against: str = "full model") -> dict[str, Any]:
    """Each early-exit rule's speed-up at fixed accuracy targets, read from stored curves.

    A dict of plain values: headline numbers that the summary and the docs' figures print as
    JSON.

    Parameters
    ----------
    ds : xarray.Dataset
        A `saturation_analysis` result (its early-exit curves and ``early_exit_summary``).
    targets : sequence of float
        Accuracy targets in (0, 1].
    against : {"full model", "true next token"}
        ``"full model"``: the target is the agreement with the full model's token.
        ``"true next token"``: the target is a *fraction of the full model's own*
        true-token accuracy (0.9: at least 90 % of what running every layer gets), since
        that accuracy is far below 0.8 for a small model.

    Returns
    -------
    dict
        ``against``, ``full_model_accuracy`` (1 against the full model; against the true
        token the oracle's, which emits the full model's token at every position),
        ``targets``, ``required_accuracy`` (the absolute accuracy each target asks for)
        and per rule (``margin``, ``cosine``, ``probe``, ``oracle``) lists over the
        targets: ``speedup``, ``accuracy`` and, for the threshold rules, ``theta``. A
        threshold rule takes its fastest theta whose accuracy reaches the target; the probe
        and the oracle have one operating point each, so their speed-up is that point's
        if it reaches the target. NaN where the target is not reached.
    """
    against = check_choice("against", against, ("full model", "true next token"))
    targets = [check_float("target", t, low=0.0, high=1.0) for t in targets]
    if "early_exit_summary" not in ds:
        raise InputError("this result has no early-exit curves (sample_positions was 0)")
    info = json.loads(str(ds.early_exit_summary.values))
    suffix = "" if against == "full model" else "_true"
    key = "accuracy" + suffix
    full = 1.0 if against == "full model" else float(info["oracle"]["accuracy_true"])
    required = [t * full for t in targets]
    out: dict[str, Any] = {"against": against, "full_model_accuracy": full,
                           "targets": targets, "required_accuracy": required}
    for rule in ("margin", "cosine"):
        acc = np.asarray(ds[f"{rule}_accuracy{suffix}"].values, float)
        speed = np.asarray(ds[f"{rule}_speedup"].values, float)
        theta = np.asarray(ds[f"theta_{rule}"].values, float)
        row: dict[str, list[float]] = {"speedup": [], "accuracy": [], "theta": []}
        for need in required:
            ok = np.flatnonzero(acc >= need - 1e-12)
            i = int(ok[np.argmax(speed[ok])]) if len(ok) else -1
            row["speedup"].append(float(speed[i]) if i >= 0 else float("nan"))
            row["accuracy"].append(float(acc[i]) if i >= 0 else float("nan"))
            row["theta"].append(float(theta[i]) if i >= 0 else float("nan"))
        out[rule] = row
    for rule in ("probe", "oracle"):
        point = info[rule]
        reached = [point[key] >= need - 1e-12 for need in required]
        out[rule] = {"speedup": [float(point["speedup"]) if r else float("nan") for r in reached],
                     "accuracy": [float(point[key]) if r else float("nan") for r in reached]}
    return out
