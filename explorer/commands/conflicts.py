"""`explorer conflicts` (flags, parsing and printing over `explorer.analyses.conflicts`):
the closed-book filter, JuICE head selection and the dual-run accuracy over the shipped facts.
"""
from __future__ import annotations

from typing import Any

import xarray as xr

from explorer._checks import InputError, check_int
from explorer.analyses import conflicts as C
from explorer.commands._common import add_command, add_number_options, load_cli_model
from explorer.commands._common import print_summary

#: The paper's alpha grids (alpha_s, alpha_l) per direction (JuICE's main_intervene.py /
#: main_context.py): alpha_s in 0..3 and alpha_l in 0..5 for the parametric direction, both
#: in 0..5 for the context direction.
ALPHA_GRIDS = {"parametric": ((0.0, 1.0, 2.0, 3.0), (0.0, 1.0, 2.0, 3.0, 4.0, 5.0)),
               "context": ((0.0, 1.0, 2.0, 3.0, 4.0, 5.0), (0.0, 1.0, 2.0, 3.0, 4.0, 5.0))}


def register_cli(subparsers: Any) -> None:
    """Add ``explorer conflicts``: closed-book filter, head selection, accuracy."""
    p = add_command(
        subparsers, "conflicts", _cmd_conflicts, paper="conflicts",
        help="knowledge conflicts: JuICE head selection and dual-run accuracy",
        description="Knowledge conflicts (Li et al., JuICE, ICML 2025) over the shipped facts.")
    p.add_argument("--relations", default=None, help="comma-separated relations (default all)")
    p.add_argument("--direction", default="parametric", choices=C.DIRECTIONS)
    p.add_argument("--k", type=int, default=5, help="heads per set (default 5)")
    p.add_argument("--select-facts", type=int, default=4, help="facts used to select heads")
    p.add_argument("--layers", default=None, help="comma-separated layers to score (default all)")
    add_number_options(p, alpha_l=1.0, alpha_s=1.0)
    p.add_argument("--alpha-search", action="store_true",
                   help="choose alpha_s and alpha_l on --val-facts held-out facts over the "
                        "paper's grid (accuracy, then target probability), as JuICE does on its "
                        "validation split; --alpha-l / --alpha-s are then not used")
    p.add_argument("--val-facts", type=int, default=4,
                   help="facts after the selection facts used by --alpha-search (default 4)")
    p.add_argument("--limit", type=int, default=None, help="evaluate at most N facts")


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
    rest = facts[n_sel:]
    search: dict[str, Any] | None = None
    alpha_l, alpha_s = args.alpha_l, args.alpha_s
    if args.alpha_search:
        n_val = check_int("val_facts", args.val_facts, low=1)
        if len(rest) <= n_val:
            raise InputError(f"the model answers only {len(facts)} facts closed book; need more "
                             f"than --select-facts + --val-facts = {n_sel + n_val}.")
        if not plus + minus:
            raise InputError("no head passed JuICE's consistency filter, so there is nothing "
                             "to scale; try --direction or --layers, or drop --alpha-search.")
        grid_s, grid_l = ALPHA_GRIDS[args.direction]
        found = C.juice_alpha_search(model, rest[:n_val], plus, minus, direction=args.direction,
                                     alpha_s_grid=grid_s, alpha_l_grid=grid_l)
        alpha_s, alpha_l = float(found.attrs["best_alpha_s"]), float(found.attrs["best_alpha_l"])
        search = {"val_facts": n_val, "alpha_s_grid": list(grid_s), "alpha_l_grid": list(grid_l),
                  "best_alpha_s": alpha_s, "best_alpha_l": alpha_l,
                  "best_accuracy": float(found.accuracy.sel(alpha_s=alpha_s, alpha_l=alpha_l))}
        rest = rest[n_val:]
    if args.limit is not None:
        rest = rest[:args.limit]
    acc = C.conflict_accuracy(model, rest, plus, minus, alpha_l=alpha_l, alpha_s=alpha_s)
    summary = {
        "model": model.spec.name, "n_closed_book": len(facts), "n_eval": len(rest),
        "direction": args.direction, "heads_plus": plus, "heads_minus": minus,
        "alpha_l": alpha_l, "alpha_s": alpha_s,
        **({"alpha_search": search} if search else {}),
        "memory_accuracy": _table(acc.memory_accuracy),
        "context_accuracy": _table(acc.context_accuracy),
    }
    print_summary(summary, as_json=args.json)
    return 0


def _table(da: xr.DataArray) -> dict[str, dict[str, float]]:
    """An accuracy array as ``{intervention: {prompt kind: accuracy}}``."""
    return {m: {k: float(da.sel(intervention=m, kind=k)) for k in da.kind.values.tolist()}
            for m in da.intervention.values.tolist()}
