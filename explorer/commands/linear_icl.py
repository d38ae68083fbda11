"""`explorer linear-icl train|analyse` (flags, parsing and printing over
`explorer.analyses.linear_icl`): train one attention layer per head count and store the runs,
then measure the KQ/OV patterns and the losses against debiased GD and the Bayes-optimal ridge.
"""
from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from explorer._checks import check_int
from explorer.analyses import linear_icl as lin
from explorer.analyses._training import terminal_progress
from explorer.commands._common import add_command, parse_int_list, print_json


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    """Add ``explorer linear-icl train|analyse``."""
    # The model is tiny: one thread beats several (by 3-20x on a busy 2-core machine).
    p = add_command(
        subparsers, "linear-icl", _cmd_linear_icl, paper="linear-icl", threads=1, model=False,
        help="multi-head softmax attention on in-context linear regression",
        description="train: train one attention layer per head count (He et al., ICML 2025) and "
                    "store the runs in the cache. analyse: KQ/OV pattern metrics, losses against "
                    "debiased GD and the Bayes-optimal ridge, H=1 vs H=2 (runs trained if missing).")
    p.add_argument("action", choices=["train", "analyse"], help="train or analyse")
    p.add_argument("--heads", default="1,2,4", metavar="LIST",
                   help="head counts, comma-separated (default: 1,2,4)")
    p.add_argument("--steps", type=int, default=lin.DEFAULTS["steps"],
                   help="Adam steps (default: 20000)")
    p.add_argument("--seed", type=int, default=lin.DEFAULTS["seed"], help="seed (default: 0)")
    p.add_argument("--checkpoint-every", type=int, default=lin.DEFAULTS["checkpoint_every"],
                   help="steps between checkpoints (default: 250)")
    p.add_argument("--lr", type=float, default=lin.DEFAULTS["lr"],
                   help="Adam learning rate (default: 1e-3)")
    p.add_argument("--n-prompts", type=int, default=2048,
                   help="analyse: test prompts per measurement (default: 2048)")
    p.add_argument("--retrain", action="store_true", help="train again even if a run is stored")


def _cmd_linear_icl(args: argparse.Namespace) -> int:
    from explorer.store import ActivationStore

    heads = parse_int_list("--heads", args.heads)
    for h in heads:
        check_int("--heads", h, low=1, high=64)
    store = ActivationStore()
    base = {"steps": args.steps, "seed": args.seed, "checkpoint_every": args.checkpoint_every,
            "lr": args.lr}
    out: dict[str, Any] = {}
    analyses = {}
    for H in heads:
        progress = None if args.json else terminal_progress(f"H={H}")
        run = lin.linear_icl_run(store=store, retrain=args.retrain or args.action == "train",
                                 progress=progress, n_heads=H, **base)
        if args.action == "train":
            parts = lin.run_key_parts({**lin.DEFAULTS, **base, "n_heads": H})
            out[str(H)] = {"key": store.key(parts),
                           "train_seconds": run.attrs["train_seconds"],
                           "n_checkpoints": int(run.sizes["step"]),
                           "final_train_loss": float(run["train_loss"].isel(step=-1)),
                           "final_test_loss": {str(int(L)): float(v) for L, v in zip(
                               run["context_length"].values, run["test_loss"].isel(step=-1).values)}}
        else:
            analyses[H] = lin.stored_linear_icl_analysis(run, store=store, n_prompts=args.n_prompts)
    if args.action == "train":
        out = {"store": str(store.path), "runs": out}
    else:
        out = lin.analysis_summary(analyses)
    if args.json:
        print_json(out)
    elif args.action == "train":
        for H, r in out["runs"].items():
            losses = ", ".join(f"L={L}: {v:.3f}" for L, v in r["final_test_loss"].items())
            print(f"H={H}: {r['n_checkpoints']} checkpoints in {r['train_seconds']:.0f} s; "
                  f"test loss {losses}")
        print(f"stored in {out['store']}")
    else:
        for H, r in out["runs"].items():
            print(f"H={H}: test loss {r['final_test_loss']:.4f} at L={r['train_context_length']}; "
                  f"omega {_fmt(r['omega'])}, mu {_fmt(r['mu'])}; KQ identity error "
                  f"{r['kq_identity_error_max']:.3f}, OV off-y {r['ov_offy_ratio_max']:.4f}, "
                  f"|sum mu|/sum|mu| {r['mu_sum_ratio']:.4f}; R^2 vs debiased GD {r['dgd_r2']:.4f}; "
                  f"pattern from step {r['pattern_step']}")
        if "loss_gap_h1_minus_h2" in out:
            print(f"loss gap H=1 minus H=2: {out['loss_gap_h1_minus_h2']:.4f}")
    return 0


def _fmt(values: Sequence[float]) -> str:
    return "[" + ", ".join(f"{v:+.3f}" for v in values) + "]"
