"""The pre-registered analysis of a study: accuracy per condition and the hypotheses.

- Accuracy per condition is the share of correct answers, pooled over responses, with a
  percentile bootstrap interval that resamples *participants* (a cluster bootstrap:
  answers of one person are not independent), stratified by condition in a between design.
- Each hypothesis compares two conditions: the difference in accuracy and Cohen's h
  (``2 asin sqrt(p_a) - 2 asin sqrt(p_b)``, Cohen 1988), each with a bootstrap interval
  from the same replicates, and a permutation p-value (condition labels swapped within each
  participant in a within design, permuted between participants in a between design), with
  Holm's correction over the hypotheses unless the study says ``correction: none``.
- Participants who fail an attention check are excluded when the study says so (the
  default); partial participants count with the trials they answered.

`simulated_responses` and `simulate_participants` draw participants with known accuracies,
to check the analysis (and a study's power) before anyone takes part.

References
----------
U. Pičulin, M. Petek, I. Ograjenšek and E. Štrumbelj, "Position: Explainable AI Cannot
Advance Without Better User Studies", ICML 2025.
J. Cohen, "Statistical Power Analysis for the Behavioral Sciences", 2nd ed., 1988.
S. Holm, "A simple sequentially rejective multiple test procedure", Scand. J. Stat., 1979.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import xarray as xr

from explorer._checks import InputError, check_float, check_int

from .randomise import ATTENTION_CONDITION, participant_schedule
from .schema import Study

__all__ = ["analyse", "analyse_responses", "cohens_h", "holm", "simulated_responses",
           "simulate_participants"]


def cohens_h(p_a: Any, p_b: Any) -> Any:
    """Cohen's h between proportions: ``2 asin(sqrt(p_a)) - 2 asin(sqrt(p_b))``."""
    return 2 * np.arcsin(np.sqrt(p_a)) - 2 * np.arcsin(np.sqrt(p_b))


def holm(p_values: Sequence[float]) -> np.ndarray:
    """Holm's step-down adjusted p-values (same order as given)."""
    p = np.asarray(p_values, dtype=float)
    m = p.size
    order = np.argsort(p, kind="stable")
    adjusted = np.minimum(1.0, np.maximum.accumulate((m - np.arange(m)) * p[order]))
    out = np.empty(m)
    out[order] = adjusted
    return out


def analyse(run: Any) -> xr.Dataset:
    """`analyse_responses` on every response stored in a `StudyRun`."""
    ds = analyse_responses(run.store.responses(), run.study,
                           n_enrolled=len(run.store.participants()))
    ds.attrs["model"] = run.info["model"]["name"]
    ds.attrs["items_versions"] = run.info["versions"]
    return ds


def analyse_responses(responses: Sequence[Mapping[str, Any]], study: Study, *,
                      n_enrolled: int | None = None) -> xr.Dataset:
    """Accuracy per condition and the pre-registered comparisons, with intervals.

    Parameters
    ----------
    responses : sequence of mapping
        Rows with ``code``, ``condition``, ``correct`` (0/1), ``confidence``, ``rt_ms``
        and ``attention_check`` (bool), as `ResponseStore.responses` returns them.
    study : Study
        Conditions, hypotheses and the analysis plan (bootstrap size, level, seed...).
    n_enrolled : int, optional
        Participants enrolled (default: those with a response).

    Returns
    -------
    xarray.Dataset
        Over ``condition``: ``accuracy``, ``accuracy_low``, ``accuracy_high``,
        ``n_responses``, ``n_participants``, ``mean_confidence``, ``median_rt_ms``.
        Over ``hypothesis``: ``effect`` (accuracy difference a - b), ``effect_low``,
        ``effect_high``, ``cohens_h``, ``cohens_h_low``, ``cohens_h_high``, ``p_value``,
        ``p_adjusted``, ``supported``. Attrs: the plan, seeds, counts, exclusions.
    """
    plan = study.analysis
    names = list(study.condition_names)
    rows = [dict(r) for r in responses]
    codes_all = sorted({r["code"] for r in rows})
    failed = sorted({r["code"] for r in rows if r.get("attention_check") and not r["correct"]})
    excluded = set(failed) if plan.exclude_failed_attention else set()
    task_rows = [r for r in rows if r["condition"] != ATTENTION_CONDITION and not r.get("attention_check")
                 and r["code"] not in excluded]
    unknown = sorted({r["condition"] for r in task_rows} - set(names))
    if unknown:
        raise InputError(f"responses name conditions the study does not have: {unknown}; "
                         f"the study's are {names}.")
    codes = sorted({r["code"] for r in task_rows})
    p_index = {c: i for i, c in enumerate(codes)}
    c_index = {c: i for i, c in enumerate(names)}
    n_p, n_c = len(codes), len(names)
    hits = np.zeros((n_p, n_c))
    counts = np.zeros((n_p, n_c))
    for r in task_rows:
        i, j = p_index[r["code"]], c_index[r["condition"]]
        hits[i, j] += int(r["correct"])
        counts[i, j] += 1

    with np.errstate(invalid="ignore", divide="ignore"):
        accuracy = hits.sum(0) / counts.sum(0)                                 # [condition]
    rng = np.random.default_rng(np.random.SeedSequence([plan.seed, 101]))
    strata = _strata(counts, study.design)
    weights = _bootstrap_weights(strata, plan.bootstrap, rng)                  # [boot, participant]
    with np.errstate(invalid="ignore", divide="ignore"):
        boot = (weights @ hits) / (weights @ counts)                           # [boot, condition]
    tail = (1 - plan.confidence_level) / 2
    acc_low, acc_high = _percentiles(boot, tail)

    effects, h, p_values = [], [], []
    effect_ci, h_ci = [], []
    for hyp in study.hypotheses:
        a, b = c_index[hyp.compare[0]], c_index[hyp.compare[1]]
        effects.append(accuracy[a] - accuracy[b])
        h.append(cohens_h(accuracy[a], accuracy[b]))
        effect_ci.append(_percentiles(boot[:, a] - boot[:, b], tail))
        h_ci.append(_percentiles(cohens_h(boot[:, a], boot[:, b]), tail))
        p_values.append(_permutation_p(hits[:, [a, b]], counts[:, [a, b]], study.design,
                                       hyp.direction, plan.permutations, rng))
    p_values = np.asarray(p_values, dtype=float)
    p_adjusted = holm(p_values) if plan.correction == "holm" else p_values.copy()
    effects = np.asarray(effects, dtype=float)
    supported = []
    for hyp, eff, p in zip(study.hypotheses, effects, p_adjusted):
        right_way = {"greater": eff > 0, "less": eff < 0, "two-sided": True}[hyp.direction]
        supported.append(bool(np.isfinite(p) and p < plan.alpha and right_way))

    conf = np.full(n_c, np.nan)
    rt = np.full(n_c, np.nan)
    n_participants = np.zeros(n_c, dtype=int)
    for name, j in c_index.items():
        sel = [r for r in task_rows if r["condition"] == name]
        if sel:
            conf[j] = float(np.mean([r["confidence"] for r in sel]))
            rt[j] = float(np.median([r["rt_ms"] for r in sel]))
        n_participants[j] = int((counts[:, j] > 0).sum())

    hyps = study.hypotheses
    n_choices = study.task.n_choices
    return xr.Dataset(
        {
            "accuracy": ("condition", accuracy),
            "accuracy_low": ("condition", acc_low),
            "accuracy_high": ("condition", acc_high),
            "n_responses": ("condition", counts.sum(0).astype(int)),
            "n_participants": ("condition", n_participants),
            "mean_confidence": ("condition", conf),
            "median_rt_ms": ("condition", rt),
            "effect": ("hypothesis", effects),
            "effect_low": ("hypothesis", np.array([c[0] for c in effect_ci])),
            "effect_high": ("hypothesis", np.array([c[1] for c in effect_ci])),
            "cohens_h": ("hypothesis", np.asarray(h, dtype=float)),
            "cohens_h_low": ("hypothesis", np.array([c[0] for c in h_ci])),
            "cohens_h_high": ("hypothesis", np.array([c[1] for c in h_ci])),
            "p_value": ("hypothesis", p_values),
            "p_adjusted": ("hypothesis", p_adjusted),
            "supported": ("hypothesis", np.array(supported, dtype=bool)),
        },
        coords={
            "condition": names,
            "condition_kind": ("condition", [c.kind for c in study.conditions]),
            "placebo": ("condition", [c.placebo or "" for c in study.conditions]),
            "hypothesis": [x.id for x in hyps],
            "statement": ("hypothesis", [x.statement for x in hyps]),
            "compare_a": ("hypothesis", [x.compare[0] for x in hyps]),
            "compare_b": ("hypothesis", [x.compare[1] for x in hyps]),
            "direction": ("hypothesis", [x.direction for x in hyps]),
        },
        attrs={
            "method": "study_analysis",
            "study": study.name,
            "study_sha256": study.sha256,
            "design": study.design,
            "seeds": {"randomisation": study.seed, "analysis": plan.seed},
            "bootstrap": plan.bootstrap,
            "permutations": plan.permutations,
            "confidence_level": plan.confidence_level,
            "alpha": plan.alpha,
            "correction": plan.correction,
            "chance_accuracy": 1.0 / n_choices,
            "n_enrolled": int(len(codes_all) if n_enrolled is None else n_enrolled),
            "n_with_responses": len(codes_all),
            "n_analysed": n_p,
            "n_failed_attention": len(failed),
            "n_excluded": len(excluded),
            "exclude_failed_attention": plan.exclude_failed_attention,
            "n_simulated": len({r["code"] for r in rows if r.get("simulated")}),
            "n_complete": _n_complete(rows, study),
        },
    )


def _n_complete(rows: Sequence[Mapping[str, Any]], study: Study) -> int:
    per_code: dict[str, int] = {}
    for r in rows:
        per_code[r["code"]] = per_code.get(r["code"], 0) + 1
    n_trials = len(study.prompts) + study.task.attention_checks
    return sum(n == n_trials for n in per_code.values())


def _strata(counts: np.ndarray, design: str) -> np.ndarray:
    """Bootstrap strata: one in a within design; the participant's condition in a between one."""
    if design == "within":
        return np.zeros(counts.shape[0], dtype=int)
    return np.argmax(counts > 0, axis=1)


def _bootstrap_weights(strata: np.ndarray, n_boot: int, rng: np.random.Generator) -> np.ndarray:
    """How often each participant is drawn in each replicate: [boot, participant]."""
    weights = np.zeros((n_boot, strata.size))
    for s in np.unique(strata):
        members = np.flatnonzero(strata == s)
        m = members.size
        weights[:, members] = rng.multinomial(m, np.full(m, 1.0 / m), size=n_boot)
    return weights


def _percentiles(x: np.ndarray, tail: float) -> tuple[Any, Any]:
    """Lower and upper percentile bounds over the first axis, ignoring undefined replicates."""
    x = np.asarray(x, dtype=float)
    if x.ndim == 1:
        finite = x[np.isfinite(x)]
        if finite.size == 0:
            return np.nan, np.nan
        return tuple(np.quantile(finite, [tail, 1 - tail]))
    low = np.full(x.shape[1], np.nan)
    high = np.full(x.shape[1], np.nan)
    for j in range(x.shape[1]):
        low[j], high[j] = _percentiles(x[:, j], tail)
    return low, high


def _permutation_p(hits: np.ndarray, counts: np.ndarray, design: str, direction: str,
                   n_perm: int, rng: np.random.Generator) -> float:
    """Permutation p-value of ``acc_a - acc_b`` from [participant, 2] hits and counts."""
    def diff(h, n):  # h, n: [..., participant, 2]
        with np.errstate(invalid="ignore", divide="ignore"):
            acc = h.sum(-2) / n.sum(-2)
        return acc[..., 0] - acc[..., 1]

    observed = diff(hits, counts)
    if not np.isfinite(observed):
        return float("nan")
    if design == "within":
        # swap the two conditions' labels within each participant with probability 1/2
        flip = rng.random((n_perm, hits.shape[0])) < 0.5                   # [perm, participant]
        h = np.where(flip[..., None], hits[None, :, ::-1], hits[None])     # [perm, participant, 2]
        n = np.where(flip[..., None], counts[None, :, ::-1], counts[None])
    else:
        # reassign the group labels of the participants in the two groups
        in_pair = np.flatnonzero(counts.sum(1) > 0)
        total_h = hits[in_pair].sum(1)
        total_n = counts[in_pair].sum(1)
        in_a = counts[in_pair, 0] > 0                                       # [participant]
        keys = rng.random((n_perm, in_pair.size))
        ranks = np.argsort(np.argsort(keys, axis=1), axis=1)
        group_a = ranks < in_a.sum()                                        # [perm, participant]
        h = np.stack([total_h * group_a, total_h * ~group_a], axis=-1)
        n = np.stack([total_n * group_a, total_n * ~group_a], axis=-1)
    null = diff(h, n)
    null = null[np.isfinite(null)]
    eps = 1e-12
    if direction == "greater":
        extreme = np.sum(null >= observed - eps)
    elif direction == "less":
        extreme = np.sum(null <= observed + eps)
    else:
        extreme = np.sum(np.abs(null) >= abs(observed) - eps)
    return float((1 + extreme) / (1 + null.size))


# -- simulated participants ----------------------------------------------------------------

def _check_accuracy(study: Study, accuracy: Mapping[str, float]) -> dict[str, float]:
    missing = [c for c in study.condition_names if c not in accuracy]
    extra = [c for c in accuracy if c not in study.condition_names]
    if missing or extra:
        raise InputError(f"`accuracy` must give one value per condition "
                         f"({', '.join(study.condition_names)}); "
                         f"{'missing ' + ', '.join(missing) if missing else 'unknown ' + ', '.join(extra)}.")
    return {c: check_float(f"accuracy[{c!r}]", accuracy[c], low=0.0, high=1.0) for c in accuracy}


def simulated_responses(study: Study, accuracy: Mapping[str, float], *, seed: int,
                        n_participants: int | None = None, spread: float = 0.0,
                        attention_pass: float = 1.0) -> list[dict[str, Any]]:
    """Responses of simulated participants with known accuracy per condition.

    Participant ``i`` takes slot ``i`` of the study's schedule and answers each trial
    correctly with probability ``accuracy[condition]`` plus their own offset, uniform in
    ``[-spread, spread]`` (clipped to [0, 1]), so the population accuracy is ``accuracy``
    when nothing is clipped.

    Parameters
    ----------
    study : Study
    accuracy : mapping of condition name to float
    seed : int
    n_participants : int, optional
        Default ``study.participants``.
    spread : float, default=0.0
    attention_pass : float, default=1.0
        Probability of passing each attention check.

    Returns
    -------
    list of dict
        Rows like `ResponseStore.responses` (``code`` ``SIM-0001``..., ``simulated`` True).
    """
    accuracy = _check_accuracy(study, accuracy)
    n = study.participants if n_participants is None else check_int(
        "n_participants", n_participants, low=1, high=study.participants)
    spread = check_float("spread", spread, low=0.0, high=1.0)
    attention_pass = check_float("attention_pass", attention_pass, low=0.0, high=1.0)
    rng = np.random.default_rng(np.random.SeedSequence([check_int("seed", seed, low=0), 202]))
    rows = []
    for slot in range(n):
        offset = rng.uniform(-spread, spread) if spread else 0.0
        code = f"SIM-{slot + 1:04d}"
        for trial in participant_schedule(study, slot):
            check = trial.condition == ATTENTION_CONDITION
            p = attention_pass if check else float(np.clip(accuracy[trial.condition] + offset, 0, 1))
            rows.append({"code": code, "slot": slot, "trial_index": trial.index,
                         "item_id": trial.item_id, "condition": trial.condition,
                         "correct": int(rng.random() < p),
                         "confidence": int(rng.integers(1, study.task.confidence_levels + 1)),
                         "rt_ms": float(rng.lognormal(np.log(8000), 0.5)),
                         "attention_check": check, "simulated": True})
    return rows


def simulate_participants(run: Any, accuracy: Mapping[str, float], *, seed: int,
                          n_participants: int | None = None, spread: float = 0.0,
                          attention_pass: float = 1.0) -> list[str]:
    """Enrol simulated participants in a `StudyRun` and store their answers.

    Goes through the same store calls as the app (`enrol`, `record_response`), one
    transaction per response. A wrong answer picks one of the wrong choices uniformly.
    Parameters as in `simulated_responses`; returns the new participants' codes.
    """
    free = run.store.n_slots - len(run.store.participants())
    n = free if n_participants is None else check_int("n_participants", n_participants,
                                                      low=1, high=max(1, free))
    if free == 0:
        raise InputError("the study is full: no free participant places to simulate.")
    draws = simulated_responses(run.study, accuracy, seed=seed, n_participants=run.study.participants,
                                spread=spread, attention_pass=attention_pass)
    rng = np.random.default_rng(np.random.SeedSequence([int(seed), 303]))
    codes = []
    for _ in range(n):
        part = run.store.enrol(simulated=True)
        codes.append(part.code)
        t = 0.0
        for d in (d for d in draws if d["slot"] == part.slot):
            item = run.items[d["item_id"]]
            wrong = [i for i in range(len(item["choices"])) if i != item["answer"]]
            choice = item["answer"] if d["correct"] else int(rng.choice(wrong))
            run.store.record_response(part.code, d["trial_index"], choice=choice,
                                      confidence=d["confidence"], shown_at=part.consented_at + t,
                                      answered_at=part.consented_at + t + d["rt_ms"] / 1000,
                                      confidence_levels=run.study.task.confidence_levels)
            t += d["rt_ms"] / 1000
    return codes
