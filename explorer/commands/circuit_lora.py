"""`explorer circuit-lora` and `explorer circuit-lora-ranks` (flags, parsing and printing over
`explorer.analyses.circuit_lora`): the fine-tuning-circuits study with CircuitLoRA vs uniform
LoRA, and the per-layer rank allocation at a uniform LoRA's parameter count.
"""
from __future__ import annotations

import sys
from typing import Any

from explorer._checks import check_int
from explorer.analyses import circuit_lora as cl
from explorer.commands._common import add_command, load_cli_model, parse_int_list, print_summary


def register_cli(subparsers: Any) -> None:
    """Add ``explorer circuit-lora`` (the whole study) and ``explorer circuit-lora-ranks``."""
    r = add_command(
        subparsers, "circuit-lora-ranks", _cmd_ranks, json_help="print the allocation as JSON",
        help="CircuitLoRA ranks at a uniform LoRA's parameter count",
        description="Per-layer LoRA ranks: r_other outside the critical layers, the rest of "
                    "a uniform LoRA's trainable-parameter count on the critical layers.")
    r.add_argument("--critical", required=True, help="comma-separated critical layers")
    r.add_argument("--rank", type=int, default=4, help="uniform LoRA rank to match (default 4)")
    r.add_argument("--r-other", type=int, default=2, help="rank outside critical layers")
    run = add_command(
        subparsers, "circuit-lora", _cmd_run,
        help="fine-tuning circuits and CircuitLoRA vs LoRA (Wang et al., ICML 2025)",
        description="A cheap LoRA run with adapter checkpoints, the circuit of each checkpoint "
                    "(node / edge Jaccard, per-layer edge change, critical layers), then "
                    "CircuitLoRA vs uniform LoRA at the same trainable-parameter count.")
    run.add_argument("--task", default="add", help="arithmetic task of make_task (default add)")
    run.add_argument("--n-train", type=int, default=256)
    run.add_argument("--n-test", type=int, default=100)
    run.add_argument("--n-circuit", type=int, default=16, help="problems scored per circuit")
    run.add_argument("--steps", type=int, default=20, help="training steps per run")
    run.add_argument("--batch-size", type=int, default=8)
    run.add_argument("--lr", type=float, default=1e-3)
    run.add_argument("--probe-rank", type=int, default=2, help="rank of the cheap LoRA run")
    run.add_argument("--rank", type=int, default=4, help="uniform LoRA rank")
    run.add_argument("--r-other", type=int, default=2)
    run.add_argument("--k", type=int, default=5, help="critical layers")
    run.add_argument("--top-percent", type=float, default=5.0,
                     help="circuit = top %% of edges by |score| (default 5)")
    run.add_argument("--method", default="eap-ig", choices=("eap", "eap-ig"),
                     help="edge attribution of the checkpoint circuits: eap-ig on the KL "
                          "divergence (the paper's, default) or eap on the logit difference")
    run.add_argument("--seeds", default="0,1,2")
    run.add_argument("--checkpoints", type=int, default=3, help="checkpoints after step 0")
    run.add_argument("--folder", default=None, help="run folder (default under the cache)")


def _cmd_ranks(args: Any) -> int:
    model = load_cli_model(args)
    critical = parse_int_list("--critical", args.critical)
    target = cl.lora_parameter_count(model, cl.uniform_lora_ranks(model, args.rank))
    alloc = cl.allocate_lora_ranks(model, target, critical, r_other=args.r_other)
    summary = {"model": model.spec.name, "uniform_rank": args.rank,
               "uniform_params": target, "n_params": alloc.attrs["n_params"],
               "n_params_gap": alloc.attrs["n_params_gap"], "critical": critical,
               "ranks": [int(x) for x in alloc["rank"].values]}
    print_summary(summary, as_json=args.json)
    return 0


def _cmd_run(args: Any) -> int:
    model = load_cli_model(args)
    summary = cl.run_summary(
        model, task=args.task, n_train=check_int("n_train", args.n_train, low=1),
        n_test=check_int("n_test", args.n_test, low=1), n_circuit=args.n_circuit,
        steps=args.steps, batch_size=args.batch_size, lr=args.lr, probe_rank=args.probe_rank,
        rank=args.rank, r_other=args.r_other, k=args.k, top_percent=args.top_percent,
        method=args.method, seeds=parse_int_list("--seeds", args.seeds),
        n_checkpoints=args.checkpoints, folder=args.folder,
        log=lambda s: print(s, file=sys.stderr))
    print_summary(summary, as_json=args.json)
    return 0
