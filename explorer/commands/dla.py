"""`explorer dla` (flags, parsing and printing over `explorer.analyses.answer_dla`): each
head's and MLP's direct contribution to logit(answer) - logit(alternative) on one prompt,
clean and under the edits of a JSON file.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from explorer.commands._common import (add_command, load_cli_model, load_edits,
                                       parse_int_list, print_summary)


def register_cli(subparsers: Any) -> None:
    """Add ``explorer dla``."""
    p = add_command(subparsers, "dla", _cmd_dla,
                    help="direct logit attribution of an answer against an alternative",
                    description="Each head's and MLP's direct contribution to logit(answer) - "
                                "logit(alternative), through the final norm frozen at the "
                                "clean run; clean and under --edits.")
    p.add_argument("--prompt", required=True, help="the prompt")
    p.add_argument("--answer", default=None,
                   help="answer token: a one-token text (mind the leading space) or #ID "
                        "(default: the model's top token)")
    p.add_argument("--alt", default=None,
                   help="alternative token, as --answer (default: the second token)")
    p.add_argument("--edits", metavar="FILE", default=None,
                   help="JSON file of interventions for the edited run")
    p.add_argument("--positions", default="-1",
                   help="comma-separated positions where the logits are read (default -1)")
    p.add_argument("--top", type=int, default=10, help="components listed per run (default 10)")


def token_arg(text: str | None) -> int | str | None:
    """``#123`` -> token id 123; any other text is the token's text."""
    if text is not None and text.startswith("#") and text[1:].isdigit():
        return int(text[1:])
    return text


def _cmd_dla(args: Any) -> int:
    from explorer.analyses.answer_dla import answer_logit_attribution

    model = load_cli_model(args)
    ds = answer_logit_attribution(model, args.prompt, answer=token_arg(args.answer),
                                  alternative=token_arg(args.alt), edits=load_edits(args.edits),
                                  positions=parse_int_list("--positions", args.positions))
    print_summary(dla_summary(ds, top=args.top), as_json=args.json)
    return 0


def dla_summary(ds: Any, *, top: int = 10) -> dict[str, Any]:
    """The result as plain values: answer, alternative, per position and run the logit
    difference, the attributed total and the ``top`` components by |contribution|."""
    out: dict[str, Any] = {
        "model": ds.attrs["model"], "prompt": ds.attrs["prompt"],
        "answer": ds.attrs["answer"], "answer_id": ds.attrs["answer_id"],
        "alternative": ds.attrs["alternative"], "alternative_id": ds.attrs["alternative_id"],
        "norm": ds.attrs["params"]["norm"], "n_edits": len(ds.attrs["edits"]), "positions": []}
    for p in ds.pos.values.tolist():
        one = ds.sel(pos=p)
        entry: dict[str, Any] = {"pos": p, "position": int(one.position),
                                 "token": str(one.token.item())}
        for run in ds.run.values.tolist():
            r = one.sel(run=run)
            names = np.concatenate([r.head_component.values.ravel(), r.mlp_component.values])
            values = np.concatenate([r.heads.values.ravel(), r.mlp.values])
            order = np.argsort(-np.abs(values), kind="stable")[:top]
            entry[run] = {
                "logit_diff": float(r.logit_diff), "total": float(r.total),
                "embed": float(r.embed),
                "biases": float(r.attn_bias.sum() + r.norm_bias),
                "top": [{"component": str(names[i]), "contribution": float(values[i])}
                        for i in order]}
        out["positions"].append(entry)
    return out
