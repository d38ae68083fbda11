"""Evidence for docs/unlearning.md: mechanistic unlearning of athlete -> sport facts on SmolLM2.

Stages (each one process at one CPU thread; several seeds may run side by side):

    python benchmarks/unlearning_evidence.py --stages localize
    python benchmarks/unlearning_evidence.py --stages sweep --seed 0 --sweep-lrs 1e-5,3e-5,3e-6
    python benchmarks/unlearning_evidence.py --stages seed --seed 0
    python benchmarks/unlearning_evidence.py --stages seed --seed 1
    python benchmarks/unlearning_evidence.py --stages seed --seed 2
    python benchmarks/unlearning_evidence.py --stages merge,figures
    python benchmarks/unlearning_evidence.py --stages latent --seed 0

``localize`` keeps the facts SmolLM2 answers (trained format), computes the probe curve
over all athletes and a causal-tracing layer x position heatmap for one fact. ``sweep``
runs the relearning attack on the original model (nothing unlearned) for several learning
rates and reads held-out accuracy after every step: the attack setting is the strongest
one that leaves the original model's held-out answers where they were. ``seed`` draws a
forget / retain split with that seed, runs causal tracing and attribution patching over
its forget set and `unlearning_comparison` for every method with the same MLP budget; it
writes ``docs/figures/unlearning_seed<seed>.json`` after each method, so a run cut short
keeps what it finished. ``merge`` gathers the seeds into
``docs/figures/unlearning_summary.json`` (mean, standard deviation, min and max per metric);
``figures`` draws the PNGs from it. ``latent`` (after ``seed`` for that seed) unlearns with
each method again (same split, layers and settings, no relearning) and fits per-layer probes
for the sport on the unlearned model's residuals of the known facts outside the forget set,
read on the forget set (Guo et al.'s latent probe); it writes
``docs/figures/unlearning_latent_seed<seed>.json``.
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

import _figures  # benchmarks/_figures.py, beside this script
from explorer.commands._common import add_number_options
from explorer.defaults import DEFAULT_MODEL

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
FIGURES = ROOT / "docs" / "figures"
SUMMARY = FIGURES / "unlearning_summary.json"
METHODS = ["fact_lookup", "causal_tracing", "attribution_patching", "all", "random",
           "causal_tracing_mlp", "attribution_patching_mlp"]

# the relearning attack (relearn_steps, relearn_lr) comes from the `sweep` stage: the
# strongest setting swept that leaves the original model's held-out accuracy at 1 on the
# splits of seeds 0 and 1. The general-text retain term reads 4 windows of 64 tokens of the
# corpus's training documents per step; perplexity is read on 16 windows of its held-out
# documents.
FULL = dict(n_forget=16, n_retain=8, n_layers=4, steps=8, lr=2e-4, retain_weight=1.0,
            text_weight=1.0, text_batch=4, text_window=64, heldout_windows=16,
            relearn_steps=3, relearn_lr=3e-5, seeds=[0, 1, 2], known_only=True)
# a few seconds per stage on the tiny model, for tests of the script (--settings reduced)
REDUCED = dict(n_forget=4, n_retain=2, n_layers=1, steps=2, lr=1e-2, retain_weight=1.0,
               text_weight=1.0, text_batch=2, text_window=16, heldout_windows=2,
               relearn_steps=1, relearn_lr=1e-3, seeds=[0, 1, 2], known_only=False)
SETTINGS = dict(FULL)
FACTS = None  # the fact file (None: the shipped athlete -> sport facts)


def _load(path: Path | None = None) -> dict[str, Any]:
    path = SUMMARY if path is None else path
    return json.loads(path.read_text()) if path.is_file() else {}


def _save(summary: dict[str, Any], path: Path | None = None) -> None:
    path = SUMMARY if path is None else path
    FIGURES.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(summary, indent=1) + "\n")
    tmp.replace(path)
    print(f"wrote {path}", flush=True)


def _seed_file(seed: int) -> Path:
    return FIGURES / f"unlearning_seed{seed}.json"


def _split(model, U, seed: int):
    facts = U.load_attribute_facts(FACTS)
    if SETTINGS["known_only"]:
        facts = U.known_facts(model, facts)
    return U.split_facts(facts, SETTINGS["n_forget"], SETTINGS["n_retain"], seed=seed)


def _text(model, U):
    """(training windows, held-out windows) of the general-text retain term."""
    train = U.text_windows(model, "train", window=SETTINGS["text_window"])
    held = U.text_windows(model, "heldout", window=SETTINGS["text_window"],
                          max_windows=SETTINGS["heldout_windows"])
    return train, held


def stage_localize(model, U, summary: dict[str, Any]) -> None:
    t0 = time.perf_counter()
    everything = U.load_attribute_facts(FACTS)
    known = U.known_facts(model, everything)
    t1 = time.perf_counter()
    counts = {a: sum(f.attribute == a for f in everything) for a in everything[0].attributes}
    probe = U.attribute_probe_curve(model, everything, n_folds=min(4, min(counts.values())), seed=0)
    t2 = time.perf_counter()
    f0 = next((f for f in everything if f.subject == "Derek Jeter"), everything[0])
    first = U.subject_positions(model, f0)[0]
    n = len(model.tokenizer(U.fact_prompt(f0), add_special_tokens=False)["input_ids"])
    heat = U.causal_trace(model, [f0], positions=list(range(first, n)), heads=False, seed=0)
    t3 = time.perf_counter()
    r = heat.restore_resid.isel(fact=0).values
    summary["localize"] = {
        "n_facts": len(everything), "n_known": len(known),
        "known_by_sport": {a: sum(f.attribute == a for f in known) for a in everything[0].attributes},
        "probe_accuracy": probe.probe_accuracy.values.tolist(),
        "embed_accuracy": float(probe.embed_accuracy), "chance": float(probe.chance),
        "heatmap": {"subject": f0.subject, "positions": list(range(first, n)),
                    "tokens": [str(t) for t in heat.token.isel(fact=0).values[first:n]],
                    "p_answer": r[:, first:n].tolist(), "p_clean": float(heat.p_clean[0]),
                    "p_corrupt": float(heat.p_corrupt[0])},
        "seconds": {"known_filter": t1 - t0, "probe": t2 - t1, "causal_trace_heatmap": t3 - t2},
    }


def stage_probe_known(model, U, summary: dict[str, Any]) -> None:
    """The probe refit on the facts the model knows (trained format), leaving out sports
    with fewer than 4 known athletes (one per fold): a probe over facts the model does
    not know reads a sport that is not there."""
    known = U.known_facts(model, U.load_attribute_facts(FACTS))
    counts = {a: sum(f.attribute == a for f in known) for a in known[0].attributes}
    facts = [f for f in known if counts[f.attribute] >= 4]
    c0 = time.process_time()
    probe = U.attribute_probe_curve(model, facts, n_folds=4, seed=0)
    summary["localize"]["probe_known"] = {
        "n_facts": len(facts), "sports": sorted({f.attribute for f in facts}),
        "probe_accuracy": probe.probe_accuracy.values.tolist(),
        "embed_accuracy": float(probe.embed_accuracy), "chance": float(probe.chance),
        "fact_lookup_layers": U.fact_lookup_layers(probe, SETTINGS["n_layers"]),
        "cpu_s": time.process_time() - c0}
    print(summary["localize"]["probe_known"], flush=True)


def stage_sweep(model, U, seed: int, lrs: list[float], steps: int) -> None:
    """The relearning attack on the original model: held-out and learned-half accuracy
    (and mean p(answer) among the sports) after each step, per learning rate."""
    forget, _ = _split(model, U, seed)
    learn, held = U.relearn_halves(forget)
    out = {"seed": seed, "learn": [f.subject for f in learn], "heldout": [f.subject for f in held],
           "runs": {}}
    path = FIGURES / f"unlearning_sweep_seed{seed}.json"
    for lr in lrs:
        hf = copy.deepcopy(model.hf)
        rows = []

        def ev(k, hf):
            ok_h, p_h = U.format_accuracy(model, held, "trained", hf=hf)
            ok_l, p_l = U.format_accuracy(model, learn, "trained", hf=hf)
            rows.append({"step": k, "held_acc": float(ok_h.mean()), "held_p": float(p_h.mean()),
                         "learn_acc": float(ok_l.mean()), "learn_p": float(p_l.mean()),
                         "cpu_s": time.process_time()})
            print(lr, rows[-1], flush=True)
        ev(0, hf)
        losses = U.relearn(model, hf, learn, steps=steps, lr=lr, on_step=ev)
        out["runs"][str(lr)] = {"rows": rows, "loss": losses}
        _save(out, path)


def stage_attack_curve(model, U, summary: dict[str, Any], seed: int, methods: list[str],
                       steps: int) -> None:
    """A longer relearning attack, read after every step: unlearn with each method (the
    comparison's settings, seed ``seed``) and run the attack for ``steps`` steps at the
    chosen learning rate; the original model's curve is the `sweep` stage's."""
    forget, retain = _split(model, U, seed)
    learn, held = U.relearn_halves(forget)
    out = _load(FIGURES / f"unlearning_attack_seed{seed}.json")
    out.update({"seed": seed, "relearn_lr": SETTINGS["relearn_lr"], "steps": steps})
    probe, _, _ = _datasets(summary)
    train_text, _ = _text(model, U)
    for m in methods:
        if m not in ("fact_lookup", "all"):
            raise SystemExit("attack_curve runs fact_lookup and all (no tracing needed)")
        comps = U.localized_components(model, m, SETTINGS["n_layers"], probe=probe)
        names, masks, _ = U.trained_parameters(model, m, comps)
        c0 = time.process_time()
        hf, _ = U.localized_finetune(model, forget, retain, names, masks=masks,
                                     steps=SETTINGS["steps"], lr=SETTINGS["lr"],
                                     retain_weight=SETTINGS["retain_weight"], text=train_text,
                                     text_weight=SETTINGS["text_weight"],
                                     text_batch=SETTINGS["text_batch"])
        rows = []

        def ev(k, hf):
            ok_h, p_h = U.format_accuracy(model, held, "trained", hf=hf)
            ok_l, p_l = U.format_accuracy(model, learn, "trained", hf=hf)
            rows.append({"step": k, "held_acc": float(ok_h.mean()), "held_p": float(p_h.mean()),
                         "learn_acc": float(ok_l.mean()), "learn_p": float(p_l.mean())})
            print(m, rows[-1], flush=True)
        ev(0, hf)
        U.relearn(model, hf, learn, steps=steps, lr=SETTINGS["relearn_lr"], on_step=ev)
        out.setdefault("runs", {})[m] = {"rows": rows, "cpu_s": time.process_time() - c0}
        _save(out, FIGURES / f"unlearning_attack_seed{seed}.json")


def _datasets(summary: dict[str, Any], seed_out: dict[str, Any] | None = None):
    """The probe curve, and a seed's mean causal-trace effects and attribution scores as
    one-fact datasets (the component selection reads means over the facts)."""
    import xarray as xr

    loc = summary["localize"]
    probe = xr.Dataset({"probe_accuracy": ("layer", np.array(loc["probe_accuracy"])),
                        "embed_accuracy": loc["embed_accuracy"], "chance": loc["chance"]})
    probe = probe.assign_coords(layer=np.arange(probe.sizes["layer"]))
    if seed_out is None or "ap_head" not in seed_out:
        return probe, None, None
    trace = None if "ct_restore_head" not in seed_out else xr.Dataset(
        {"restore_mlp": (("fact", "layer"), np.array([seed_out["ct_restore_mlp"]])),
         "restore_head": (("fact", "layer", "head"), np.array([seed_out["ct_restore_head"]])),
         "p_corrupt": ("fact", [float(np.mean(seed_out["ct_p_corrupt"]))])})
    ap = xr.Dataset({"ap_mlp": (("fact", "layer"), np.array([seed_out["ap_mlp"]])),
                     "ap_head": (("fact", "layer", "head"), np.array([seed_out["ap_head"]]))})
    return probe, trace, ap


def stage_seed(model, U, summary: dict[str, Any], seed: int, methods: list[str],
               trace_facts: int | None = None) -> None:
    """One seed: split, attribution patching over its forget set and causal tracing over
    its first ``trace_facts`` forget facts (default all; 0: none, and the causal-tracing
    methods are not run), then the comparison one method at a time (the original row with
    the first)."""
    if "localize" not in summary:
        raise SystemExit("run --stages localize first")
    path = _seed_file(seed)
    out = _load(path) if path.is_file() else {}
    t0 = time.process_time()
    forget, retain = _split(model, U, seed)
    learn, held = U.relearn_halves(forget)
    n_trace = len(forget) if trace_facts is None else min(trace_facts, len(forget))
    if "ap_head" not in out:
        ap = U.attribution_patching(model, forget, seed=seed)
        t1 = time.process_time()
        out.update({
            "seed": seed, "settings": SETTINGS,
            "forget": [[f.subject, f.attribute] for f in forget],
            "retain": [[f.subject, f.attribute] for f in retain],
            "relearn_on": [f.subject for f in learn], "relearn_heldout": [f.subject for f in held],
            "ap_head": ap.ap_head.mean("fact").values.tolist(),
            "ap_mlp": ap.ap_mlp.mean("fact").values.tolist(),
            "cpu_s": {"attribution_patching": t1 - t0},
            "methods": {},
        })
        _save(out, path)
    if n_trace and out.get("ct_n_facts", 0) < n_trace:
        t1 = time.process_time()
        trace = U.causal_trace(model, forget[:n_trace], positions=False, heads=True, seed=seed,
                               progress=lambda d, t: print(f"  seed {seed} tracing {d}/{t}", flush=True))
        out.update({
            "ct_n_facts": n_trace,
            "ct_restore_mlp": trace.restore_mlp.mean("fact").values.tolist(),
            "ct_restore_head": trace.restore_head.mean("fact").values.tolist(),
            "ct_p_clean": trace.p_clean.values.tolist(),
            "ct_p_corrupt": trace.p_corrupt.values.tolist()})
        out["cpu_s"]["causal_trace"] = time.process_time() - t1
        _save(out, path)
    probe, trace, ap = _datasets(summary, out)
    train_text, held_text = _text(model, U)
    for m in methods:
        if m in out["methods"]:
            continue
        if m.startswith("causal_tracing") and trace is None:
            print(f"seed {seed}: {m} needs causal tracing (--trace-facts > 0); skipped", flush=True)
            continue
        first = "original" not in out["methods"]
        c0, w0 = time.process_time(), time.perf_counter()
        ds = U.unlearning_comparison(
            model, forget, retain, methods=[m], n_layers=SETTINGS["n_layers"],
            steps=SETTINGS["steps"], lr=SETTINGS["lr"], retain_weight=SETTINGS["retain_weight"],
            relearn_steps=SETTINGS["relearn_steps"], relearn_lr=SETTINGS["relearn_lr"],
            probe=probe, trace=trace, attribution=ap, text=train_text,
            text_weight=SETTINGS["text_weight"], text_batch=SETTINGS["text_batch"],
            heldout_text=held_text, seed=seed, original=first,
            progress=lambda d, t: print(f"  seed {seed} {m}: {d}/{t}", flush=True))
        cpu, wall = time.process_time() - c0, time.perf_counter() - w0
        for row in ds["localization"].values.tolist():
            out["methods"][row] = {
                "layers": str(ds["trained_layers"].sel(localization=row).item()),
                "components_label": str(ds["trained_components"].sel(localization=row).item()),
                "components": ds.attrs["params"]["components"].get(row),
                "perplexity": _num(ds.perplexity.sel(localization=row)),
                "n_heads": int(ds.n_heads.sel(localization=row)),
                "n_params": int(ds.n_params.sel(localization=row)),
                "seconds_per_step": _num(ds.seconds_per_step.sel(localization=row)),
                "accuracy": {k: _num(ds.accuracy.sel(localization=row, metric=k))
                             for k in ds.metric.values.tolist()},
                "loss": [_num(x) for x in ds.loss.sel(localization=row).values]}
        out.setdefault("runs", []).append({"method": m, "with_original": first, "cpu_s": cpu,
                                           "wall_s": wall, "load1": _load1()})
        _save(out, path)
        print(m, out["methods"][m]["layers"], out["methods"][m]["accuracy"], flush=True)


def stage_latent(model, U, summary: dict[str, Any], seed: int, methods: list[str]) -> None:
    """Guo et al.'s latent probe after unlearning, one seed: is the forgotten sport still
    linearly decodable from the residual stream?"""
    from explorer.analyses.unlearning.latent import latent_probe_after_unlearning

    seed_out = _load(_seed_file(seed))
    if "ap_head" not in seed_out:
        raise SystemExit(f"run --stages seed --seed {seed} first")
    forget, retain = _split(model, U, seed)
    known = U.known_facts(model, U.load_attribute_facts(FACTS))
    gone = {f.subject for f in forget}
    probe_facts = [f for f in known if f.subject not in gone]
    probe, trace, ap = _datasets(summary, seed_out)
    train_text, _ = _text(model, U)
    path = FIGURES / f"unlearning_latent_seed{seed}.json"
    c0, w0 = time.process_time(), time.perf_counter()
    ds = latent_probe_after_unlearning(
        model, forget, retain, probe_facts, methods=methods, n_layers=SETTINGS["n_layers"],
        steps=SETTINGS["steps"], lr=SETTINGS["lr"], retain_weight=SETTINGS["retain_weight"],
        probe=probe, trace=trace, attribution=ap, text=train_text,
        text_weight=SETTINGS["text_weight"], text_batch=SETTINGS["text_batch"], seed=seed,
        progress=lambda d, t: print(f"  latent seed {seed}: {d}/{t}", flush=True))
    out = {"seed": seed, "settings": SETTINGS, "n_forget": len(forget),
           "n_probe_facts": len(probe_facts),
           "probe_facts_by_sport": {a: sum(f.attribute == a for f in probe_facts)
                                    for a in sorted({f.attribute for f in probe_facts})},
           "chance": float(ds.chance), "positions": ds.position.values.tolist(),
           "methods": {}, "cpu_s": None, "wall_s": None}
    for row in ds.localization.values.tolist():
        sel = ds.sel(localization=row)
        out["methods"][row] = {
            "layers": str(sel.trained_layers.item()),
            "forget_accuracy": _num(sel.forget_accuracy),
            **{key: {p: [_num(x) for x in sel[var].sel(position=p).values]
                     for p in out["positions"]}
               for key, var in (("probe", "probe_forget_accuracy"),
                                ("probe_low", "probe_forget_accuracy_low"),
                                ("probe_high", "probe_forget_accuracy_high"))},
            "best_layer_accuracy": {p: _num(sel.best_layer_accuracy.sel(position=p))
                                    for p in out["positions"]}}
    out["cpu_s"], out["wall_s"] = time.process_time() - c0, time.perf_counter() - w0
    _save(out, path)


def _load1() -> float:
    import os

    return os.getloadavg()[0]


def _agg(values: list[float | None]) -> dict[str, Any] | None:
    """Mean, standard deviation (ddof 1), min, max and the 95 % t interval over seeds."""
    from explorer.analyses.unlearning import mean_interval

    v = np.array([np.nan if x is None else x for x in values], float)
    v = v[~np.isnan(v)]
    if not len(v):
        return None
    mean, low, high = mean_interval(v)
    return {"mean": round(mean, 4), "std": round(float(v.std(ddof=1)), 4) if len(v) > 1 else None,
            "min": float(v.min()), "max": float(v.max()), "n": int(len(v)),
            "t95": [None if np.isnan(low) else round(low, 4),
                    None if np.isnan(high) else round(high, 4)],
            "values": [round(float(x), 4) for x in v]}


def stage_merge(summary: dict[str, Any]) -> None:
    """Per method and metric over the seeds that finished it: mean, sd, min, max and a
    95 % t interval; and paired differences (fact lookup minus each other method, seed
    by seed) with their t intervals."""
    seeds = [_load(_seed_file(s)) for s in SETTINGS["seeds"] if _seed_file(s).is_file()]
    rows: dict[str, Any] = {}
    for m in ["original", *METHODS]:
        have = [d for d in seeds if m in d.get("methods", {})]
        if not have:
            continue
        metrics = have[0]["methods"][m]["accuracy"].keys()
        agg = {k: _agg([d["methods"][m]["accuracy"][k] for d in have]) for k in metrics}
        rows[m] = {"seeds": [d["seed"] for d in have],
                   "layers": {str(d["seed"]): d["methods"][m]["layers"] for d in have},
                   "components": {str(d["seed"]): d["methods"][m].get("components_label")
                                  for d in have},
                   "n_heads": {str(d["seed"]): d["methods"][m].get("n_heads") for d in have},
                   "n_params": {str(d["seed"]): d["methods"][m]["n_params"] for d in have},
                   "seconds_per_step": [d["methods"][m]["seconds_per_step"] for d in have],
                   "perplexity": _agg([d["methods"][m].get("perplexity") for d in have]),
                   "accuracy": agg}
    diffs: dict[str, Any] = {}
    for m in METHODS:
        if m == "fact_lookup":
            continue
        both = [d for d in seeds if m in d.get("methods", {}) and "fact_lookup" in d["methods"]]
        if not both:
            continue
        diffs[m] = {k: _agg([None if d["methods"]["fact_lookup"]["accuracy"][k] is None
                             or d["methods"][m]["accuracy"][k] is None
                             else d["methods"]["fact_lookup"]["accuracy"][k]
                             - d["methods"][m]["accuracy"][k] for d in both])
                    for k in ("forget", "forget_mc_known", "relearn_heldout", "retain")}
    summary["fact_lookup_minus"] = diffs
    # keys of the earlier one-seed, 8-fact run (its split and MLP scores) are dropped
    for k in ("forget", "retain", "ct_restore_mlp", "ct_p_clean", "ct_p_corrupt", "ap_mlp"):
        summary.get("localize", {}).pop(k, None)
    summary.pop("train_runs", None)
    summary["settings"] = SETTINGS
    summary["methods"] = rows
    summary["seeds"] = {str(d["seed"]): {k: d[k] for k in ("forget", "retain", "relearn_on",
                                                           "relearn_heldout", "cpu_s", "runs")
                                         if k in d} for d in seeds}
    sweeps = {}
    for s in SETTINGS["seeds"]:
        p = FIGURES / f"unlearning_sweep_seed{s}.json"
        if p.is_file():
            sweeps[str(s)] = _load(p)
    summary["relearn_sweep"] = sweeps


def _num(x) -> float | None:
    v = float(x)
    return None if np.isnan(v) else round(v, 4)


def render_png(obj: Any, path: Path, *, width: int, height: int) -> None:
    """Render a HoloViews object to PNG at a fixed size (see benchmarks/_figures.py)."""
    _figures.render_png(obj.opts(responsive=False, width=width, height=height), path,
                        width=width, height=height)
    print(f"wrote {path}")


def stage_figures(model, U, summary: dict[str, Any]) -> None:
    import xarray as xr

    from apps import unlearning as view

    import holoviews as hv

    probe, _, _ = _datasets(summary)
    flu = U.fact_lookup_layers(probe, SETTINGS["n_layers"])
    plot = view.plot_probe_curve(probe, flu)
    known = summary["localize"].get("probe_known")
    if known:  # the refit on known facts, drawn over the all-athletes curve
        layers = np.arange(len(known["probe_accuracy"]))
        plot = plot * hv.Curve((layers, known["probe_accuracy"]), "layer", "probe accuracy").opts(
            color="#555555", line_width=2, line_dash="dotted") * hv.HLine(known["chance"]).opts(
            color="#555555", line_dash="dotted", line_width=1)
        plot = plot.opts(title="Sport probe, last subject token: 80 athletes (solid), "
                               "29 known (dotted)", xlabel="layer", ylabel="probe accuracy",
                         ylim=(0, 1.02))
    render_png(plot, FIGURES / "unlearning_probe.png", width=760, height=320)
    h = summary["localize"]["heatmap"]
    p = np.array(h["p_answer"])                                   # [layer, n_positions]
    n_pos = p.shape[1]
    heat = xr.Dataset(
        {"restore_resid": (("fact", "layer", "pos"), p[None]),
         "p_clean": ("fact", [h["p_clean"]]), "p_corrupt": ("fact", [h["p_corrupt"]])},
        coords={"fact": [0], "layer": np.arange(p.shape[0]), "pos": np.arange(n_pos),
                "subject": ("fact", [h["subject"]]), "token": (("fact", "pos"), [h["tokens"]])})
    render_png(view.plot_trace_heatmap(heat), FIGURES / "unlearning_trace.png", width=760, height=420)
    methods = summary.get("methods", {})
    order = [m for m in ("original", "fact_lookup", "causal_tracing", "attribution_patching",
                         "random", "all") if m in methods]
    # the bars are the mean over the seeds (the spread is in docs/unlearning.md)
    rows = [(view.METRIC_LABELS[k], view.SHORT_NAMES[m],
             (methods[m]["accuracy"].get(k) or {}).get("mean") or 0.0)
            for k in view.METRIC_LABELS for m in order]
    render_png(view.plot_accuracy_bars(rows), FIGURES / "unlearning_accuracy.png",
               width=1000, height=380)


def main() -> None:
    global FIGURES, SUMMARY, FACTS
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", default="merge,figures")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--settings", default="full", choices=("full", "reduced"),
                    help="full: the documented run; reduced: seconds on a tiny model (tests)")
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--out", default=None, help="folder of the JSON files (default docs/figures)")
    ap.add_argument("--facts", default=None, help="fact file (default the shipped athletes)")
    ap.add_argument("--text-weight", type=float, default=None,
                    help="weight of the general-text retain term (default the settings': 1; "
                         "0: the facts-only retain term)")
    ap.add_argument("--trace-facts", type=int, default=None,
                    help="causal tracing over the first N forget facts (default all; 0: none)")
    add_number_options(ap, seed=0)
    ap.add_argument("--sweep-lrs", default="1e-5,3e-5,3e-6")
    add_number_options(ap, sweep_steps=8, threads=1)
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    from explorer import load_model
    from explorer.analyses import unlearning as U

    SETTINGS.clear()
    SETTINGS.update(FULL if args.settings == "full" else REDUCED)
    if args.out is not None:
        FIGURES = Path(args.out)
        SUMMARY = FIGURES / "unlearning_summary.json"
    FACTS = args.facts
    if args.text_weight is not None:
        SETTINGS["text_weight"] = args.text_weight
    model = load_model(args.model)
    summary = _load()
    for stage in args.stages.split(","):
        t0 = time.perf_counter()
        if stage == "localize":
            stage_localize(model, U, summary)
        elif stage == "sweep":  # writes its own file
            stage_sweep(model, U, args.seed, [float(x) for x in args.sweep_lrs.split(",")],
                        args.sweep_steps)
            continue
        elif stage == "seed":  # writes its own file; seeds may run side by side
            stage_seed(model, U, summary, args.seed, args.methods.split(","), args.trace_facts)
            continue
        elif stage == "latent":  # writes its own file
            stage_latent(model, U, summary, args.seed, args.methods.split(","))
            continue
        elif stage == "probe_known":
            stage_probe_known(model, U, summary)
        elif stage == "attack_curve":  # writes its own file
            stage_attack_curve(model, U, summary, args.seed, args.methods.split(","),
                               args.sweep_steps)
            continue
        elif stage == "merge":
            stage_merge(summary)
        elif stage == "figures":
            stage_figures(model, U, summary)
        else:
            raise SystemExit(f"unknown stage {stage!r}")
        summary.setdefault("stage_seconds", {})[stage] = time.perf_counter() - t0
        _save(summary)


if __name__ == "__main__":
    main()
