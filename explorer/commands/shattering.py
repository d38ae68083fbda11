"""`explorer shattering train|edit|analyse` (flags, parsing and printing over
`explorer.analyses.shattering`): train the knowledge-graph model, make one counterfactual edit,
or sweep many edits and relate the shattering ratio to the accuracy drop.
"""
from __future__ import annotations

import argparse

from explorer._checks import InputError
from explorer.analyses import shattering as sh
from explorer.analyses._training import terminal_progress
from explorer.commands._common import add_command, print_summary


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    """Add ``explorer shattering train|edit|analyse``."""
    defaults = sh.DEFAULTS
    # A tiny model: one thread is fastest on a shared machine.
    p = add_command(
        subparsers, "shattering", _cmd_shattering, paper="shattering", threads=1, model=False,
        help="knowledge editing on a transformer trained on a cyclic knowledge graph",
        description="train: train the model on random walks of a synthetic cyclic knowledge graph "
                    "(Nishi et al., ICML 2025) and save it in the cache. edit: one counterfactual "
                    "edit and its shattering ratio R. analyse: many edits, R vs accuracy drop (r^2) "
                    "and R by counterfactual distance.")
    p.add_argument("action", choices=["train", "edit", "analyse"], help="train, edit or analyse")
    for name in ("seed", "steps", "n_entities", "n_orders", "d_model", "n_layers", "d_mlp", "batch_size"):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=defaults[name],
                       help=f"{name.replace('_', ' ')} (default: {defaults[name]})")
    p.add_argument("--method", choices=sorted(sh.EDIT_METHODS), default="rome",
                   help="edit method (default: rome)")
    p.add_argument("--layer", type=int, default=0,
                   help="block whose MLP is edited; memit: the last critical block (default: 0)")
    p.add_argument("--layers", default=None,
                   help="memit: comma-separated blocks to spread the edit over (default: 0..layer)")
    p.add_argument("--entity", type=int, default=0, help="edit: entity id (default: 0)")
    p.add_argument("--relation", default="A+1", help="edit: relation name, e.g. A+1, B-3 (default: A+1)")
    p.add_argument("--distance", type=int, default=2, help="edit: counterfactual distance (default: 2)")
    p.add_argument("--n-edits", type=int, default=80, help="analyse: number of edits (default: 80)")
    p.add_argument("--retrain", action="store_true", help="train again even if the model is stored")


def _cmd_shattering(args: argparse.Namespace) -> int:
    from explorer.store import ActivationStore

    params = {k: getattr(args, k) for k in ("seed", "steps", "n_entities", "n_orders", "d_model",
                                            "n_layers", "d_mlp", "batch_size")}
    layers = None
    if args.layers is not None:
        if args.method != "memit":
            raise InputError(f"`--layers` is for `--method memit` only; got --method {args.method}.")
        try:
            layers = [int(x) for x in args.layers.split(",") if x.strip()]
        except ValueError:
            raise InputError(f"`--layers` must be comma-separated block numbers, e.g. 0,1; got {args.layers!r}.") \
                from None
    store = ActivationStore()
    progress = None if args.json else terminal_progress("training")
    km = sh.knowledge_model(store=store, retrain=args.retrain or args.action == "train",
                            progress=progress, **params)
    if args.action == "train":
        acc = sh.fact_accuracy(km)["accuracy"]
        out = {"path": str(sh.knowledge_model_path(store, km.params)), "params": km.params,
               "train_seconds": km.train_seconds, "final_loss": km.history["loss"][-1],
               "accuracy": dict(zip(acc["split"].values.tolist(), map(float, acc.values)))}
    elif args.action == "edit":
        relation = km.graph.relation_index(args.relation)
        edit = sh.edit_fact(km, args.entity, relation, args.distance, method=args.method,
                            layer=args.layer, layers=layers)
        emb = sh.edit_embedding(km, edit, [0.0, 1.0])
        acc0 = sh.fact_accuracy(km, exclude=[(edit.entity, relation)])
        acc1 = sh.fact_accuracy(km, sh.edited_model(km, edit), exclude=[(edit.entity, relation)])
        out = {**sh.edit_attrs(km, edit), "R": float(emb["R"].values[-1]),
               "success": bool(acc1["prediction"].values[edit.entity, relation] == edit.new_object),
               "accuracy_before": dict(zip(acc0["split"].values.tolist(), map(float, acc0["accuracy"].values))),
               "accuracy_after": dict(zip(acc1["split"].values.tolist(), map(float, acc1["accuracy"].values)))}
    else:
        edits_progress = None if args.json else terminal_progress("edits", unit="edit")
        sweep = sh.stored_edit_sweep(km, store=store, progress=edits_progress,
                                     n_edits=args.n_edits, method=args.method, layer=args.layer,
                                     layers=layers)
        out = {**sh.sweep_summary(sweep), "train_seconds": km.train_seconds}
    print_summary(out, as_json=args.json)
    return 0
