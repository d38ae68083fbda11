"""`explorer task-vectors` (flags, parsing and printing over `explorer.analyses.task_vectors`):
task decodability per layer and, with ``--function-vectors``, zero-shot function-vector accuracy.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from explorer.analyses import task_vectors as tv
from explorer.commands._common import add_command, add_number_options, add_scheduler_option
from explorer.commands._common import add_tasks_option, load_cli_model, print_json


def register_cli(subparsers: Any) -> None:
    """Add ``explorer task-vectors``: task decodability and function-vector accuracy."""
    p = add_command(
        subparsers, "task-vectors", _cmd_task_vectors,
        help="function vectors and task decodability per layer",
        description="Task decodability (Han et al., ICML 2025) and function vectors "
                    "(Todd et al., ICLR 2024).")
    add_tasks_option(p, "")
    add_number_options(p, n_prompts=20, n_shots=4, k=10)
    p.add_argument("--function-vectors", action="store_true",
                   help="also score FV heads on the tasks and report zero-shot FV accuracy")
    p.add_argument("--layer", type=int, default=None, help="FV layer (default n_layers // 3)")
    p.add_argument("--patching", action="store_true",
                   help="also run the causal test (Han et al.): each task's mean last-token "
                        "residual, and the Null task's, written over the last token of "
                        "zero-shot prompts per layer; accuracy with Wilson intervals")
    p.add_argument("--patching-layers", default="",
                   help="layers of the patching test, e.g. '0,8,18-22' (default: all)")
    p.add_argument("--target-shots", type=int, default=0,
                   help="demonstrations in the patched prompts (default 0: zero-shot)")
    p.add_argument("--mode", default="replace", choices=("replace", "add"),
                   help="replace the last token's residual with the vector, or add it")
    add_number_options(p, top_fraction=0.02, seed=0)
    add_scheduler_option(p)
    p.add_argument("--store-residuals", action="store_true",
                   help="cache the last-token residuals in the activation store; TD then "
                        "runs with dask over the cached entry, one task per layer")


def _cmd_task_vectors(args: Any) -> int:
    from explorer._checks import parse_layer_list
    from explorer.analyses.icl_heads import fv_scores
    from explorer.distributed import check_scheduler
    from explorer.store import ActivationStore

    scheduler = check_scheduler(args.scheduler)
    model = load_cli_model(args)
    tasks = [s.strip() for s in args.tasks.split(",") if s.strip()]
    td = tv.task_decodability(model, tasks, n_prompts=args.n_prompts, n_shots=args.n_shots,
                              k=args.k, seed=args.seed, scheduler=scheduler,
                              store=ActivationStore() if args.store_residuals else None)
    summary: dict[str, Any] = {
        "model": model.spec.name, "td": td.td.values.tolist(),
        "best_layer": td.attrs["best_layer"], "td_accuracy_r2": td.attrs["td_accuracy_r2"],
        "icl_accuracy": dict(zip(td.task.values.tolist(), td.icl_accuracy.values.tolist())),
    }
    if args.function_vectors:
        fv = fv_scores(model, tasks, n_prompts=min(args.n_prompts, 8), n_shots=5, seed=args.seed)
        acc = tv.function_vector_accuracy(model, tasks, fv.fv_score.values, layer=args.layer,
                                          top_fraction=args.top_fraction, seed=args.seed)
        summary["fv_layer"] = acc.attrs["layer"]
        summary["fv_heads"] = acc.attrs["heads"]
        summary["zero_shot_accuracy"] = dict(zip(tasks, acc.zero_shot_accuracy.values.tolist()))
        summary["fv_accuracy"] = dict(zip(tasks, acc.fv_accuracy.values.tolist()))
    if args.patching:
        from explorer.analyses.task_vector_patching import task_vector_patching

        layers = (parse_layer_list(args.patching_layers, model.spec.n_layers,
                                   "--patching-layers")
                  if args.patching_layers.strip() else None)
        tvp = task_vector_patching(model, tasks, layers=layers, n_prompts=args.n_prompts,
                                   n_shots=args.n_shots, target_shots=args.target_shots,
                                   mode=args.mode, seed=args.seed)
        summary["patching"] = {
            "layers": tvp.layer.values.tolist(), "target_shots": args.target_shots,
            "mode": args.mode, "n_prompts": args.n_prompts,
            "few_shot_accuracy": dict(zip(tasks, tvp.few_shot_accuracy.values.tolist())),
            **{var: {t: {v: tvp[var].sel(task=t, vector=v).values.tolist()
                         for v in tvp.vector.values.tolist()} for t in tasks}
               for var in ("accuracy", "accuracy_low", "accuracy_high")}}
    if args.json:
        print_json(summary)
        return 0
    print(f"TD per layer: {np.round(td.td.values, 3).tolist()}")
    print(f"best layer {summary['best_layer']}; TD-accuracy R^2 {summary['td_accuracy_r2']:.3f}")
    if args.patching:
        pt = summary["patching"]
        print(f"\n{pt['target_shots']}-shot accuracy with the vector written at each layer "
              f"({pt['mode']}; 95% Wilson interval over {pt['n_prompts']} prompts)")
        print("task".ljust(22) + "vector".ljust(8) + "".join(f"{x:>18d}" for x in pt["layers"]))
        for t in tasks:
            for v in ("task", "null", "none"):
                cells = [f"{a:.2f} [{lo:.2f},{hi:.2f}]" for a, lo, hi in zip(
                    pt["accuracy"][t][v], pt["accuracy_low"][t][v], pt["accuracy_high"][t][v])]
                print(t[:21].ljust(22) + v.ljust(8) + "".join(c.rjust(18) for c in cells))
    return 0
