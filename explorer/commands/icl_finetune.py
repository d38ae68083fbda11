"""`explorer icl-finetune` (flags, parsing and printing over `explorer.analyses.icl_finetune`):
LoRA on only the first or only the last layers of a copy of the model, TD and accuracy.

It runs at one torch thread unless ``--threads N`` (the CLI's global flag) says otherwise:
on a shared machine the small training steps are fastest that way.
"""
from __future__ import annotations

from typing import Any

from explorer.analyses import icl_finetune as ft
from explorer.commands._common import add_command, add_number_options, add_tasks_option
from explorer.commands._common import load_cli_model, print_json


def register_cli(subparsers: Any) -> None:
    """Add ``explorer icl-finetune``: LoRA on the first vs the last layers (Han et al.)."""
    # one torch thread (fastest on a shared machine) unless --threads N says otherwise
    p = add_command(
        subparsers, "icl-finetune", _cmd_icl_finetune, threads=1,
        help="LoRA on only the first or only the last layers: TD and accuracy",
        description="Fine-tune the first or the last layers of a copy of the model on the "
                    "task with the lowest task decodability (Han et al., ICML 2025).")
    add_tasks_option(p, "; the one with the lowest TD is tuned")
    p.add_argument("--n-layers-tuned", type=int, default=None,
                   help="layers tuned at each end (default n_layers // 4)")
    add_number_options(p, rank=4, steps=30, lr=1e-3, batch_size=4, n_prompts=12, n_shots=3, k=10,
                       seed=0)
    p.add_argument("--engine", choices=ft.ENGINES, default=None,
                   help="peft on a copy of the model, or adapters applied by hooks without a "
                        "copy (default: peft locally, hooks for --remote)")


def _cmd_icl_finetune(args: Any) -> int:
    model = load_cli_model(args)
    tasks = [s.strip() for s in args.tasks.split(",") if s.strip()]
    ds = ft.early_late_finetune(model, tasks, n_layers_tuned=args.n_layers_tuned, rank=args.rank,
                                steps=args.steps, lr=args.lr, batch_size=args.batch_size,
                                n_prompts=args.n_prompts, n_shots=args.n_shots, k=args.k,
                                seed=args.seed, engine=args.engine)
    summary = {"model": model.spec.name, **ft.finetune_summary(ds)}
    if args.json:
        print_json(summary)
    else:
        print(f"tuned task: {summary['task']} (lowest TD)")
        for v in ft.VARIANTS:
            s = summary[v]
            print(f"{v:>5}: accuracy {s['accuracy']:.3f}, task TD (mean over layers) "
                  f"{s['task_td_mean']:.3f}, trainable {s['n_trainable']}")
    return 0
