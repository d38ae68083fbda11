"""`explorer circuits` (flags, parsing and printing over `explorer.analyses.circuits`) and the
``eap`` bench, which times EAP and EAP-IG against a plain forward and the Circuits page's
slider redraw (`explorer.commands.pages` loads its harness with ``importlib``).
"""
from __future__ import annotations

import statistics
from typing import Any

import numpy as np
import torch

from explorer._checks import check_choice, check_int
from explorer.analyses import circuits as ca
from explorer.analyses.circuit_tasks import CORRUPTIONS, TASK_NAMES
from explorer.benches._memory import PeakRSS
from explorer.commands._common import add_command, load_cli_model, parse_int_list, print_summary
from explorer.commands.pages import circuits_slider_redraw_times
from explorer.defaults import DEFAULT_MODEL


def register_cli(subparsers: Any) -> None:
    """Add ``explorer circuits``: edge scores, circuit and faithfulness for a task."""
    p = add_command(
        subparsers, "circuits", _cmd_circuits, paper="circuits",
        help="circuit discovery by EAP / EAP-IG edge scores, with faithfulness",
        description="Score every edge (input, heads, MLPs, logits) of the model on a task by "
                    "EAP or EAP-IG (Hanna et al. 2024; Wang et al. 2025), keep the top edges, and "
                    "measure the circuit-only model by patching every other edge to its "
                    "corrupted value.")
    p.add_argument("--task", default="add", choices=TASK_NAMES)
    p.add_argument("--n", type=int, default=32, help="prompt pairs generated (default 32)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--all-prompts", action="store_true",
                   help="keep prompts the model answers wrongly (default: only right ones)")
    p.add_argument("--method", default="eap-ig", choices=ca.METHODS)
    p.add_argument("--steps", type=int, default=5, help="EAP-IG interpolation steps (default 5)")
    p.add_argument("--metric", default="logit_diff", choices=ca.METRICS)
    p.add_argument("--corruption", default="operator", choices=CORRUPTIONS,
                   help="arithmetic tasks: the corrupted prompt flips the operator (default) or "
                        "changes the second operand")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--top-n", type=int, default=None,
                      help="circuit size in edges before pruning (default 5%% of the edges)")
    size.add_argument("--threshold", type=float, default=None,
                      help="circuit = edges with |score| >= this, before pruning (instead of "
                           "--top-n)")
    p.add_argument("--sizes", default=None,
                   help="comma-separated circuit sizes for the faithfulness curve")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--show", type=int, default=20, help="top edges listed (default 20)")


def _cmd_circuits(args: Any) -> int:
    model = load_cli_model(args)
    task = ca.make_task(args.task, args.n, seed=args.seed, corruption=args.corruption)
    n_generated = len(task)
    if not args.all_prompts:
        task = ca.filter_task(model, task, batch_size=args.batch_size)
    scores = ca.edge_scores(model, task, method=args.method, steps=args.steps, metric=args.metric,
                            batch_size=args.batch_size, progress=not args.json)
    n_total = scores.sizes["edge"]
    if args.threshold is not None:
        top_n = None
        in_circuit = ca.select_circuit(scores, threshold=args.threshold)
    else:
        top_n = max(1, round(0.05 * n_total)) if args.top_n is None else args.top_n
        in_circuit = ca.select_circuit(scores, top_n=top_n)
    sizes = (parse_int_list("--sizes", args.sizes) if args.sizes else
             sorted({0, *(int(round(f * n_total)) for f in (0.005, 0.01, 0.02, 0.05, 0.1, 0.2)), n_total}))
    if top_n is not None and top_n not in sizes:
        sizes = sorted({*sizes, top_n})
    curve = ca.faithfulness_curve(model, task, scores, sizes=sizes, metric=args.metric,
                                  batch_size=args.batch_size, progress=not args.json)
    if top_n is None:  # the threshold circuit, patched on its own
        own = ca.patch_edges_metric(model, task, scores, in_circuit, metric=args.metric,
                                    batch_size=args.batch_size)
        recovered, accuracy = own["recovered"], own["accuracy"]
    else:
        recovered = float(curve["recovered"].sel(n_edges=top_n))
        accuracy = float(curve["accuracy"].sel(n_edges=top_n))
    order = np.argsort(-np.abs(scores["score"].values))[:check_int("show", args.show, low=0)]
    summary = {
        "model": model.spec.name, "task": args.task, "n_generated": n_generated,
        "n_prompts": len(task), "method": args.method, "steps": args.steps, "metric": args.metric,
        "n_edges_total": int(n_total),
        "clean_metric": curve.attrs["clean_metric"], "corrupt_metric": curve.attrs["corrupt_metric"],
        "clean_accuracy": curve.attrs["clean_accuracy"],
        "corrupt_accuracy": curve.attrs["corrupt_accuracy"],
        "corruption": args.corruption,
        "circuit": {"top_n": top_n, "threshold": args.threshold,
                    "n_chosen": int(in_circuit.attrs["n_chosen"]), "n_edges": int(in_circuit.sum()),
                    "nodes": sorted(ca.circuit_nodes(scores, in_circuit), key=lambda n: (
                        ca.node_layer(n, model.n_layers), n)),
                    "recovered": recovered, "accuracy": accuracy},
        "top_edges": [{"src": str(scores["src"].values[i]), "dst": str(scores["dst"].values[i]),
                       "score": float(scores["score"].values[i])} for i in order],
        "faithfulness": [{"n_edges": int(s), "n_kept": int(curve["n_kept"].sel(n_edges=s)),
                          "metric": float(curve["metric"].sel(n_edges=s)),
                          "recovered": float(curve["recovered"].sel(n_edges=s)),
                          "accuracy": float(curve["accuracy"].sel(n_edges=s))} for s in sizes],
    }
    print_summary(summary, as_json=args.json)
    return 0


# -- bench --------------------------------------------------------------------------------------

def bench_eap(model: Any = None, task: str = "add", n_prompts: int = 16, steps: int = 5,
              repeats: int = 3, redraw: bool = True) -> dict[str, Any]:
    """EAP and EAP-IG over all edges versus one plain forward of the same batch, in one run.

    One batch of ``n_prompts`` clean/corrupted pairs. ``eap_vs_forward_ratio``: EAP scores
    of every edge (corrupted forward, clean forward + backward, score contraction) over one
    plain Hugging Face forward of the clean prompts; ``eap_ig_vs_forward_ratio`` the same for
    EAP-IG(``steps``); ``patch_one_edge_vs_forward_ratio``: scoring one edge by activation
    patching (one edge-patched forward, corrupted run cached). Peak memory is the resident
    set above its level before each stage. With ``redraw``, ``slider_redraw_ms`` /
    ``slider_redraw_cpu_ms``: median wall / CPU time (the serving thread) of a slider move on
    the Circuits page attached to a Bokeh Document, drawing this run's EAP scores
    (`apps._page_benches.slider_redraw_times`; target < 100 ms, no re-trace). Shaped for `explorer.bench`
    (``explorer bench eap``).
    """
    from explorer.benches.timing import interleaved_times
    from explorer.models import load_model

    check_choice("task", task, TASK_NAMES)
    n_prompts = check_int("n_prompts", n_prompts, low=1)
    steps = check_int("steps", steps, low=1, high=100)
    repeats = check_int("repeats", repeats, low=1)
    if model is None or isinstance(model, str):
        model = load_model(model or DEFAULT_MODEL)
    ad = ca.circuit_engine(model)
    t = ca.make_task(task, n_prompts)
    prep = ca.prepare_pairs(model, t, list(range(n_prompts)))
    with torch.no_grad():
        corrupt = ca.graph_forward(ad, prep.corrupt)
    valid = torch.from_numpy(ca.valid_edge_mask(ad.n_layers, ad.n_heads)).float()
    keep_one = valid.clone()
    keep_one[0, -1] = 0.0  # the input -> logits edge patched, all others clean

    def forward():
        with torch.no_grad():
            model.hf(**prep.clean.model_inputs())

    def eap():
        ca.edge_scores(model, t, method="eap", batch_size=n_prompts)

    def eap_ig():
        ca.edge_scores(model, t, method="eap-ig", steps=steps, batch_size=n_prompts)

    def patch_one():
        with torch.no_grad():
            ca.graph_forward(ad, prep.clean, patch=(corrupt, keep_one))

    fns = {"forward": forward, "eap": eap, "eap_ig": eap_ig, "patch_one": patch_one}
    wall, cpu = interleaved_times(fns, repeats=repeats, warmup=1)
    peaks = {}
    for name, fn in fns.items():
        with PeakRSS(interval=0.002) as peak:
            fn()
        peaks[name] = peak.delta_mb

    def ratio(name):
        return statistics.median(a / b for a, b in zip(cpu[name], cpu["forward"]))

    n_edges = int(valid.sum())
    page = {}
    if redraw:
        page = circuits_slider_redraw_times(model, t, ca.edge_scores(model, t, method="eap",
                                                             batch_size=n_prompts))
    return {
        "params": {"model": model.spec.name, "task": task, "n_prompts": n_prompts,
                   "n_pos": prep.clean.width, "steps": steps, "repeats": repeats,
                   "n_edges": n_edges, "threads": torch.get_num_threads()},
        "figures": {
            "forward_ms": statistics.median(cpu["forward"]) * 1e3,
            "eap_ms": statistics.median(cpu["eap"]) * 1e3,
            "eap_ig_ms": statistics.median(cpu["eap_ig"]) * 1e3,
            "patch_one_edge_ms": statistics.median(cpu["patch_one"]) * 1e3,
            "eap_vs_forward_ratio": ratio("eap"),
            "eap_ig_vs_forward_ratio": ratio("eap_ig"),
            "patch_one_edge_vs_forward_ratio": ratio("patch_one"),
            "patch_all_edges_vs_eap_ratio": n_edges * statistics.median(cpu["patch_one"])
            / statistics.median(cpu["eap"]),
            "forward_peak_mb": peaks["forward"],
            "eap_peak_mb": peaks["eap"],
            "eap_ig_peak_mb": peaks["eap_ig"],
            "patch_one_edge_peak_mb": peaks["patch_one"],
            **{k: v for k, v in page.items() if k != "slider_moves"},
        },
        "notes": {"ratios": "median over interleaved rounds of process CPU time / plain forward CPU "
                            "time on the same batch (target: EAP <= 4, EAP-IG(5) <= 15)",
                  "patch_all_edges_vs_eap_ratio": "n_edges patched forwards (corrupted run cached) "
                                                  "over one EAP run",
                  "peak": "resident set growth during one call, sampled every 2 ms",
                  **({"slider_redraw": f"median over {page['slider_moves']} slider moves on the "
                                       "Circuits page attached to a Bokeh Document (EAP scores "
                                       "of this batch, every edge of the graph), from the "
                                       "widget's value change to the last pane updated; CPU "
                                       "time of the serving thread (target < 100 ms)"}
                     if page else {})},
    }
