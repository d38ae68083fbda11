"""`explorer patching` (flags, parsing and printing over `explorer.patching`): an
activation-patching grid between a clean and a corrupted prompt of the same token length.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from explorer.commands._common import (add_command, load_cli_model, load_edits,
                                       parse_int_list, print_summary)
from explorer.commands.dla import token_arg

_KINDS = ("resid_pre", "attn_out", "mlp_out", "heads", "heads_by_pos")


def register_cli(subparsers: Any) -> None:
    """Add ``explorer patching``."""
    p = add_command(
        subparsers, "patching", _cmd_patching,
        json_help="print the result as JSON (the whole grid included)",
        help="activation patching between a clean and a corrupted prompt",
        description="Patch one activation at a time (a site at one layer and position, or "
                    "one head) from one prompt's run into the other's and report how much "
                    "of the answer moves: the normalised logit difference (patched - "
                    "corrupted) / (clean - corrupted), or the answer's probability.")
    p.add_argument("--clean", required=True, help="the clean prompt")
    p.add_argument("--corrupt", required=True,
                   help="the corrupted prompt (as many tokens as --clean)")
    p.add_argument("--kind", choices=_KINDS, default="resid_pre",
                   help="the grid: a site over layer x position, or heads over layer x head "
                        "(all positions) or layer x position x head (default resid_pre)")
    p.add_argument("--metric", choices=("logit_diff", "prob"), default="logit_diff",
                   help="normalised logit difference or the answer's probability "
                        "(default logit_diff)")
    p.add_argument("--direction", choices=("denoising", "noising"), default="denoising",
                   help="denoising: clean activations into the corrupted run; noising: "
                        "corrupted into the clean run (default denoising)")
    p.add_argument("--answer", default=None,
                   help="answer token: a one-token text (mind the leading space) or #ID "
                        "(default: the clean run's top token)")
    p.add_argument("--alt", default=None,
                   help="alternative token, as --answer (default: the corrupted run's top "
                        "token, or its second where that is the answer)")
    p.add_argument("--layers", default=None, help="comma-separated layers or ranges like 0-5 (default all)")
    p.add_argument("--positions", default=None,
                   help="comma-separated positions, negative from the end (default all)")
    p.add_argument("--edits", metavar="FILE", default=None,
                   help="JSON file of interventions applied to every run")
    p.add_argument("--top", type=int, default=10, help="cells listed by |effect| (default 10)")


def _cmd_patching(args: Any) -> int:
    from explorer.patching import activation_patching

    model = load_cli_model(args)
    ds = activation_patching(
        model, args.clean, args.corrupt, kind=args.kind, metric=args.metric,
        direction=args.direction, answer=token_arg(args.answer),
        alternative=token_arg(args.alt), edits=load_edits(args.edits),
        layers=None if args.layers is None else parse_int_list("--layers", args.layers,
                                                               ranges=True),
        positions=None if args.positions is None else parse_int_list("--positions",
                                                                     args.positions))
    print_summary(patching_summary(ds, top=args.top, grid=args.json), as_json=args.json)
    return 0


def patching_summary(ds: Any, *, top: int = 10, grid: bool = True) -> dict[str, Any]:
    """The result as plain values: the setting, the unpatched runs' values, the ``top``
    cells by |effect| (by |effect - 1| when noising) and, with ``grid``, the whole grid
    (``effect`` as nested lists over ``dims``)."""
    p = ds.attrs["params"]
    out: dict[str, Any] = {
        "model": ds.attrs["model"], "kind": p["kind"], "metric": p["metric"],
        "direction": p["direction"], "clean": p["clean"], "corrupt": p["corrupt"],
        "answer": p["answer"], "answer_id": p["answer_id"], "alternative": p["alternative"],
        "alternative_id": p["alternative_id"], "changed_positions": p["changed_positions"],
        "clean_logit_diff": p["clean_logit_diff"], "corrupt_logit_diff": p["corrupt_logit_diff"],
        "clean_prob": p["clean_prob"], "corrupt_prob": p["corrupt_prob"],
        "n_edits": len(ds.attrs["edits"]), "dims": list(ds.effect.dims)}
    flat = ds.effect.stack(cell=ds.effect.dims)
    unpatched = 1.0 if p["direction"] == "noising" and p["metric"] == "logit_diff" else 0.0
    if p["metric"] == "prob":
        unpatched = p["clean_prob"] if p["direction"] == "noising" else p["corrupt_prob"]
    order = np.argsort(-np.abs(flat.values - unpatched), kind="stable")[:top]
    out["top"] = []
    for i in order:
        cell = {d: int(flat[d].values[i]) for d in ds.effect.dims}
        if "pos" in cell:
            cell["token"] = str(ds.token.sel(pos=cell["pos"]).item())
        out["top"].append({**cell, "effect": float(flat.values[i])})
    if grid:
        out["coords"] = {d: ds[d].values.tolist() for d in ds.effect.dims}
        if "pos" in ds.effect.dims:
            out["tokens"] = ds.token.values.tolist()
        out["effect"] = ds.effect.values.tolist()
    return out
