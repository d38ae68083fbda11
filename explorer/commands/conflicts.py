"""`explorer conflicts` (flags, parsing and printing over `explorer.analyses.conflicts`):
the closed-book filter, JuICE head selection and the dual-run accuracy over the shipped facts.
"""
from __future__ import annotations

from typing import Any

import xarray as xr

from explorer._checks import InputError, check_int
from explorer.analyses import conflicts as C
from explorer.commands._common import add_model_option, add_number_options, load_cli_model
from explorer.commands._common import print_summary


def register_cli(subparsers: Any) -> None:
    """Add ``explorer conflicts``: closed-book filter, head selection, accuracy."""
    p = subparsers.add_parser(
        "conflicts", help="knowledge conflicts: JuICE head selection and dual-run accuracy",
        description="Knowledge conflicts (Li et al., JuICE, ICML 2025) over the shipped facts.")
    add_model_option(p)
    p.add_argument("--relations", default=None, help="comma-separated relations (default all)")
    p.add_argument("--direction", default="parametric", choices=C.DIRECTIONS)
    p.add_argument("--k", type=int, default=5, help="heads per set (default 5)")
    p.add_argument("--select-facts", type=int, default=4, help="facts used to select heads")
    p.add_argument("--layers", default=None, help="comma-separated layers to score (default all)")
    add_number_options(p, alpha_l=1.0, alpha_s=1.0)
    p.add_argument("--limit", type=int, default=None, help="evaluate at most N facts")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=_cmd_conflicts)


def _cmd_conflicts(args: Any) -> int:
    model = load_cli_model(args)
    rels = None if args.relations is None else [r.strip() for r in args.relations.split(",")]
    facts = C.closed_book_facts(model, C.load_facts(rels))
    n_sel = check_int("select_facts", args.select_facts, low=1)
    if len(facts) <= n_sel:
        raise InputError(f"the model answers only {len(facts)} facts closed book; need more "
                         f"than --select-facts={n_sel}.")
    layers = None if args.layers is None else [int(x) for x in args.layers.split(",")]
    sel = C.juice_head_selection(model, facts[:n_sel], direction=args.direction, k=args.k,
                                 layers=layers)
    plus, minus = C.selected_heads(sel)
    rest = facts[n_sel:] if args.limit is None else facts[n_sel:n_sel + args.limit]
    acc = C.conflict_accuracy(model, rest, plus, minus, alpha_l=args.alpha_l,
                              alpha_s=args.alpha_s)
    summary = {
        "model": model.spec.name, "n_closed_book": len(facts), "n_eval": len(rest),
        "direction": args.direction, "heads_plus": plus, "heads_minus": minus,
        "alpha_l": args.alpha_l, "alpha_s": args.alpha_s,
        "memory_accuracy": _table(acc.memory_accuracy),
        "context_accuracy": _table(acc.context_accuracy),
    }
    print_summary(summary, as_json=args.json)
    return 0


def _table(da: xr.DataArray) -> dict[str, dict[str, float]]:
    """An accuracy array as ``{intervention: {prompt kind: accuracy}}``."""
    return {m: {k: float(da.sel(intervention=m, kind=k)) for k in da.kind.values.tolist()}
            for m in da.intervention.values.tolist()}
