"""`explorer unlearn` (flags, parsing and printing over `explorer.analyses.unlearning`):
localize where facts are looked up, unlearn there per localization, evaluate.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from explorer._checks import check_choice
from explorer.analyses import unlearning as U
from explorer.commands._common import add_command, add_number_options, load_cli_model
from explorer.commands._common import print_summary


def register_cli(subparsers: Any) -> None:
    """Add ``explorer unlearn``: localize, unlearn per method, evaluate."""
    p = add_command(
        subparsers, "unlearn", _cmd_unlearn, paper="unlearning", threads=1,
        help="mechanistic unlearning: localize facts, unlearn there, evaluate",
        description="Mechanistic unlearning (Guo et al., ICML 2025) of athlete -> sport facts.")
    p.add_argument("--methods", default=",".join(U.METHODS),
                   help=f"comma-separated localizations (default all: {','.join(U.METHODS)})")
    p.add_argument("--n-layers", type=int, default=4,
                   help="budget: the parameters of this many MLP layers per localization")
    p.add_argument("--objective", default="unlearn", choices=U.OBJECTIVES)
    add_number_options(p, n_forget=16, n_retain=8, steps=8, lr=2e-4, retain_weight=1.0)
    p.add_argument("--text-weight", type=float, default=1.0,
                   help="weight of the general-text retain term (0: none)")
    p.add_argument("--text-batch", type=int, default=4, help="text windows per training step")
    p.add_argument("--text-window", type=int, default=64, help="tokens per text window")
    p.add_argument("--heldout-windows", type=int, default=16,
                   help="held-out text windows the perplexity is read on")
    add_number_options(p, relearn_steps=3, relearn_lr=3e-5)
    p.add_argument("--facts", default=None,
                   help="fact file (JSON like datasets/unlearning/athlete_sport.json)")
    p.add_argument("--known-formats", default="trained", choices=("trained", "both"),
                   help="keep the facts the model answers in the trained format (default) or "
                        "in both the trained and the multiple-choice format")
    p.add_argument("--all-facts", action="store_true",
                   help="use every fact, not only those the model answers (see --known-formats)")
    p.add_argument("--seed", type=int, default=0)


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
    if {"causal_tracing", "causal_tracing_mlp"} & set(methods):
        trace = U.causal_trace(model, forget, positions=False, heads="causal_tracing" in methods,
                               seed=args.seed)
    if {"attribution_patching", "attribution_patching_mlp"} & set(methods):
        attribution = U.attribution_patching(model, forget, seed=args.seed)
    text = U.text_windows(model, "train", window=args.text_window) if args.text_weight > 0 else None
    heldout = U.text_windows(model, "heldout", window=args.text_window,
                             max_windows=args.heldout_windows)
    ds = U.unlearning_comparison(
        model, forget, retain, methods=methods, n_layers=args.n_layers, objective=args.objective,
        steps=args.steps, lr=args.lr, retain_weight=args.retain_weight,
        relearn_steps=args.relearn_steps, relearn_lr=args.relearn_lr, probe=probe, trace=trace,
        attribution=attribution, text=text, text_weight=args.text_weight,
        text_batch=args.text_batch, heldout_text=heldout, seed=args.seed)
    summary = {
        "model": model.spec.name, "n_known": len(facts), "n_forget": len(forget),
        "n_retain": len(retain), "objective": args.objective, "steps": args.steps,
        "lr": args.lr, "relearn_steps": args.relearn_steps, "relearn_lr": args.relearn_lr,
        "text_weight": args.text_weight,
        "methods": {m: {"layers": str(ds["trained_layers"].sel(localization=m).item()),
                        "components": str(ds["trained_components"].sel(localization=m).item()),
                        "n_heads": int(ds.n_heads.sel(localization=m)),
                        "n_params": int(ds.n_params.sel(localization=m)),
                        "perplexity": _num(ds.perplexity.sel(localization=m)),
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
