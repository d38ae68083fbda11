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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
FIGURES = ROOT / "docs" / "figures"
SUMMARY = FIGURES / "unlearning_summary.json"
METHODS = ["fact_lookup", "causal_tracing", "attribution_patching", "random", "all"]

# the relearning attack (relearn_steps, relearn_lr) comes from the `sweep` stage: the
# strongest setting swept that leaves the original model's held-out accuracy at 1 on the
# splits of seeds 0 and 1
SETTINGS = dict(n_forget=16, n_retain=8, n_layers=4, steps=8, lr=2e-4, retain_weight=1.0,
                relearn_steps=3, relearn_lr=3e-5, seeds=[0, 1, 2])


def _load(path: Path = SUMMARY) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _save(summary: dict[str, Any], path: Path = SUMMARY) -> None:
    FIGURES.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(summary, indent=1) + "\n")
    tmp.replace(path)
    print(f"wrote {path.relative_to(ROOT)}", flush=True)


def _seed_file(seed: int) -> Path:
    return FIGURES / f"unlearning_seed{seed}.json"


def _split(model, U, seed: int):
    known = U.known_facts(model, U.load_attribute_facts())
    return U.split_facts(known, SETTINGS["n_forget"], SETTINGS["n_retain"], seed=seed)


def stage_localize(model, U, summary: dict[str, Any]) -> None:
    t0 = time.perf_counter()
    everything = U.load_attribute_facts()
    known = U.known_facts(model, everything)
    t1 = time.perf_counter()
    probe = U.attribute_probe_curve(model, everything, n_folds=4, seed=0)
    t2 = time.perf_counter()
    f0 = next(f for f in everything if f.subject == "Derek Jeter")
    first = U.subject_positions(model, f0)[0]
    n = len(model.tokenizer(U.fact_prompt(f0), add_special_tokens=False)["input_ids"])
    heat = U.causal_trace(model, [f0], positions=list(range(first, n)), seed=0)
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
    known = U.known_facts(model, U.load_attribute_facts())
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
    for m in methods:
        if m not in ("fact_lookup", "all"):
            raise SystemExit("attack_curve runs fact_lookup and all (no tracing needed)")
        layers = U.localized_layers(model, m, SETTINGS["n_layers"], probe=probe)
        c0 = time.process_time()
        hf, _ = U.localized_finetune(model, forget, retain, U.component_parameters(model, m, layers),
                                     steps=SETTINGS["steps"], lr=SETTINGS["lr"],
                                     retain_weight=SETTINGS["retain_weight"])
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


def _datasets(summary: dict[str, Any], trace_mlp=None, ap_mlp=None):
    import xarray as xr

    loc = summary["localize"]
    probe = xr.Dataset({"probe_accuracy": ("layer", np.array(loc["probe_accuracy"])),
                        "embed_accuracy": loc["embed_accuracy"], "chance": loc["chance"]})
    probe = probe.assign_coords(layer=np.arange(probe.sizes["layer"]))
    trace = None if trace_mlp is None else xr.Dataset(
        {"restore_mlp": (("fact", "layer"), np.array([trace_mlp]))})
    ap = None if ap_mlp is None else xr.Dataset({"ap_mlp": (("fact", "layer"), np.array([ap_mlp]))})
    return probe, trace, ap


def stage_seed(model, U, summary: dict[str, Any], seed: int, methods: list[str]) -> None:
    """One seed: split, causal tracing and attribution patching over its forget set, then
    the comparison one method at a time (the original row with the first)."""
    if "localize" not in summary:
        raise SystemExit("run --stages localize first")
    path = _seed_file(seed)
    out = _load(path) if path.is_file() else {}
    t0 = time.process_time()
    forget, retain = _split(model, U, seed)
    learn, held = U.relearn_halves(forget)
    if "ct_restore_mlp" not in out:
        trace = U.causal_trace(model, forget, positions=False, seed=seed)
        t1 = time.process_time()
        ap = U.attribution_patching(model, forget, seed=seed)
        t2 = time.process_time()
        out.update({
            "seed": seed, "settings": SETTINGS,
            "forget": [[f.subject, f.attribute] for f in forget],
            "retain": [[f.subject, f.attribute] for f in retain],
            "relearn_on": [f.subject for f in learn], "relearn_heldout": [f.subject for f in held],
            "ct_restore_mlp": trace.restore_mlp.mean("fact").values.tolist(),
            "ct_p_clean": trace.p_clean.values.tolist(),
            "ct_p_corrupt": trace.p_corrupt.values.tolist(),
            "ap_mlp": ap.ap_mlp.mean("fact").values.tolist(),
            "cpu_s": {"causal_trace_mlp": t1 - t0, "attribution_patching": t2 - t1},
            "methods": {},
        })
        _save(out, path)
    probe, trace, ap = _datasets(summary, out["ct_restore_mlp"], out["ap_mlp"])
    for m in methods:
        if m in out["methods"]:
            continue
        first = "original" not in out["methods"]
        c0, w0 = time.process_time(), time.perf_counter()
        ds = U.unlearning_comparison(
            model, forget, retain, methods=[m], n_layers=SETTINGS["n_layers"],
            steps=SETTINGS["steps"], lr=SETTINGS["lr"], retain_weight=SETTINGS["retain_weight"],
            relearn_steps=SETTINGS["relearn_steps"], relearn_lr=SETTINGS["relearn_lr"],
            probe=probe, trace=trace, attribution=ap, seed=seed, original=first,
            progress=lambda d, t: print(f"  seed {seed} {m}: {d}/{t}", flush=True))
        cpu, wall = time.process_time() - c0, time.perf_counter() - w0
        for row in ds["localization"].values.tolist():
            out["methods"][row] = {
                "layers": str(ds["trained_layers"].sel(localization=row).item()),
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
    if "ct_restore_mlp" not in seed_out:
        raise SystemExit(f"run --stages seed --seed {seed} first")
    forget, retain = _split(model, U, seed)
    known = U.known_facts(model, U.load_attribute_facts())
    gone = {f.subject for f in forget}
    probe_facts = [f for f in known if f.subject not in gone]
    probe, trace, ap = _datasets(summary, seed_out["ct_restore_mlp"], seed_out["ap_mlp"])
    path = FIGURES / f"unlearning_latent_seed{seed}.json"
    c0, w0 = time.process_time(), time.perf_counter()
    ds = latent_probe_after_unlearning(
        model, forget, retain, probe_facts, methods=methods, n_layers=SETTINGS["n_layers"],
        steps=SETTINGS["steps"], lr=SETTINGS["lr"], retain_weight=SETTINGS["retain_weight"],
        probe=probe, trace=trace, attribution=ap, seed=seed,
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


def stage_merge(summary: dict[str, Any]) -> None:
    """Mean, standard deviation (ddof 0), min and max over the seeds that finished a row."""
    seeds = [_load(_seed_file(s)) for s in SETTINGS["seeds"] if _seed_file(s).is_file()]
    rows: dict[str, Any] = {}
    for m in ["original", *METHODS]:
        have = [d for d in seeds if m in d.get("methods", {})]
        if not have:
            continue
        metrics = have[0]["methods"][m]["accuracy"].keys()
        agg = {}
        for k in metrics:
            v = np.array([np.nan if d["methods"][m]["accuracy"][k] is None
                          else d["methods"][m]["accuracy"][k] for d in have], float)
            v = v[~np.isnan(v)]
            agg[k] = (None if not len(v) else
                      {"mean": round(float(v.mean()), 4), "std": round(float(v.std()), 4),
                       "min": float(v.min()), "max": float(v.max()), "n": int(len(v))})
        rows[m] = {"seeds": [d["seed"] for d in have],
                   "layers": {str(d["seed"]): d["methods"][m]["layers"] for d in have},
                   "n_params": have[0]["methods"][m]["n_params"],
                   "seconds_per_step": [d["methods"][m]["seconds_per_step"] for d in have],
                   "accuracy": agg}
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
    print(f"wrote {path.relative_to(ROOT)}")


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
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", default="merge,figures")
    ap.add_argument("--methods", default="fact_lookup,all,causal_tracing,attribution_patching,random")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sweep-lrs", default="1e-5,3e-5,3e-6")
    ap.add_argument("--sweep-steps", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    from explorer import load_model
    from explorer.analyses import unlearning as U

    model = load_model("smollm2-135m")
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
            stage_seed(model, U, summary, args.seed, args.methods.split(","))
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
