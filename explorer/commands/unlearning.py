"""`explorer unlearn` (flags, parsing and printing over `explorer.analyses.unlearning`):
localize where facts are looked up, unlearn there per localization, evaluate.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from explorer._checks import check_choice
from explorer.analyses import unlearning as U
from explorer.commands._common import add_model_option, load_cli_model, print_summary


def register_cli(subparsers: Any) -> None:
    """Add ``explorer unlearn``: localize, unlearn per method, evaluate."""
    p = subparsers.add_parser(
        "unlearn", help="mechanistic unlearning: localize facts, unlearn there, evaluate",
        description="Mechanistic unlearning (Guo et al., ICML 2025) of athlete -> sport facts.")
    add_model_option(p)
    p.add_argument("--methods", default=",".join(U.METHODS),
                   help=f"comma-separated localizations (default all: {','.join(U.METHODS)})")
    p.add_argument("--n-layers", type=int, default=4, help="MLP layers per localization (budget)")
    p.add_argument("--objective", default="unlearn", choices=U.OBJECTIVES)
    p.add_argument("--n-forget", type=int, default=16)
    p.add_argument("--n-retain", type=int, default=8)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--retain-weight", type=float, default=1.0)
    p.add_argument("--relearn-steps", type=int, default=3)
    p.add_argument("--relearn-lr", type=float, default=3e-5)
    p.add_argument("--facts", default=None,
                   help="fact file (JSON like datasets/unlearning/athlete_sport.json)")
    p.add_argument("--known-formats", default="trained", choices=("trained", "both"),
                   help="keep the facts the model answers in the trained format (default) or "
                        "in both the trained and the multiple-choice format")
    p.add_argument("--all-facts", action="store_true",
                   help="use every fact, not only those the model answers (see --known-formats)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=_cmd_unlearn, default_threads=1)


def _cmd_unlearn(args: Any) -> int:
    model = load_cli_model(args)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    for m in methods:
        check_choice("method", m, U.METHODS)
    everything = U.load_attribute_facts(args.facts)
    formats = U.FORMATS if args.known_formats == "both" else ("trained",)
    facts = everything if args.all_facts else U.known_facts(model, everything, formats=formats)
    forget, retain = U.split_facts(facts, args.n_forget, args.n_retain, seed=args.seed)
    probe = trace = attribution = None
    if "fact_lookup" in methods:
        _, counts = np.unique([f.attribute for f in everything], return_counts=True)
        probe = U.attribute_probe_curve(model, everything, seed=args.seed,
                                        n_folds=int(min(4, counts.min())))
    if "causal_tracing" in methods:
        trace = U.causal_trace(model, forget, positions=False, seed=args.seed)
    if "attribution_patching" in methods:
        attribution = U.attribution_patching(model, forget, seed=args.seed)
    ds = U.unlearning_comparison(
        model, forget, retain, methods=methods, n_layers=args.n_layers, objective=args.objective,
        steps=args.steps, lr=args.lr, retain_weight=args.retain_weight,
        relearn_steps=args.relearn_steps, relearn_lr=args.relearn_lr, probe=probe, trace=trace,
        attribution=attribution, seed=args.seed)
    summary = {
        "model": model.spec.name, "n_known": len(facts), "n_forget": len(forget),
        "n_retain": len(retain), "objective": args.objective, "steps": args.steps,
        "lr": args.lr, "relearn_steps": args.relearn_steps, "relearn_lr": args.relearn_lr,
        "methods": {m: {"layers": str(ds["trained_layers"].sel(localization=m).item()),
                        "n_params": int(ds.n_params.sel(localization=m)),
                        "seconds_per_step": _num(ds.seconds_per_step.sel(localization=m)),
                        **{k: _num(ds.accuracy.sel(localization=m, metric=k)) for k in U.METRICS}}
                    for m in ds["localization"].values.tolist()},
    }
    if probe is not None:
        summary["probe_accuracy"] = [round(float(x), 3) for x in probe.probe_accuracy.values]
    print_summary(summary, as_json=args.json)
    return 0


def _num(x: Any) -> float | None:
    v = float(x)
    return None if np.isnan(v) else round(v, 4)
