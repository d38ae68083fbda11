"""`explorer task-emergence train|analyse` (flags, parsing and printing over
`explorer.analyses.task_emergence`): train a small transformer on a mixture of in-context
tasks and store its checkpoints, then measure task decodability and ICL loss over training.
"""
from __future__ import annotations

import argparse
from typing import Any

from explorer.analyses import task_emergence as te
from explorer.analyses._training import terminal_progress
from explorer.commands._common import add_command, print_summary

#: The task mixture's and the model's settings that are command options: (name, type, help).
_SETTING_FLAGS = (
    ("d", int, "input dimension"),
    ("n_tasks", int, "latent tasks (disjoint orthogonal bases)"),
    ("rank", int, "rank of each task's basis"),
    ("n_examples", int, "in-context examples per prompt"),
    ("noise_std", float, "label noise standard deviation"),
    ("coef_mean", float, "mean of the coefficients in a basis"),
    ("coef_std", float, "standard deviation of the coefficients in a basis"),
    ("n_heads", int, "attention heads"),
    ("batch_size", int, "prompts per training step"),
)


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    """Add ``explorer task-emergence train|analyse``."""
    defaults = te.DEFAULTS
    # A tiny model: one thread is fastest on a shared machine.
    p = add_command(
        subparsers, "task-emergence", _cmd_task_emergence, paper="task-emergence", threads=1,
        model=False,
        help="task-vector emergence: train a small transformer on an ICL task mixture",
        description="train: train a GPT-2-style transformer from scratch on a mixture of sparse linear "
                    "regressions (Han et al., ICML 2025) and store its checkpoints. analyse: task "
                    "decodability per layer and ICL loss per task at every checkpoint of the stored "
                    "run (trained first if missing), with the steps at which each rises.")
    p.add_argument("action", choices=["train", "analyse"], help="train or analyse")
    p.add_argument("--seed", type=int, default=defaults["seed"], help="seed (default: 0)")
    p.add_argument("--steps", type=int, default=defaults["steps"], help="training steps (default: 20000)")
    p.add_argument("--checkpoint-every", type=int, default=defaults["checkpoint_every"],
                   help="steps between checkpoints (default: 250)")
    p.add_argument("--n-layers", type=int, default=defaults["n_layers"], help="layers (default: 3)")
    p.add_argument("--d-model", type=int, default=defaults["d_model"], help="width (default: 64)")
    p.add_argument("--lr", type=float, default=defaults["lr"], help="peak Adam learning rate (default: 1e-3)")
    p.add_argument("--warmup", type=int, default=defaults["warmup"],
                   help="steps of linear learning-rate warm-up (default: 500; then cosine decay to 0)")
    for name, kind, words in _SETTING_FLAGS:
        p.add_argument(f"--{name.replace('_', '-')}", type=kind, default=defaults[name],
                       help=f"{words} (default: {defaults[name]})")
    p.add_argument("--n-per-task", type=int, default=100,
                   help="analyse: evaluation prompts per task (default: 100)")
    p.add_argument("--k", type=int, default=10, help="analyse: neighbours of the k-NN vote (default: 10)")
    p.add_argument("--out", default=None,
                   help="train: also write the checkpoints to this safetensors file")
    p.add_argument("--retrain", action="store_true", help="train again even if the run is stored")


def _cmd_task_emergence(args: argparse.Namespace) -> int:
    from explorer.store import ActivationStore

    params = {"seed": args.seed, "steps": args.steps, "checkpoint_every": args.checkpoint_every,
              "n_layers": args.n_layers, "d_model": args.d_model, "lr": args.lr, "warmup": args.warmup,
              **{name: getattr(args, name) for name, _, _ in _SETTING_FLAGS}}
    store = ActivationStore()
    progress = None if args.json else terminal_progress("training")
    if args.action == "train":
        run = te.task_emergence_run(store=store, retrain=True, progress=progress, **params)
        out: dict[str, Any] = {
            "key": store.key(te.run_key_parts({**te.DEFAULTS, **params})), "store": str(store.path),
            "params": run.attrs["params"], "seed": run.attrs["seed"],
            "train_seconds": run.attrs["train_seconds"], "n_checkpoints": int(run.sizes["step"]),
            "final_train_loss": float(run["train_loss"].values[-1])}
        if args.out:
            out["safetensors"] = str(te.save_run_safetensors(run, args.out))
    else:
        run = te.task_emergence_run(store=store, retrain=args.retrain, progress=progress, **params)
        analysis = te.stored_task_emergence_analysis(run, store=store, n_per_task=args.n_per_task,
                                                     k=args.k)
        out = {"train_seconds": run.attrs["train_seconds"], "n_checkpoints": int(run.sizes["step"]),
               **{key: analysis.attrs[key] for key in te.emergence_summary(analysis)}}
    print_summary(out, as_json=args.json)
    return 0
