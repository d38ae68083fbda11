"""`explorer icl-heads` (flags, parsing and printing over `explorer.analyses.icl_heads`):
induction and function-vector head scores, their overlap and optional ablation curves.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from explorer.analyses import icl_heads as ih
from explorer.commands._common import add_model_option, load_cli_model, print_json


def _overlap(a: np.ndarray, b: np.ndarray, fraction: float) -> dict[str, Any]:
    """The top ``fraction`` of heads by each score and the heads in both."""
    ta, tb = ih.top_heads(a, fraction), ih.top_heads(b, fraction)
    return {"fraction": fraction, "top_induction": ta, "top_fv": tb,
            "shared": sorted(set(ta) & set(tb))}


def register_cli(subparsers: Any) -> None:
    """Add ``explorer icl-heads``: induction and FV scores, optional ablation curves."""
    p = subparsers.add_parser(
        "icl-heads", help="induction vs function-vector heads, and ablations",
        description="Induction and FV head scores (Yin & Steinhardt, ICML 2025).")
    add_model_option(p)
    p.add_argument("--tasks", default="antonym,country-capital,english-french",
                   help="comma-separated FV-scoring tasks (default: %(default)s)")
    p.add_argument("--eval-tasks", default="",
                   help="comma-separated tasks for ablation curves (empty: skip ablations)")
    p.add_argument("--n-prompts", type=int, default=8)
    p.add_argument("--n-shots", type=int, default=5)
    p.add_argument("--percents", default="0,1,3,5,10,20")
    p.add_argument("--top-fraction", type=float, default=0.02,
                   help="top fraction of heads reported and excluded (default 0.02)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=_cmd_icl_heads)


def _split(text: str) -> list[str]:
    return [s.strip() for s in text.split(",") if s.strip()]


def _cmd_icl_heads(args: Any) -> int:
    model = load_cli_model(args)
    ind = ih.induction_scores(model, seed=args.seed)
    fv = ih.fv_scores(model, _split(args.tasks), n_prompts=args.n_prompts, n_shots=args.n_shots,
                      seed=args.seed)
    a, b = ind["induction_score"].values, fv["fv_score"].values
    summary: dict[str, Any] = {
        "model": model.spec.name,
        "induction_score": a.tolist(), "fv_score": b.tolist(),
        "overlap": _overlap(a, b, args.top_fraction),
        "clean_prob": dict(zip(fv.task.values.tolist(), fv.clean_prob.values.tolist())),
        "corrupted_prob": dict(zip(fv.task.values.tolist(), fv.corrupted_prob.values.tolist())),
    }
    if _split(args.eval_tasks):
        curves = ih.ablation_curves(model, _split(args.eval_tasks), a, b,
                                    percents=[float(x) for x in _split(args.percents)],
                                    exclude_fraction=args.top_fraction, n_prompts=args.n_prompts,
                                    n_shots=args.n_shots, seed=args.seed)
        summary["percents"] = curves.percent.values.tolist()
        summary["mean_accuracy"] = {r: curves.mean_accuracy.sel(ranking=r).values.tolist()
                                    for r in curves.ranking.values.tolist()}
        summary["token_loss_difference"] = {
            r: curves.token_loss_difference.sel(ranking=r).values.tolist()
            for r in curves.ranking.values.tolist()}
    if args.json:
        print_json(summary)
    else:
        ov = summary["overlap"]
        print(f"top induction heads: {ov['top_induction']}")
        print(f"top FV heads:        {ov['top_fv']}")
        print(f"shared:              {ov['shared']}")
    return 0
