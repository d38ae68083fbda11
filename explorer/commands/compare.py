"""`explorer compare` (flags, parsing and printing over `explorer.analyses.prompt_compare`):
two prompts side by side in one view (the logit lens, a head's attention, the saturation
layers or the direct logit attribution), each run alone, aligned, and their difference B - A;
``--out`` writes the same Dataset as the Two prompts page exports (NetCDF).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from explorer._checks import InputError
from explorer.commands._common import (add_command, json_safe, load_cli_model, load_edits,
                                       print_summary)
from explorer.commands.dla import token_arg


def register_cli(subparsers: Any) -> None:
    """Add ``explorer compare``."""
    from explorer.analyses.prompt_compare import COMPARE_VIEWS

    p = add_command(
        subparsers, "compare", _cmd_compare,
        help="two prompts side by side: lens, attention, saturation or DLA, and B - A",
        description="Run prompt A and prompt B alone through one view, align them by position "
                    "and give B - A where the grids match (same length in tokens; DLA always).")
    p.add_argument("--prompt", required=True, help="prompt A")
    p.add_argument("--second", required=True, help="prompt B, compared with A ('' for A alone)")
    p.add_argument("--view", default="lens", choices=COMPARE_VIEWS,
                   help="what is compared (default lens)")
    p.add_argument("--layer", type=int, default=0, help="attention view: the head's layer")
    p.add_argument("--head", type=int, default=0, help="attention view: the head")
    p.add_argument("--k", type=int, default=5, help="saturation view: ranks (default 5)")
    p.add_argument("--answer", default=None,
                   help="dla view: answer token (text or #ID; default A's top token)")
    p.add_argument("--alt", default=None,
                   help="dla view: alternative token (default A's second token)")
    p.add_argument("--edits", metavar="FILE", default=None,
                   help="JSON file of interventions applied to both prompts")
    p.add_argument("--top", type=int, default=5, help="largest changes listed (default 5)")
    p.add_argument("--out", metavar="FILE.nc", default=None,
                   help="write the Dataset as NetCDF (attrs as JSON text)")


def _cmd_compare(args: Any) -> int:
    from explorer.analyses.prompt_compare import compare_prompts

    model = load_cli_model(args)
    ds = compare_prompts(model, args.prompt, args.second, view=args.view, layer=args.layer,
                         head=args.head, k=args.k, answer=token_arg(args.answer),
                         alternative=token_arg(args.alt), edits=load_edits(args.edits))
    summary = compare_summary(ds, top=args.top)
    if args.out:
        summary["out"] = str(write_netcdf(ds, Path(args.out)))
    print_summary(summary, as_json=args.json)
    return 0


def compare_summary(ds: Any, *, top: int = 5) -> dict[str, Any]:
    """The result as plain values: the prompts and their lengths, the view, each prompt's
    headline, and the ``top`` cells with the largest |B - A| (or why there is no B - A)."""
    view = ds.attrs["view"]
    rows, cols = ds["value"].dims[1:]
    out: dict[str, Any] = {"model": ds.attrs["model"], "view": view,
                           "prompt_a": ds.attrs["prompts"][0],
                           "prompt_b": (ds.attrs["prompts"] + [""])[1],
                           "n_tokens": [int(n) for n in ds.n_tokens.values]}
    if view == "attention":
        out["head"] = ds.attrs["component"]
    if view == "dla":
        out.update(answer=ds.attrs["answer"], alternative=ds.attrs["alternative"],
                   logit_diff={str(p): float(d) for p, d in zip(ds.prompt.values,
                                                                 ds.logit_diff.values)})
    if view == "lens":  # the answer at the last position, per prompt, as the lens ends
        out["answer"] = {p: {"token": str(ds.top_token.sel(prompt=p).values[-1, n - 1]),
                             "prob": float(ds.value.sel(prompt=p).values[-1, n - 1])}
                         for p, n in zip(ds.prompt.values.tolist(), out["n_tokens"])}
    if "difference" not in ds:
        out["difference"] = None
        out["note"] = ds.attrs["difference_note"]
        return out
    d = ds.difference.values
    order = np.argsort(-np.nan_to_num(np.abs(d), nan=-1.0), axis=None, kind="stable")[:top]
    cells = []
    for flat in order:
        i, j = np.unravel_index(flat, d.shape)
        cell: dict[str, Any] = {rows: int(ds[rows].values[i]), cols: str(ds[cols].values[j])
                                if cols == "column" else int(ds[cols].values[j]),
                                "a": float(ds.value.values[0, i, j]),
                                "b": float(ds.value.values[1, i, j]), "b_minus_a": float(d[i, j])}
        if view == "dla":
            cell["component"] = str(ds.component.values[i, j])
        if view == "lens":
            cell["top_a"] = str(ds.top_token.values[0, i, j])
            cell["top_b"] = str(ds.top_token.values[1, i, j])
        cells.append(cell)
    out["largest_changes"] = cells
    return out


def write_netcdf(ds: Any, path: Path) -> Path:
    """``ds`` as NetCDF at ``path`` (attrs NetCDF cannot hold written as JSON text)."""
    if path.suffix != ".nc":
        raise InputError(f"`--out` must name a .nc file; got {str(path)!r}.")
    out = ds.copy(deep=False)
    out.attrs = {k: (v if isinstance(v, (str, int, float)) and not isinstance(v, bool)
                     else json.dumps(json_safe(v))) for k, v in ds.attrs.items()}
    for name in out.variables:
        if out[name].dtype.kind in "UO":
            out[name] = out[name].astype(str)
        if out[name].dtype == bool:
            out[name] = out[name].astype("i1")
    path.parent.mkdir(parents=True, exist_ok=True)
    out.to_netcdf(path, engine="scipy")
    return path
