"""The whole saturation analysis: `saturation_analysis` runs the lens pass, order test, task
probe, early exit and intervention over texts and returns one Dataset (cached whole in the
store), and `saturation_summary` reads its headline numbers.
"""
from __future__ import annotations

import json
from typing import Any

import numpy as np
import xarray as xr

from explorer._checks import InputError, check_float, check_int, check_prompts
from explorer.analyses.saturation.exits import early_exit
from explorer.analyses.saturation.intervention import (
    intervention_pair_defaults,
    inject_residual,
    intervention_pairs,
)
from explorer.analyses.saturation.lens_pass import _lens_params, saturation_layers
from explorer.analyses.saturation.over_store import saturation_over_store
from explorer.analyses.saturation.stats import (
    CITATION,
    NEVER,
    kept_positions,
    order_test,
    task_labels,
    task_probe,
)

__all__ = ["saturation_analysis", "saturation_summary"]

def saturation_analysis(model: Any, texts: Any, *, k: int = 10, max_ratio: float = 0.85,
                        min_ranks: int = 3, n_permutations: int = 1000, n_tasks: int = 4,
                        sample_positions: int = 1000, probe_min_layer: int = 0,
                        n_pairs: int = 8, min_gap: int | None = None,
                        min_sat_layer: int | None = None, window: int | None = None,
                        rank_cap: int = 50, unembed_dtype: str = "float32",
                        part_texts: int | None = None, batch_size: int = 4, seed: int = 0,
                        scheduler: str | None = None, store: Any = None,
                        progress: Any = None) -> xr.Dataset:
    """Saturation layers, order test, task probe, early exit and intervention over texts.

    Parameters
    ----------
    model : Model
    texts : str or list of str
        Prompts, e.g. ``corpus_chunks(model, load_corpus())``.
    k : int, default=10
        Ranks tracked; the order test is run for every k' in 3..k.
    max_ratio : float, default=0.85
        Position filter: s_1 + 1 <= max_ratio * L (order test and probe training).
    min_ranks : int, default=3
    n_permutations : int, default=1000
    n_tasks : int, default=4
        Probe classes: 0..n_tasks-1 leading ranks decided (the last class: that many or more).
    sample_positions : int, default=1000
        Positions used by the probe and the early-exit comparison.
    probe_min_layer : int, default=0
    n_pairs : int, default=8
        Intervention pairs (see `intervention_pairs`); 0 skips the intervention.
    min_gap, min_sat_layer : int, optional
        Pair selection (see `intervention_pairs`): s_1(late) - s_1(early) >= ``min_gap``
        and both s_1 >= ``min_sat_layer``; defaults the paper's 10 of GPT-2's 48 layers,
        scaled: ``max(1, round(10 * L / 48))`` each.
    window : int, optional
        Injection layers s_early - window .. s_early + window; default
        ``max(1, round(5 * L / 48))`` (the paper's 5 of GPT-2's 48 layers).
    rank_cap, unembed_dtype, part_texts, batch_size, seed, store, progress
        As in `saturation_layers`; with ``store`` the whole result is cached as well.
    scheduler : str, optional
        With ``store``: compute saturation layers, the position filter and tau per position
        out of core with dask over the cached lens ranks (`saturation_over_store`), on
        this scheduler (see `explorer.distributed.dask_scheduler`). The result is the same.

    Returns
    -------
    xarray.Dataset
        Everything of `saturation_layers` but ``resid_sample``, plus: ``kept`` (prompt,
        pos); ``tau``, ``tau_shuffled`` (k_order, prompt, pos), ``mean_tau``, ``p_value``,
        ``n_order_positions`` (k_order), ``null_mean_tau`` (k_order, permutation); the
        probe (`task_probe`, prefixed ``probe_``/``control_``, its depth-only and
        shuffled-residual baselines ``depth_``/``shuffled_layer_accuracy``); ``task_label``
        (sample, layer); early-exit curves (`early_exit`); intervention results
        ``pair_prompt``, ``pair_early``, ``pair_late`` (pair), ``inj_layer``,
        ``inj_s1_after``, ``inj_changed`` (pair, offset). ``attrs["summary"]`` holds the
        headline numbers (see `saturation_summary`).

    References
    ----------
    Lioubashevski et al., ICML 2025.
    """
    from explorer.trace import provenance

    texts = check_prompts(texts)
    max_ratio = check_float("max_ratio", max_ratio, low=0.0, high=1.0)
    k = check_int("k", k, low=1, high=64)
    min_ranks = check_int("min_ranks", min_ranks, low=2, high=max(2, k))
    n_permutations = check_int("n_permutations", n_permutations, low=1)
    n_tasks = check_int("n_tasks", n_tasks, low=2, high=k + 1)
    n_pairs = check_int("n_pairs", n_pairs, low=0)
    n_layers = model.n_layers
    probe_min_layer = check_int("probe_min_layer", probe_min_layer, low=0, high=n_layers - 1)
    if window is None:
        window = max(1, round(5 * n_layers / 48))
    window = check_int("window", window, low=0, high=n_layers)
    min_gap, min_sat_layer = intervention_pair_defaults(n_layers, min_gap, min_sat_layer)
    if scheduler is not None:
        from explorer.distributed import check_scheduler

        scheduler = check_scheduler(scheduler)
    lens_params = _lens_params(model, k=k, rank_cap=rank_cap, sample_positions=sample_positions,
                               seed=seed, unembed_dtype=unembed_dtype)
    params = dict(k=k, max_ratio=max_ratio, min_ranks=min_ranks, n_permutations=n_permutations,
                  n_tasks=n_tasks, sample_positions=sample_positions,
                  probe_min_layer=probe_min_layer, n_pairs=n_pairs, min_gap=min_gap,
                  min_sat_layer=min_sat_layer, window=window, rank_cap=rank_cap, seed=seed)
    if "unembed_dtype" in lens_params:
        params["unembed_dtype"] = lens_params["unembed_dtype"]

    def compute() -> xr.Dataset:
        lens = saturation_layers(model, texts, k=k, rank_cap=rank_cap,
                                 sample_positions=sample_positions, batch_size=batch_size,
                                 seed=seed, unembed_dtype=unembed_dtype, part_texts=part_texts,
                                 store=store, progress=progress)
        per_position = None
        if scheduler is not None and store is not None:
            per_position = saturation_over_store(
                lens, n_layers=n_layers, max_ratio=max_ratio, k_orders=_order_ks(k, min_ranks),
                min_ranks=min_ranks, scheduler=scheduler)
        ds = saturation_from_lens(model, texts, lens.load(), per_position=per_position,
                      **{key: v for key, v in params.items() if key != "unembed_dtype"})
        ds.attrs = provenance(model, method="saturation", citation=CITATION,
                              n_texts=len(texts), **params)
        ds.attrs["summary"] = saturation_summary(ds)
        return ds

    if store is None:
        return compute()
    parts = {"model": model.spec.provenance(), "method": "saturation", "texts": texts,
             "params": params}
    return store.get_or_compute(parts, compute)


def _order_ks(k: int, min_ranks: int) -> list[int]:
    """The k' of the order tests: 3..k (from min_ranks if larger)."""
    return list(range(max(3, min_ranks), k + 1))


def saturation_from_lens(model: Any, texts: list[str], lens: xr.Dataset, *, k: int,
                         max_ratio: float, min_ranks: int, n_permutations: int, n_tasks: int,
                         sample_positions: int, probe_min_layer: int, n_pairs: int, min_gap: int,
                         min_sat_layer: int, window: int, rank_cap: int, seed: int,
                         per_position: xr.Dataset | None = None) -> xr.Dataset:
    """`saturation_analysis` on a lens pass already computed (``lens``, from the lens pass of
    ``texts``), every option explicit: the order test, the task probes and the injection pairs.
    The command layer and the evidence benchmark call it with their own settings."""
    n_layers = model.n_layers
    ds = lens.drop_vars(["resid_sample"])
    mask = lens.mask.values
    if per_position is None:
        sat = lens.sat_layer.values.astype(np.int64)                   # [prompt, pos, rank]
        kept = kept_positions(sat, n_layers, max_ratio=max_ratio) & mask
    else:
        sat = per_position.sat_layer.values.astype(np.int64)
        kept = per_position.kept.values
    ds["kept"] = (("prompt", "pos"), kept)

    # order test for every k' in 3..k
    ks = _order_ks(k, min_ranks)
    flat = sat[kept]                                                   # [n_kept, rank]
    n_pos_shape = mask.shape
    tau = np.full((len(ks), *n_pos_shape), np.nan)
    tau_sh = np.full((len(ks), *n_pos_shape), np.nan)
    null = np.full((len(ks), n_permutations), np.nan)
    mean_tau, p_val, n_ord = (np.full(len(ks), np.nan) for _ in range(3))
    for i, kk in enumerate(ks):
        if len(flat) == 0:
            break
        res = order_test(flat, n_layers, k=kk, min_ranks=min(min_ranks, kk),
                         n_permutations=n_permutations, seed=seed)
        tau[i][kept] = res["tau"]
        if per_position is not None:         # computed out of core: the same numbers
            tau[i] = per_position.tau.sel(k_order=kk).values
        tau_sh[i][kept] = res["tau_shuffled"]
        null[i] = res["null_mean_tau"]
        mean_tau[i], p_val[i], n_ord[i] = res["mean_tau"], res["p_value"], res["n_positions"]
    ds = ds.assign_coords(k_order=np.array(ks, dtype=np.int64), permutation=np.arange(n_permutations))
    ds["tau"] = (("k_order", "prompt", "pos"), tau.astype(np.float32))
    ds["tau_shuffled"] = (("k_order", "prompt", "pos"), tau_sh.astype(np.float32))
    ds["mean_tau"] = (("k_order",), mean_tau)
    ds["p_value"] = (("k_order",), p_val)
    ds["n_order_positions"] = (("k_order",), n_ord)
    ds["null_mean_tau"] = (("k_order", "permutation"), null)

    # task probe on the sampled positions, early exit on the same positions
    sp, sq = lens.sample_prompt.values, lens.sample_pos.values
    if len(sp) >= 10:
        s_sat = sat[sp, sq]                                            # [S, rank]
        labels = task_labels(s_sat, n_layers, n_tasks=n_tasks)         # [S, layer]
        ds["task_label"] = (("sample", "layer"), labels)
        try:
            probe = task_probe(lens.resid_sample.values, labels, train_mask=kept[sp, sq],
                               min_layer=probe_min_layer, seed=seed)
        except InputError as err:
            ds.attrs["probe_error"] = str(err)
            probe = None
        if probe is not None:
            ds["probe_task"] = probe.probe_task
            ds["probe_layer_accuracy"] = probe.probe_layer_accuracy
            ds["control_layer_accuracy"] = probe.control_layer_accuracy
            ds["depth_layer_accuracy"] = probe.depth_layer_accuracy
            ds["shuffled_layer_accuracy"] = probe.shuffled_layer_accuracy
            ds = ds.assign_coords(task=probe.task.values)
            ds["probe_class_recall"] = probe.probe_class_recall
            ds["probe_summary"] = ((), json.dumps({key: probe.attrs[key] for key in (
                "balanced_accuracy", "control_balanced_accuracy", "chance", "classes",
                "depth_balanced_accuracy", "shuffled_balanced_accuracy", "probe_minus_depth",
                "probe_minus_depth_low", "probe_minus_depth_high", "probe_beats_depth")}))
            ee = early_exit(lens.top_token_id.values[sp, sq, :, 0], lens.top_prob.values[sp, sq],
                            lens.cosine.values[sp, sq], s_sat[:, 0], probe.probe_task.values,
                            lens.next_token_id.values[sp, sq])
            for name in ee.data_vars:
                ds[name] = ee[name]
            ds["early_exit_summary"] = ((), json.dumps({key: ee.attrs[key] for key in (
                "probe", "oracle", "equal_accuracy", "n_positions")}))

    # intervention
    pairs = intervention_pairs(sat, lens.final_token_id.values[..., 0], kept, n_layers,
                               min_gap=min_gap, min_sat_layer=min_sat_layer, n_pairs=n_pairs,
                               seed=seed) if n_pairs else np.zeros((0, 3), int)
    offsets = np.arange(-window, window + 1)
    inj_layer = np.full((len(pairs), len(offsets)), -1, dtype=np.int64)
    inj_s1 = np.full((len(pairs), len(offsets)), NEVER - 1, dtype=np.int64)
    inj_changed = np.zeros((len(pairs), len(offsets)), dtype=bool)
    if len(pairs):
        from explorer.trace import clean_run
        for pi, (p, early, late) in enumerate(pairs):
            clean = None if model.remote else clean_run(model, [texts[p]])
            s_early = int(sat[p, early, 0])
            base = {"rank": lens.final_rank.values[p, late, :, 0].astype(int).tolist(),
                    "top1": int(lens.final_token_id.values[p, late, 0])}
            for oi, off in enumerate(offsets):
                layer = s_early + int(off)
                if not 0 <= layer <= n_layers - 2:
                    continue
                r = inject_residual(model, texts[p], source_pos=int(early), target_pos=int(late),
                                    layer=layer, clean=clean, baseline=base)
                inj_layer[pi, oi], inj_s1[pi, oi] = layer, r["s1_after"]
                inj_changed[pi, oi] = r["prediction_changed"]
    ds = ds.assign_coords(pair=np.arange(len(pairs)), offset=offsets)
    ds["pair_prompt"] = (("pair",), pairs[:, 0].astype(np.int64))
    ds["pair_early"] = (("pair",), pairs[:, 1].astype(np.int64))
    ds["pair_late"] = (("pair",), pairs[:, 2].astype(np.int64))
    ds["inj_layer"] = (("pair", "offset"), inj_layer)
    ds["inj_s1_after"] = (("pair", "offset"), inj_s1)
    ds["inj_changed"] = (("pair", "offset"), inj_changed)
    return ds


def saturation_summary(ds: xr.Dataset, *, k: int | None = None) -> dict[str, Any]:
    """Headline numbers of a `saturation_analysis` result (JSON-able).

    ``k`` picks the order test (default 5 if computed, else the largest); the dict holds
    ``n_tokens``, ``kept_fraction``, ``mean_tau``, ``p_value``, ``n_order_positions``,
    ``probe`` (balanced accuracy, control, chance), ``early_exit`` (speed-ups at the
    probe's accuracy, oracle) and ``intervention`` (pairs, mean s_1 change at the early
    token's saturation layer, fraction of predictions changed).

    A dict, not a Dataset: it is the Dataset's headline numbers as nested JSON scalars and
    lists, what the command's ``--json`` prints and a benchmark writes to docs/figures.
    """
    n_tokens = int(ds.mask.values.sum())
    out: dict[str, Any] = {"n_tokens": n_tokens, "n_texts": int(ds.sizes["prompt"]),
                           "n_layers": int(ds.sizes["layer"]),
                           "kept_fraction": float(ds.kept.values.sum() / max(1, n_tokens))}
    ks = ds.k_order.values.tolist()
    if ks:
        kk = k if k in ks else (5 if 5 in ks else ks[-1])
        sel = ds.sel(k_order=kk)
        null = sel.null_mean_tau.values[np.isfinite(sel.null_mean_tau.values)]
        out.update(order_k=int(kk), mean_tau=float(sel.mean_tau), p_value=float(sel.p_value),
                   n_order_positions=int(sel.n_order_positions),
                   null_mean_tau_mean=float(null.mean()) if null.size else float("nan"),
                   mean_tau_by_k={str(x): float(ds.mean_tau.sel(k_order=x)) for x in ks})
    if "probe_summary" in ds:
        out["probe"] = json.loads(str(ds.probe_summary.values))
    if "early_exit_summary" in ds:
        out["early_exit"] = json.loads(str(ds.early_exit_summary.values))
    if ds.sizes.get("pair", 0):
        w = ds.sizes["offset"] // 2
        at = ds.isel(offset=w)                                   # inject at s_early
        valid = at.inj_layer.values >= 0
        late = ds.sat_layer.values[ds.pair_prompt.values, ds.pair_late.values, 0]
        delta = (at.inj_s1_after.values - late)[valid]
        allv = ds.inj_layer.values >= 0
        out["intervention"] = {
            "n_pairs": int(ds.sizes["pair"]),
            "mean_s1_change_at_s_early": float(delta.mean()) if valid.any() else float("nan"),
            "fraction_earlier_at_s_early": float((delta < 0).mean()) if valid.any() else float("nan"),
            "prediction_changed_fraction": float(ds.inj_changed.values[allv].mean())
            if allv.any() else float("nan"),
        }
    return out
