"""Evidence for docs/icl_heads.md: induction vs FV heads, ablations, function vectors, TD, LoRA.

Writes ``docs/figures/icl_heads_summary.json`` after every stage (a partial run keeps what
it finished; later runs add to it). Each stage is one process well under 10 minutes on one
CPU thread; the FV score is accumulated one task per run (the score is the mean of the
per-task indirect effects, so running tasks separately gives the same numbers). Usage::

    python benchmarks/icl_heads_evidence.py --stages bench,induction
    python benchmarks/icl_heads_evidence.py --stages fv --fv-tasks antonym      # one task a run
    python benchmarks/icl_heads_evidence.py --stages overlap,ablation
    python benchmarks/icl_heads_evidence.py --stages ablation-means --eval-prompts 16
        # the same curves with each mean source (cross-task, per-task), with bootstrap intervals
    python benchmarks/icl_heads_evidence.py --stages ablation-xfit --eval-prompts 32 \
        --xfit-shots 10
        # every shipped task SmolLM2 does above chance (screened on other prompts), in two
        # folds: heads ranked and the cross-task mean taken on one fold, evaluated on the
        # other; each mean source; bootstrap intervals over prompts
    python benchmarks/icl_heads_evidence.py --stages ablation-f1 --f1-prompts 4 --f1-percents 0,3
        # the cross-fit's folds and rankings scored both ways on the same prompts: first-token
        # accuracy and the paper's F1 of 5 generated tokens (cross-task mean, exclusion variants)
    python benchmarks/icl_heads_evidence.py --stages token-loss-long --long-ablations bos
        # the paper's token-loss difference: loss at token 50 minus loss at token 500 of
        # BOS-prefixed 505-token corpus windows, heads ablated with their BOS output (the
        # paper's code) or their mean; FV score from the cross-fit's above-chance tasks
    python benchmarks/icl_heads_evidence.py --stages fvacc,td
    python benchmarks/icl_heads_evidence.py --stages tv-patching
        # the causal test of task vectors: each task's mean vector (and the Null task's)
        # written over the last token of zero-shot prompts, layer by layer
    python benchmarks/icl_heads_evidence.py --stages tv-conflict --eval-prompts 12
        # conflicting tasks: task A's vector written into few-shot prompts of task B
    python benchmarks/icl_heads_evidence.py --stages lora
    explorer icl-finetune --tasks choose-first-of-3,choose-middle-of-3,choose-last-of-3,\
        lowercase-first-letter --n-shots 2 --json      # the low-TD run (stored as lora_choose)
    python benchmarks/icl_heads_evidence.py --stages figures    # PNGs from the summary

``--threads 1`` (the default) is fastest on a busy machine.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

import _figures  # benchmarks/_figures.py, beside this script
from explorer.defaults import DEFAULT_MODEL

ROOT = Path(__file__).resolve().parents[1]
FIGURES = ROOT / "docs" / "figures"
SUMMARY = FIGURES / "icl_heads_summary.json"

# the settings behind docs/icl_heads.md: FV score over seven tasks, ablations on three others
FV_TASKS = ["antonym", "country-capital", "english-french", "singular-plural", "uppercase",
            "person-sport", "animal-v-object-3"]
EVAL_TASKS = ["capitalize", "present-past", "country-capital"]
# tasks whose answers to each other's queries are defined (rules, or shared inputs)
CONFLICT_TASKS = ["capitalize", "uppercase", "lowercase-first-letter", "choose-first-of-3",
                  "choose-middle-of-3", "choose-last-of-3", "country-capital",
                  "country-currency"]
TD_TASKS = ["antonym", "country-capital", "english-french", "capitalize", "present-past",
            "singular-plural", "person-sport", "next-item"]


def _spearman(a: np.ndarray, b: np.ndarray) -> float:
    ra, rb = np.argsort(np.argsort(a.ravel())), np.argsort(np.argsort(b.ravel()))
    return float(np.corrcoef(ra, rb)[0, 1])


def render_png(obj: Any, path: Path, *, width: int, height: int) -> None:
    """Render a HoloViews object to PNG at a fixed size (see benchmarks/_figures.py)."""
    import holoviews as hv

    if isinstance(obj, hv.Layout):   # side by side, each a fixed share of the width
        items = list(obj)
        obj = hv.Layout([el.opts(responsive=False, width=width // len(items), height=height)
                         for el in items]).cols(len(items))
    else:
        obj = obj.opts(responsive=False, width=width, height=height)
    _figures.render_png(obj, path, width=width, height=height)
    print(f"wrote {path.relative_to(ROOT)}")


def figures(summary: dict) -> None:
    """The view's plots, drawn from the stored numbers."""
    import holoviews as hv
    import xarray as xr

    from apps import icl_heads as view
    from apps import theme

    hv.extension("bokeh", logo=False)
    ind = np.array(summary["induction"]["induction_score"])
    fv = np.array(summary["overlap"]["fv_score"])
    scores = xr.Dataset({"induction_score": (("layer", "head"), ind),
                         "fv_score": (("layer", "head"), fv)},
                        coords={"layer": range(ind.shape[0]), "head": range(ind.shape[1])})
    render_png(view.plot_head_scatter(scores, 5, 5), FIGURES / "icl_heads_scatter.png",
               width=900, height=420)
    render_png(view.plot_score_heatmaps(scores), FIGURES / "icl_heads_heatmaps.png",
               width=900, height=520)
    if "ablation" in summary:
        ab = summary["ablation"]
        rk = list(ab["mean_accuracy"])
        ds = xr.Dataset({"mean_accuracy": (("ranking", "percent"),
                                           np.array([ab["mean_accuracy"][r] for r in rk])),
                         "mean_answer_prob": (("ranking", "percent"),
                                              np.array([ab["mean_answer_prob"][r] for r in rk]))},
                        coords={"ranking": rk, "percent": ab["percents"]})
        render_png(view.plot_ablation_curves(ds)
                   + view.plot_ablation_curves(ds, "mean_answer_prob"),
                   FIGURES / "icl_heads_ablation.png", width=1100, height=360)
        tl = xr.Dataset({"token_loss_difference": (("ranking", "percent"), np.array(
            [ab["token_loss_difference"][r] for r in rk]))},
            coords={"ranking": rk, "percent": ab["percents"]})
        render_png(view.plot_ablation_curves(tl, "token_loss_difference"),
                   FIGURES / "icl_heads_token_loss.png", width=700, height=360)
    for ablation, tll in summary.get("token_loss_long", {}).items():
        rk = list(tll["token_loss_difference"])
        arr = {k: (("ranking", "percent"), np.array([tll[k][r] for r in rk]))
               for k in ("token_loss_difference", "token_loss_difference_low",
                         "token_loss_difference_high")}
        ds = xr.Dataset(arr, coords={"ranking": rk, "percent": tll["percents"]},
                        attrs={"params": {"confidence_level": tll["confidence_level"]}})
        render_png(view.plot_ablation_curves(ds, "token_loss_difference").opts(
            title=f"Loss at token {tll['early']} minus loss at token {tll['late']} "
                  f"({tll['n_sequences']} corpus sequences, heads ablated: {ablation}; 95 % bands)"),
            FIGURES / f"icl_heads_token_loss_long_{ablation}.png", width=900, height=380)
    if "function_vectors" in summary:
        f = summary["function_vectors"]
        rows = [(t, kind, f[key][t]) for t in f["zero_shot"]
                for kind, key in (("zero-shot", "zero_shot"), ("zero-shot + FV", "with_fv"),
                                  ("few-shot", "few_shot"))]
        bars = hv.Bars(rows, ["task", "condition"], "accuracy").opts(
            multi_level=True, xrotation=45, color="condition", cmap=theme.CATEGORICAL[:3],
            title=f"Function vector at layer {f['layer']} ({len(f['heads'])} heads): "
                  "zero-shot accuracy per task", ylim=(0, 1.05), tools=["hover"])
        render_png(bars, FIGURES / "icl_heads_fv_gains.png", width=1100, height=420)
    if "task_decodability" in summary:
        t = summary["task_decodability"]
        td = xr.Dataset({"td": (("layer",), np.array(t["td"]))},
                        coords={"layer": range(len(t["td"]))},
                        attrs={"best_layer": t["best_layer"],
                               "td_accuracy_r2": t["td_accuracy_r2"]})
        curve = view.plot_td(td, t["best_layer"])
        real = [k for k in t["icl_accuracy"] if t["icl_accuracy"][k] is not None]
        pts = hv.Points([(t["td_mean_over_layers_per_task"][k], t["icl_accuracy"][k], k)
                         for k in real], ["TD (mean over layers)", "few-shot accuracy"],
                        ["task"]).opts(size=9, color=theme.ACCENT, tools=["hover"],
                                       title=f"TD vs accuracy across tasks "
                                             f"(R² {t['td_accuracy_r2']:.2f})")
        labels = hv.Labels([(t["td_mean_over_layers_per_task"][k], t["icl_accuracy"][k], k)
                            for k in real], ["TD (mean over layers)", "few-shot accuracy"],
                           "task").opts(text_font_size="8pt", yoffset=0.04)
        render_png(curve + (pts * labels), FIGURES / "icl_heads_td.png", width=1100, height=360)
    from apps.icl_heads import plot_finetune_td

    for key, name in (("lora", "icl_heads_lora_td.png"),
                      ("lora_choose", "icl_heads_lora_choose_td.png")):
        if key in summary:
            render_png(plot_finetune_td(summary[key]), FIGURES / name, width=900, height=360)


def xfit(model: Any, summary: dict, save: Any, args: Any, percents: list[float]) -> None:
    """Ablation curves on every task SmolLM2 does above chance, cross-fitted over two folds.

    The tasks are screened on prompts of another seed (`icl_heads.task_screen`); each task's
    FV indirect effect is computed once; the above-chance tasks are split in two folds (a
    seeded permutation), and each fold is evaluated with the FV ranking and the cross-task
    mean taken from the other fold only, as the paper keeps its FV-scoring and evaluation
    tasks apart. The per-prompt results of both folds are pooled for the interval.
    """
    from explorer.analyses import icl_heads as ih

    shots, n = args.xfit_shots, args.eval_prompts
    out = summary.setdefault("ablation_cross_fit", {})
    old = out.get("screen", {})
    if old.get("n_prompts") == n and old.get("n_shots") == shots:   # screened already
        above = old["above_chance"]
    else:
        t0 = time.perf_counter()
        screen = ih.task_screen(model, n_prompts=n, n_shots=shots, seed=100)
        above = [str(t) for t in screen.task.values[screen.above_chance.values]]
        out["screen"] = {"n_prompts": n, "n_shots": shots, "seed": 100,
                         **{k: dict(zip(screen.task.values.tolist(),
                                        np.round(screen[k].values.astype(float), 4).tolist()))
                            for k in ("accuracy", "accuracy_low", "accuracy_high", "chance")},
                         "above_chance": above, "seconds": time.perf_counter() - t0}
        save()
    ie = out.setdefault("indirect_effect", {})
    for task in above:
        if task in ie:
            continue
        t0 = time.perf_counter()
        fv = ih.fv_scores(model, [task], n_prompts=args.xfit_fv_prompts, n_shots=shots, seed=0)
        ie[task] = {"indirect_effect": fv.indirect_effect.values[0].round(5).tolist(),
                    "clean_prob": float(fv.clean_prob[0]),
                    "corrupted_prob": float(fv.corrupted_prob[0]),
                    "seconds": time.perf_counter() - t0}
        save()
    perm = np.random.default_rng(0).permutation(len(above))
    folds = [sorted(above[i] for i in perm[::2]), sorted(above[i] for i in perm[1::2])]
    out.update(folds=folds, percents=percents, n_prompts=n, n_shots=shots,
               fv_prompts=args.xfit_fv_prompts, exclude_fraction=0.02, n_boot=2000,
               loss_sequences=2, loss_tokens=64)
    ind = np.array(summary["induction"]["induction_score"])
    by_source = out.setdefault("by_mean_source", {})
    for source in args.xfit_mean_sources.split(","):
        t0 = time.perf_counter()
        parts, tops = [], []
        for k in range(2):
            evals, other = folds[k], folds[1 - k]
            fv = np.mean([ie[t]["indirect_effect"] for t in other], axis=0)
            tops.append(ih.top_heads(fv, 0.02))
            parts.append(ih.ablation_curves(
                model, evals, ind, fv, percents=percents, exclude_fraction=0.02, n_prompts=n,
                n_shots=shots, loss_sequences=2, loss_tokens=64, mean_source=source,
                mean_tasks=other, n_boot=2000, seed=0))
        correct = np.concatenate([p.correct.values for p in parts], axis=2)
        low, high = ih.bootstrap_mean_accuracy(correct, n_boot=2000, level=0.95, seed=0)
        rk = parts[0].ranking.values.tolist()
        tasks = folds[0] + folds[1]
        acc = np.concatenate([p.accuracy.values for p in parts], axis=2)
        prob = np.concatenate([p.answer_prob.values for p in parts], axis=2)
        by_source[source] = {
            "mean_accuracy": {r: acc[i].mean(-1).round(4).tolist() for i, r in enumerate(rk)},
            "mean_accuracy_low": {r: low[i].round(4).tolist() for i, r in enumerate(rk)},
            "mean_accuracy_high": {r: high[i].round(4).tolist() for i, r in enumerate(rk)},
            "mean_answer_prob": {r: prob[i].mean(-1).round(4).tolist() for i, r in enumerate(rk)},
            "accuracy_per_task": {r: {t: acc[i, :, j].round(4).tolist()
                                      for j, t in enumerate(tasks)} for i, r in enumerate(rk)},
            "token_loss_difference_per_fold": [
                {r: p.token_loss_difference.sel(ranking=r).values.round(4).tolist() for r in rk}
                for p in parts],
            "top2pct_fv_heads_per_fold": tops,
            "seconds": time.perf_counter() - t0}
        save()


def by_score(model: Any, summary: dict, save: Any, args: Any) -> None:
    """The cross-fit's folds scored with first-token accuracy and with the paper's F1.

    Needs the ``ablation-xfit`` stage's screen and indirect effects. Each fold's tasks are
    evaluated with the FV ranking and the cross-task mean from the other fold, on the same
    prompts for both scores, with the exclusion rankings and a random one.
    """
    from explorer.analyses import icl_heads as ih

    xf = summary["ablation_cross_fit"]
    folds, ie = xf["folds"], xf["indirect_effect"]
    ind = np.array(summary["induction"]["induction_score"])
    percents = [float(p) for p in args.f1_percents.split(",")]
    rankings = ["fv_excl_induction", "induction_excl_fv", "random"]
    out = {"folds": folds, "percents": percents, "rankings": rankings,
           "n_prompts": args.f1_prompts, "n_shots": xf["n_shots"], "exclude_fraction": 0.02,
           "mean_source": "cross-task", "n_boot": 2000}
    for score in ("first_token", "f1"):
        t0 = time.perf_counter()
        parts = []
        for k in range(2):
            evals, other = folds[k], folds[1 - k]
            fv = np.mean([ie[t]["indirect_effect"] for t in other], axis=0)
            parts.append(ih.ablation_curves(
                model, evals, ind, fv, percents=percents, rankings=rankings,
                exclude_fraction=0.02, n_prompts=args.f1_prompts, n_shots=xf["n_shots"],
                loss_sequences=1, loss_tokens=64, mean_source="cross-task", mean_tasks=other,
                n_boot=2000, seed=0, score=score))
        correct = np.concatenate([p.correct.values for p in parts], axis=2)
        low, high = ih.bootstrap_mean_accuracy(correct, n_boot=2000, level=0.95, seed=0)
        mean = correct.mean(-1).mean(-1)
        out[score] = {"mean": {r: mean[i].round(4).tolist() for i, r in enumerate(rankings)},
                      "low": {r: low[i].round(4).tolist() for i, r in enumerate(rankings)},
                      "high": {r: high[i].round(4).tolist() for i, r in enumerate(rankings)},
                      "seconds": round(time.perf_counter() - t0, 1)}
        summary.setdefault("ablation_cross_fit", {})["by_score"] = out
        save()


def token_loss_long(model: Any, summary: dict, save: Any, args: Any,
                    percents: list[float]) -> None:
    """The token-loss difference over long contexts (`icl_token_loss.long_context_token_loss`)
    for each ablation value, heads ranked by the induction score and by the FV indirect
    effect averaged over every above-chance task of the cross-fit."""
    from explorer.analyses import icl_token_loss as itl

    xf = summary["ablation_cross_fit"]
    tasks = xf["screen"]["above_chance"]
    fv = np.mean([xf["indirect_effect"][t]["indirect_effect"] for t in tasks], axis=0)
    ind = np.array(summary["induction"]["induction_score"])
    out = summary.setdefault("token_loss_long", {})
    for ablation in args.long_ablations.split(","):
        t0, c0 = time.perf_counter(), time.process_time()
        ds = itl.long_context_token_loss(
            model, ind, fv, percents=percents, n_sequences=args.long_sequences,
            ablation=ablation, n_boot=2000, seed=0,
            progress=lambda d, t: print(f"  token loss ({ablation}): {d}/{t}", flush=True))
        rk = ds.ranking.values.tolist()
        out[ablation] = {
            "fv_tasks": tasks, "percents": percents, **ds.attrs["params"],
            **{var: {r: ds[var].sel(ranking=r).values.round(4).tolist() for r in rk}
               for var in ("token_loss_difference", "token_loss_difference_low",
                           "token_loss_difference_high", "change", "change_low",
                           "change_high")},
            "loss_early_mean": {r: ds.loss_early.sel(ranking=r).mean("sequence").values
                                .round(4).tolist() for r in rk},
            "loss_late_mean": {r: ds.loss_late.sel(ranking=r).mean("sequence").values
                               .round(4).tolist() for r in rk},
            "ablated": {r: ds.ablated.sel(ranking=r).values.tolist() for r in rk},
            "seconds": time.perf_counter() - t0, "cpu_seconds": time.process_time() - c0,
            "date": time.strftime("%Y-%m-%d")}
        save()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stages", default="bench,induction")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--fv-prompts", type=int, default=4)
    ap.add_argument("--fv-shots", type=int, default=4)
    ap.add_argument("--eval-prompts", type=int, default=12)
    ap.add_argument("--fv-tasks", default=",".join(FV_TASKS))
    ap.add_argument("--eval-tasks", default=",".join(EVAL_TASKS))
    ap.add_argument("--td-tasks", default=",".join(TD_TASKS))
    ap.add_argument("--percents", default="0,1,3,5,10,20")
    ap.add_argument("--lora-steps", type=int, default=30)
    ap.add_argument("--conflict-tasks", default=",".join(CONFLICT_TASKS))
    ap.add_argument("--conflict-layers", default="0,8,12,16,18,19,20,21,22,24,28")
    ap.add_argument("--mean-sources", default="cross-task,per-task")
    ap.add_argument("--xfit-shots", type=int, default=10)
    ap.add_argument("--xfit-fv-prompts", type=int, default=16)
    ap.add_argument("--xfit-mean-sources", default="cross-task,per-task,zero")
    ap.add_argument("--long-ablations", default="bos")
    ap.add_argument("--f1-prompts", type=int, default=4)
    ap.add_argument("--f1-percents", default="0,3")
    ap.add_argument("--long-sequences", type=int, default=64)
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    stages = args.stages.split(",")
    summary = json.loads(SUMMARY.read_text()) if SUMMARY.exists() else {}
    loaded = json.loads(json.dumps(summary))   # what this run found, to tell its own changes

    def save():
        """Write this run's stages, keeping what runs in parallel wrote meanwhile."""
        SUMMARY.parent.mkdir(parents=True, exist_ok=True)
        disk = json.loads(SUMMARY.read_text()) if SUMMARY.exists() else {}
        for key, value in summary.items():
            if key == "fv":
                disk.setdefault("fv", {}).update(value)
            elif value != loaded.get(key):
                disk[key] = value
        SUMMARY.write_text(json.dumps(disk, indent=1))

    if stages == ["figures"]:
        figures(summary)
        return
    from explorer import load_model
    from explorer.analyses import icl_heads as ih
    from explorer.analyses import task_vectors as tv
    from explorer.benches.icl_heads import bench_icl_heads

    fv_tasks, eval_tasks = args.fv_tasks.split(","), args.eval_tasks.split(",")
    td_tasks = args.td_tasks.split(",")
    percents = [float(p) for p in args.percents.split(",")]
    model = load_model(DEFAULT_MODEL)
    summary["model"] = model.spec.name
    if "bench" in stages:
        summary["bench"] = bench_icl_heads(model, n_prompts=args.fv_prompts,
                                           n_shots=args.fv_shots, n_heads=6)
        save()
    if "induction" in stages:
        t0 = time.perf_counter()
        ind = ih.induction_scores(model, n_sequences=16, half_len=25, seed=42)
        summary["induction"] = {"induction_score": ind.induction_score.values.round(4).tolist(),
                                "n_sequences": 16, "half_len": 25,
                                "seconds": time.perf_counter() - t0}
        save()
    if "fv" in stages:
        summary.setdefault("fv", {})
        for task in fv_tasks:
            t0 = time.perf_counter()
            fv = ih.fv_scores(model, [task], n_prompts=args.fv_prompts, n_shots=args.fv_shots,
                              seed=0)
            summary["fv"][task] = {
                "indirect_effect": fv.indirect_effect.values[0].round(5).tolist(),
                "clean_prob": float(fv.clean_prob[0]),
                "corrupted_prob": float(fv.corrupted_prob[0]),
                "n_prompts": args.fv_prompts, "n_shots": args.fv_shots,
                "seconds": time.perf_counter() - t0}
            save()
    if "overlap" in stages:
        a = np.array(summary["induction"]["induction_score"])
        tasks = sorted(summary["fv"])
        b = np.mean([summary["fv"][t]["indirect_effect"] for t in tasks], axis=0)
        ov: dict[str, Any] = {"fv_tasks": tasks, "fv_score": b.round(5).tolist(),
                              "spearman": _spearman(a, b)}
        for frac in (0.02, 0.05, 0.10):
            ta, tb = ih.top_heads(a, frac), ih.top_heads(b, frac)
            ov[f"top{int(frac * 100)}pct"] = {"induction": ta, "fv": tb,
                                              "shared": sorted(set(ta) & set(tb))}
        summary["overlap"] = ov
        save()
    if "ablation" in stages:
        a = np.array(summary["induction"]["induction_score"])
        b = np.array(summary["overlap"]["fv_score"])
        t0 = time.perf_counter()
        cur = ih.ablation_curves(model, eval_tasks, a, b, percents=percents,
                                 n_prompts=args.eval_prompts, n_shots=5, loss_sequences=4,
                                 loss_tokens=128, exclude_fraction=0.05)
        summary["ablation"] = {
            "tasks": eval_tasks, "percents": cur.percent.values.tolist(),
            "n_prompts": args.eval_prompts, "n_shots": 5, "exclude_fraction": 0.05,
            **{var: {r: cur[var].sel(ranking=r).values.round(4).tolist()
                     for r in cur.ranking.values.tolist()}
               for var in ("mean_accuracy", "mean_answer_prob", "token_loss_difference")},
            "seconds": time.perf_counter() - t0}
        save()
    if "ablation-means" in stages:
        # The paper's ablation value is one mean per head over the FV-scoring tasks
        # (cross-task); per-task replays the evaluated task's own mean. Same prompts, rankings
        # and percents for both, with a bootstrap interval over prompts.
        a = np.array(summary["induction"]["induction_score"])
        b = np.array(summary["overlap"]["fv_score"])
        fv_pool = summary["overlap"]["fv_tasks"]
        out = summary.setdefault("ablation_by_mean_source", {})
        for source in args.mean_sources.split(","):
            t0 = time.perf_counter()
            cur = ih.ablation_curves(model, eval_tasks, a, b, percents=percents,
                                     n_prompts=args.eval_prompts, n_shots=5, loss_sequences=4,
                                     loss_tokens=128, exclude_fraction=0.05,
                                     mean_source=source, mean_tasks=fv_pool, n_boot=2000)
            out[source] = {
                "tasks": eval_tasks, "mean_tasks": fv_pool if source == "cross-task" else None,
                "percents": cur.percent.values.tolist(), "n_prompts": args.eval_prompts,
                "n_shots": 5, "exclude_fraction": 0.05, "n_boot": 2000,
                **{var: {r: cur[var].sel(ranking=r).values.round(4).tolist()
                         for r in cur.ranking.values.tolist()}
                   for var in ("mean_accuracy", "mean_accuracy_low", "mean_accuracy_high",
                               "mean_answer_prob")},
                "seconds": time.perf_counter() - t0}
            save()
    if "ablation-xfit" in stages:
        xfit(model, summary, save, args, percents)
    if "ablation-f1" in stages:
        by_score(model, summary, save, args)
    if "token-loss-long" in stages:
        token_loss_long(model, summary, save, args, percents)
    if "fvacc" in stages:
        b = np.array(summary["overlap"]["fv_score"])
        t0 = time.perf_counter()
        acc = tv.function_vector_accuracy(model, td_tasks, b, top_fraction=0.02,
                                          n_prompts=16, n_shots=5)
        summary["function_vectors"] = {
            "layer": acc.attrs["layer"], "heads": acc.attrs["heads"], "n_prompts": 16,
            "zero_shot": dict(zip(td_tasks, acc.zero_shot_accuracy.values.round(4).tolist())),
            "with_fv": dict(zip(td_tasks, acc.fv_accuracy.values.round(4).tolist())),
            "few_shot": dict(zip(td_tasks, acc.few_shot_accuracy.values.round(4).tolist())),
            "seconds": time.perf_counter() - t0}
        save()
    if "td" in stages:
        t0 = time.perf_counter()
        td = tv.task_decodability(model, td_tasks, n_prompts=20, n_shots=4, k=10)
        best = td.attrs["best_layer"]
        summary["task_decodability"] = {
            "td": td.td.values.round(4).tolist(), "best_layer": best, "n_prompts": 20,
            "n_shots": 4, "k": 10,
            "td_mean_over_layers_per_task": dict(zip(
                td.task.values.tolist(), td.td_per_task.mean("layer").values.round(4).tolist())),
            "td_best_per_task": dict(zip(td.task.values.tolist(),
                                         td.td_per_task.sel(layer=best).values.round(4).tolist())),
            "icl_accuracy": dict(zip(td.task.values.tolist(),
                                     [None if np.isnan(v) else round(float(v), 4)
                                      for v in td.icl_accuracy.values])),
            "td_accuracy_r2": td.attrs["td_accuracy_r2"],
            "seconds": time.perf_counter() - t0}
        save()
    if "tv-patching" in stages:
        from explorer.analyses.task_vector_patching import task_vector_patching

        t0 = time.perf_counter()
        tvp = task_vector_patching(model, td_tasks, n_prompts=args.eval_prompts, n_shots=4,
                                   target_shots=0, mode="replace")
        acc = tvp.accuracy
        summary["task_vector_patching"] = {
            "tasks": td_tasks, "n_prompts": args.eval_prompts, "n_shots": 4,
            "target_shots": 0, "mode": "replace", "layers": tvp.layer.values.tolist(),
            "zero_shot": dict(zip(td_tasks, acc.sel(vector="none", layer=0).values
                                  .round(4).tolist())),
            "few_shot": dict(zip(td_tasks, tvp.few_shot_accuracy.values.round(4).tolist())),
            **{f"with_{v}_vector": {t: acc.sel(task=t, vector=v).values.round(4).tolist()
                                    for t in td_tasks} for v in ("task", "null")},
            "best_layer_task_vector": {
                t: int(tvp.layer.values[int(np.argmax(acc.sel(task=t, vector="task").values))])
                for t in td_tasks},
            "seconds": time.perf_counter() - t0}
        save()
    if "tv-conflict" in stages:
        from explorer.analyses.task_vector_patching import conflicting_task_patching

        t0 = time.perf_counter()
        ctasks = args.conflict_tasks.split(",")
        layers = [int(x) for x in args.conflict_layers.split(",")]
        ct = conflicting_task_patching(model, ctasks, layers=layers,
                                       n_prompts=args.eval_prompts, n_shots=4, mode="replace")

        def grid(name):
            return {s: {t: [None if np.isnan(v) else round(float(v), 4)
                            for v in ct[name].sel(source=s, target=t).values]
                        for t in ctasks} for s in ct.source.values}

        summary["task_vector_conflict"] = {
            "tasks": ctasks, "n_prompts": args.eval_prompts, "n_shots": 4, "mode": "replace",
            "layers": layers, "best_layer": ct.attrs["best_layer"],
            "n_scored": {s: dict(zip(ctasks, ct.n_scored.sel(source=s).values.tolist()))
                         for s in ct.source.values},
            **{name: grid(name) for name in
               ("follows_source", "follows_source_low", "follows_source_high",
                "follows_target", "follows_target_low", "follows_target_high")},
            "seconds": time.perf_counter() - t0}
        save()
    if "lora" in stages:
        from explorer.analyses import icl_finetune as ft

        t0 = time.perf_counter()
        res = ft.early_late_finetune(model, td_tasks[:4], steps=args.lora_steps)
        summary["lora"] = {**ft.finetune_summary(res), "seconds": time.perf_counter() - t0}
        save()
    print(json.dumps({k: v for k, v in summary.items()
                      if k not in ("induction", "fv", "overlap")}, indent=1)[:4000])


if __name__ == "__main__":
    main()
