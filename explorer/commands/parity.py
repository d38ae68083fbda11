"""`explorer parity train|analyse|phase` (flags, parsing and printing over
`explorer.analyses.parity`): train the streaming-parity RNN and store the run, analyse its
automaton over training, or compute the gain x max-length phase diagram.

It runs at one torch thread unless ``--threads N`` (the CLI's global flag) says otherwise:
the model is tiny, and one thread beats several (by 3-20x on a busy 2-core machine).
"""
from __future__ import annotations

import argparse

from explorer._checks import InputError
from explorer.analyses._training import terminal_progress
from explorer.analyses.parity import OPTIMIZERS, DEFAULTS, PHASE_GAINS, PHASE_MAX_LENGTHS
from explorer.analyses.parity import run_key_parts, analysis_summary, parity_run, phase_summary
from explorer.analyses.parity import stored_parity_analysis, stored_parity_phase_diagram
from explorer.commands._common import add_command, print_summary


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    """Add ``explorer parity train|analyse``."""
    # the model is tiny: one thread beats several (by 3-20x on a busy 2-core machine)
    p = add_command(
        subparsers, "parity", _cmd_parity, paper="parity", threads=1, model=False,
        help="streaming-parity RNN: train it, or analyse its automaton over training",
        description="train: train the parity RNN (van Rossem & Saxe, ICML 2025) and store the run "
                    "in the cache. analyse: automaton size and long-string accuracy per checkpoint "
                    "of the stored run (trained first if missing).")
    p.add_argument("action", choices=["train", "analyse", "phase"],
                   help="train, analyse, or phase (the gain x max-length phase diagram)")
    p.add_argument("--seed", type=int, default=DEFAULTS["seed"], help="seed (default: 0)")
    p.add_argument("--epochs", type=int, default=DEFAULTS["epochs"], help="epochs (default: 1000)")
    p.add_argument("--hidden-size", type=int, default=DEFAULTS["hidden_size"],
                   help="hidden units (default: 100)")
    p.add_argument("--gain", type=float, default=DEFAULTS["gain"],
                   help="initialisation gain (default: 0.1)")
    p.add_argument("--lr", type=float, default=DEFAULTS["lr"], help="learning rate (default: 0.02)")
    p.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default=DEFAULTS["optimizer"],
                   help="optimiser (default: sgd, plain SGD as in the paper)")
    p.add_argument("--checkpoint-every", type=int, default=None,
                   help="epochs between checkpoints (default: 10; phase: 25)")
    p.add_argument("--threshold", type=float, default=0.01,
                   help="analyse: merge distance as a fraction of the state spread (default: 0.01)")
    p.add_argument("--max-length", type=int, default=8,
                   help="analyse: longest string whose states are merged (default: 8)")
    p.add_argument("--n-strings", type=int, default=20,
                   help="analyse: random long strings per length (default: 20)")
    p.add_argument("--gains", default=",".join(map(str, PHASE_GAINS)),
                   help="phase: initialisation gains, comma-separated (default: %(default)s)")
    p.add_argument("--max-lengths", default=",".join(map(str, PHASE_MAX_LENGTHS)),
                   help="phase: longest training strings, comma-separated (default: %(default)s)")
    p.add_argument("--retrain", action="store_true", help="train again even if the run is stored")


def _cmd_parity(args: argparse.Namespace) -> int:
    from explorer.store import ActivationStore

    every = args.checkpoint_every
    params = {"seed": args.seed, "epochs": args.epochs, "hidden_size": args.hidden_size,
              "gain": args.gain, "lr": args.lr, "optimizer": args.optimizer,
              "checkpoint_every": DEFAULTS["checkpoint_every"] if every is None else every}
    store = ActivationStore()
    progress = None if args.json else terminal_progress("training")
    if args.action == "phase":
        gains = _float_list("--gains", args.gains)
        max_lengths = _float_list("--max-lengths", args.max_lengths)
        if any(m != int(m) for m in max_lengths):
            raise InputError(f"`--max-lengths` must be comma-separated ints; got {args.max_lengths!r}.")
        max_lengths = [int(m) for m in max_lengths]
        phase = stored_parity_phase_diagram(
            gains, max_lengths, store=store, recompute=args.retrain,
            progress=None if args.json else terminal_progress("phase diagram", unit="cell"),
            epochs=args.epochs, hidden_size=args.hidden_size, lr=args.lr,
            checkpoint_every=25 if every is None else every, seed=args.seed, threshold=args.threshold,
            n_strings=args.n_strings)
        out = phase_summary(phase)
    elif args.action == "train":
        run = parity_run(store=store, retrain=True, progress=progress, **params)
        final = run.isel(step=-1)
        out = {"key": store.key(run_key_parts({**DEFAULTS, **params})), "store": str(store.path),
               "params": run.attrs["params"], "seed": run.attrs["seed"],
               "train_seconds": run.attrs["train_seconds"], "n_checkpoints": int(run.sizes["step"]),
               "final_train_loss": float(final["train_loss"]),
               "final_train_accuracy": float(final["train_accuracy"])}
    else:
        run = parity_run(store=store, retrain=args.retrain, progress=progress, **params)
        analysis = stored_parity_analysis(run, store=store, max_length=args.max_length,
                                          threshold=args.threshold, n_strings=args.n_strings)
        out = analysis_summary(analysis)
    print_summary(out, as_json=args.json)
    return 0


def _float_list(flag: str, text: str) -> list[float]:
    """Comma-separated numbers; InputError naming ``flag`` otherwise."""
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise InputError(f"`{flag}` must be comma-separated numbers; got {text!r}.") from None
    if not values:
        raise InputError(f"`{flag}` must hold at least one number; got {text!r}.")
    return values
