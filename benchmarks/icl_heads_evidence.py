"""Evidence for docs/icl_heads.md: induction vs FV heads, ablations, function vectors, TD on SmolLM2.

Writes ``docs/figures/icl_heads_summary.json`` after every stage (a partial run keeps what
it finished). Usage::

    python benchmarks/icl_heads_evidence.py [--stages bench,scores,ablation,fv,td]

``--threads 1`` (the default) is fastest on a busy machine.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SUMMARY = ROOT / "docs" / "figures" / "icl_heads_summary.json"

FV_TASKS = ["antonym", "country-capital", "english-french"]
EVAL_TASKS = ["capitalize", "present-past", "singular-plural", "choose-first-of-3"]
TD_TASKS = ["antonym", "country-capital", "english-french", "capitalize", "present-past",
            "singular-plural"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stages", default="bench,scores,ablation,fv,td")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--n-prompts", type=int, default=6)
    ap.add_argument("--fv-tasks", default=",".join(FV_TASKS))
    ap.add_argument("--eval-tasks", default=",".join(EVAL_TASKS))
    ap.add_argument("--td-tasks", default=",".join(TD_TASKS))
    ap.add_argument("--percents", default="0,1,3,5,10,20")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    from explorer import load_model
    from explorer.analyses import icl_heads as ih
    from explorer.analyses import task_vectors as tv

    stages = args.stages.split(",")
    fv_tasks, eval_tasks = args.fv_tasks.split(","), args.eval_tasks.split(",")
    td_tasks = args.td_tasks.split(",")
    percents = [float(p) for p in args.percents.split(",")]
    summary = json.loads(SUMMARY.read_text()) if SUMMARY.exists() else {}

    def save():
        SUMMARY.parent.mkdir(parents=True, exist_ok=True)
        SUMMARY.write_text(json.dumps(summary, indent=1))

    model = load_model("smollm2-135m")
    summary["model"] = model.spec.name
    if "bench" in stages:
        summary["bench"] = ih.bench_icl_heads(model, n_prompts=args.n_prompts, n_heads=6)
        save()
    if "scores" in stages:
        t0 = time.perf_counter()
        ind = ih.induction_scores(model, n_sequences=8, half_len=25, seed=42)
        t1 = time.perf_counter()
        fv = ih.fv_scores(model, fv_tasks, n_prompts=args.n_prompts, n_shots=5, seed=0)
        t2 = time.perf_counter()
        a, b = ind.induction_score.values, fv.fv_score.values
        n_heads = a.size
        summary["scores"] = {
            "induction_score": a.round(4).tolist(), "fv_score": b.round(5).tolist(),
            "fv_tasks": fv_tasks, "n_prompts": args.n_prompts, "induction_s": t1 - t0, "fv_s": t2 - t1,
            "fv_s_per_head_task": (t2 - t1) / (n_heads * len(fv_tasks)),
            "clean_prob": fv.clean_prob.values.round(4).tolist(),
            "corrupted_prob": fv.corrupted_prob.values.round(4).tolist(),
            "spearman": float(np.corrcoef(np.argsort(np.argsort(a.ravel())),
                                          np.argsort(np.argsort(b.ravel())))[0, 1]),
        }
        for frac in (0.02, 0.05, 0.10):
            ta, tb = ih.top_heads(a, frac), ih.top_heads(b, frac)
            summary["scores"][f"top{int(frac * 100)}pct"] = {
                "induction": ta, "fv": tb, "shared": sorted(set(ta) & set(tb))}
        save()
    if "scores" not in stages and "scores" in summary:  # reuse the stored scores
        a = np.array(summary["scores"]["induction_score"])
        b = np.array(summary["scores"]["fv_score"])
    if "ablation" in stages:
        t0 = time.perf_counter()
        cur = ih.ablation_curves(model, eval_tasks, a, b, percents=percents,
                                 n_prompts=args.n_prompts, n_shots=5, loss_sequences=4, loss_tokens=128)
        summary["ablation"] = {
            "tasks": eval_tasks, "percents": cur.percent.values.tolist(),
            "mean_accuracy": {r: cur.mean_accuracy.sel(ranking=r).values.round(4).tolist()
                              for r in cur.ranking.values.tolist()},
            "token_loss_difference": {
                r: cur.token_loss_difference.sel(ranking=r).values.round(4).tolist()
                for r in cur.ranking.values.tolist()},
            "seconds": time.perf_counter() - t0}
        save()
    if "fv" in stages:
        acc = tv.function_vector_accuracy(model, td_tasks, b, top_fraction=0.02,
                                          n_prompts=args.n_prompts)
        summary["function_vectors"] = {
            "layer": acc.attrs["layer"], "heads": acc.attrs["heads"],
            "zero_shot": dict(zip(td_tasks, acc.zero_shot_accuracy.values.round(4).tolist())),
            "with_fv": dict(zip(td_tasks, acc.fv_accuracy.values.round(4).tolist())),
            "few_shot": dict(zip(td_tasks, acc.few_shot_accuracy.values.round(4).tolist()))}
        save()
    if "td" in stages:
        td = tv.task_decodability(model, td_tasks, n_prompts=2 * args.n_prompts, n_shots=4, k=10)
        best = td.attrs["best_layer"]
        summary["task_decodability"] = {
            "td": td.td.values.round(4).tolist(), "best_layer": best,
            "td_mean_over_layers_per_task": dict(zip(
                td.task.values.tolist(), td.td_per_task.mean("layer").values.round(4).tolist())),
            "td_best_per_task": dict(zip(td.task.values.tolist(),
                                         td.td_per_task.sel(layer=best).values.round(4).tolist())),
            "icl_accuracy": dict(zip(td.task.values.tolist(),
                                     [None if np.isnan(v) else round(float(v), 4)
                                      for v in td.icl_accuracy.values])),
            "td_accuracy_r2": td.attrs["td_accuracy_r2"]}
        save()
    print(json.dumps({k: v for k, v in summary.items() if k != "scores"}, indent=1))


if __name__ == "__main__":
    main()
