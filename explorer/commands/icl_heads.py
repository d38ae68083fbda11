"""`explorer icl-heads` (flags, parsing and printing over `explorer.analyses.icl_heads`):
induction and function-vector head scores, their overlap and optional ablation curves.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from explorer._checks import InputError
from explorer.analyses import icl_heads as ih
from explorer.commands._common import add_command, add_number_options, load_cli_model
from explorer.commands._common import print_json


ABOVE_CHANCE = "above-chance"


def _overlap(a: np.ndarray, b: np.ndarray, fraction: float) -> dict[str, Any]:
    """The top ``fraction`` of heads by each score and the heads in both."""
    ta, tb = ih.top_heads(a, fraction), ih.top_heads(b, fraction)
    return {"fraction": fraction, "top_induction": ta, "top_fv": tb,
            "shared": sorted(set(ta) & set(tb))}


def register_cli(subparsers: Any) -> None:
    """Add ``explorer icl-heads``: induction and FV scores, optional ablation curves."""
    p = add_command(
        subparsers, "icl-heads", _cmd_icl_heads, paper="icl-heads",
        help="induction vs function-vector heads, and ablations",
        description="Induction and FV head scores (Yin & Steinhardt, ICML 2025).")
    p.add_argument("--tasks", default="antonym,country-capital,english-french",
                   help="comma-separated FV-scoring tasks (default: %(default)s)")
    p.add_argument("--eval-tasks", default="",
                   help="comma-separated tasks for ablation curves (empty: skip ablations; "
                        "'above-chance': every shipped task whose few-shot accuracy on "
                        "other prompts is above its chance level)")
    p.add_argument("--mean-source", default="cross-task", choices=ih.MEAN_SOURCES,
                   help="what an ablated head's last-token output is replaced with: the mean "
                        "over the --mean-tasks' prompts (cross-task, the paper's), the "
                        "evaluated task's own mean (per-task), or zero (default: %(default)s)")
    p.add_argument("--mean-tasks", default="",
                   help="comma-separated tasks of the cross-task mean (default: the FV-scoring "
                        "--tasks, as in the paper)")
    p.add_argument("--icl-score", default="first_token", choices=ih.ICL_SCORES,
                   help="first_token: argmax next token = the answer's first token; f1: the "
                        "paper's F1 of the answer parsed from 5 generated tokens, 5x the "
                        "forwards (default: %(default)s)")
    p.add_argument("--n-boot", type=int, default=1000,
                   help="bootstrap resamples of the accuracy interval (default %(default)s)")
    add_number_options(p, n_prompts=8, n_shots=5)
    p.add_argument("--percents", default="0,1,3,5,10,20")
    p.add_argument("--top-fraction", type=float, default=0.02,
                   help="top fraction of heads reported and excluded (default 0.02)")
    p.add_argument("--induction-sequences", type=int, default=16,
                   help="repeated random-token sequences of the induction score (default "
                        "%(default)s; the paper: 1000)")
    p.add_argument("--induction-half-len", type=int, default=50,
                   help="random tokens per half of each sequence (default %(default)s, the paper's)")
    p.add_argument("--induction-measure", default="abs", choices=("abs", "mul"),
                   help="abs: TransformerLens detect_head's error measure (the paper's); mul: "
                        "attention mass on the induction target (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0)


def _split(text: str) -> list[str]:
    return [s.strip() for s in text.split(",") if s.strip()]


def _cmd_icl_heads(args: Any) -> int:
    model = load_cli_model(args)
    ind = ih.induction_scores(model, seed=args.seed, n_sequences=args.induction_sequences,
                              half_len=args.induction_half_len, measure=args.induction_measure)
    fv = ih.fv_scores(model, _split(args.tasks), n_prompts=args.n_prompts, n_shots=args.n_shots,
                      seed=args.seed)
    a, b = ind["induction_score"].values, fv["fv_score"].values
    summary: dict[str, Any] = {
        "model": model.spec.name,
        "induction": {k: ind.attrs["params"][k] for k in ("n_sequences", "half_len", "measure")},
        "induction_score": a.tolist(), "fv_score": b.tolist(),
        "overlap": _overlap(a, b, args.top_fraction),
        "clean_prob": dict(zip(fv.task.values.tolist(), fv.clean_prob.values.tolist())),
        "corrupted_prob": dict(zip(fv.task.values.tolist(), fv.corrupted_prob.values.tolist())),
    }
    eval_tasks = _split(args.eval_tasks)
    if eval_tasks == [ABOVE_CHANCE]:
        screen = ih.task_screen(model, n_prompts=args.n_prompts, n_shots=args.n_shots,
                                seed=args.seed + 100)
        eval_tasks = [str(t) for t in screen.task.values[screen.above_chance.values]]
        summary["screen"] = {k: dict(zip(screen.task.values.tolist(),
                                         screen[k].values.tolist()))
                             for k in ("accuracy", "accuracy_low", "chance", "above_chance")}
        if not eval_tasks:
            raise InputError("no shipped task is above chance on this model; name "
                             "--eval-tasks explicitly.")
    if eval_tasks:
        curves = ih.ablation_curves(model, eval_tasks, a, b,
                                    percents=[float(x) for x in _split(args.percents)],
                                    exclude_fraction=args.top_fraction, n_prompts=args.n_prompts,
                                    n_shots=args.n_shots, seed=args.seed,
                                    mean_source=args.mean_source,
                                    mean_tasks=_split(args.mean_tasks) or _split(args.tasks),
                                    n_boot=args.n_boot, score=args.icl_score)
        rk = curves.ranking.values.tolist()
        summary.update({
            "eval_tasks": eval_tasks, "mean_source": args.mean_source,
            "icl_score": args.icl_score,
            "mean_tasks": curves.attrs["params"]["mean_tasks"],
            "confidence_level": curves.attrs["params"]["confidence_level"],
            "percents": curves.percent.values.tolist(),
            **{var: {r: curves[var].sel(ranking=r).values.tolist() for r in rk}
               for var in ("mean_accuracy", "mean_accuracy_low", "mean_accuracy_high",
                           "mean_answer_prob", "token_loss_difference")}})
    if args.json:
        print_json(summary)
        return 0
    ov = summary["overlap"]
    print(f"top induction heads: {ov['top_induction']}")
    print(f"top FV heads:        {ov['top_fv']}")
    print(f"shared:              {ov['shared']}")
    if eval_tasks:
        level = f"{summary['confidence_level']:.0%}"
        what = ("F1 of the generated answer" if summary["icl_score"] == "f1"
                else "few-shot accuracy")
        print(f"\n{what} [{level} bootstrap interval] with the top % heads ablated "
              f"({summary['mean_source']} mean; tasks: {', '.join(eval_tasks)})")
        print("ranking".ljust(20) + "".join(f"{p:>20g}%" for p in summary["percents"]))
        for r in summary["mean_accuracy"]:
            cells = [f"{m:.2f} [{lo:.2f}, {hi:.2f}]" for m, lo, hi in zip(
                summary["mean_accuracy"][r], summary["mean_accuracy_low"][r],
                summary["mean_accuracy_high"][r])]
            print(r.ljust(20) + "".join(c.rjust(21) for c in cells))
    return 0
