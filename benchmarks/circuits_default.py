"""The Circuits page's default circuit on SmolLM2-135M, per task and attribution method.

For each task and method: the edge scores, the faithfulness curve the page measures
(`circuit_select.measured_default_curve`: 12 log-spaced top-n sizes, then two bisection
steps toward the smallest circuit reaching the target), the default it picks
(`smallest_faithful_circuit`, no size cap) with its bootstrap interval over the pairs, the
influence-pruned subset the page draws (`circuit_influence.influence_pruning`; "drawn
nodes" are the nodes its edges join, while the page draws and labels every node of the
circuit), and the page's node default (`circuit_select.measured_node_curve`: the top-k nodes
by |node score|, every other node's output patched to its corrupted value, at log-spaced
counts then two bisection steps; `smallest_faithful_nodes` picks the smallest reaching the
target, "nodes for 80 %", with its bootstrap interval). Times are wall and process CPU
seconds of this run, with the load average beside them. One command, from the repository
root:

    PYTHONPATH=$PWD .venv/bin/python benchmarks/circuits_default.py --out /tmp/circuits_default.json

``--tasks ioi --methods eap --no-nodes`` times only the page's default for ioi, EAP.
"""
from __future__ import annotations

import argparse
import json
import os
import time

from explorer.defaults import DEFAULT_MODEL


def one(model, task_name: str, method: str, n_pairs: int, fraction: float, nodes: bool
        ) -> dict:
    import torch

    from explorer.analyses import circuit_influence as ci
    from explorer.analyses import circuit_select as cs
    from explorer.analyses import circuits as ca

    task = ca.make_task(task_name, n_pairs, seed=0)
    w0, c0 = time.perf_counter(), time.process_time()
    with torch.enable_grad():
        scores = ca.edge_scores(model, task, method=method, batch_size=n_pairs)
    w1, c1 = time.perf_counter(), time.process_time()
    curve = cs.measured_default_curve(model, task, scores, fraction=fraction,
                                      batch_size=n_pairs)
    choice = cs.smallest_faithful_circuit(curve, fraction)
    w2, c2 = time.perf_counter(), time.process_time()
    boot = cs.bootstrap_recovered(curve).sel(n_edges=choice.n_edges)
    mask = ca.select_circuit(scores, top_n=choice.n_edges).values
    pruned = ci.influence_pruning(scores, mask)
    drawn_nodes = {n for s, d, k in zip(scores["src"].values, scores["dst"].values,
                                        pruned["drawn"].values) if k for n in (str(s), str(d))}
    out = {"task": task_name, "method": method, "n_pairs": n_pairs,
           "clean_metric": curve.attrs["clean_metric"],
           "corrupt_metric": curve.attrs["corrupt_metric"],
           "clean_accuracy": curve.attrs["clean_accuracy"],
           "n_edges_total": int(scores.sizes["edge"]),
           "curve": {int(n): [int(k), round(float(r), 4)] for n, k, r in zip(
               curve["n_edges"].values, curve["n_kept"].values, curve["recovered"].values)},
           "default_top_n": choice.n_edges, "default_edges": choice.n_kept,
           "default_nodes": len(ca.circuit_nodes(scores, mask)),
           "default_recovered": choice.recovered, "reached": choice.reached,
           "interval": [float(boot["recovered_low"]), float(boot["recovered_high"])],
           "drawn_edges": int(pruned.attrs["n_drawn"]), "drawn_nodes": len(drawn_nodes),
           "drawn_share": float(pruned.attrs["drawn_share"]),
           "scores_wall_s": w1 - w0, "scores_cpu_s": c1 - c0,
           "curve_wall_s": w2 - w1, "curve_cpu_s": c2 - c1,
           "default_wall_s": w2 - w0, "default_cpu_s": c2 - c0,
           "n_circuits_patched": int(curve.sizes["n_edges"]),
           "load_after": os.getloadavg()[0]}
    if nodes:   # the page's node default: its measured node curve, refined the same way
        w3, c3 = time.perf_counter(), time.process_time()
        nc = cs.measured_node_curve(model, task, scores, fraction=fraction, batch_size=n_pairs)
        nd = cs.smallest_faithful_nodes(nc, fraction)
        nboot = cs.bootstrap_recovered(nc).sel(n_nodes=nd.n_edges)
        out.update(node_curve={int(k): round(float(r), 4) for k, r in zip(
                       nc["n_nodes"].values, nc["recovered"].values)},
                   nodes_for_target=nd.n_edges if nd.reached else None,
                   node_default=nd.n_edges, node_default_recovered=nd.recovered,
                   node_reached=nd.reached,
                   node_interval=[float(nboot["recovered_low"]), float(nboot["recovered_high"])],
                   n_nodes_total=int(cs.node_scores(scores).sizes["node"]),
                   node_curve_wall_s=time.perf_counter() - w3,
                   node_curve_cpu_s=time.process_time() - c3)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tasks", nargs="+", default=["ioi", "greater-than", "add"])
    p.add_argument("--methods", nargs="+", default=["eap", "eap-ig"])
    p.add_argument("--pairs", type=int, default=8)
    p.add_argument("--fraction", type=float, default=0.8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-nodes", action="store_true", help="skip the node-level curves")
    p.add_argument("--out", default="circuits_default.json")
    args = p.parse_args()

    import torch

    import explorer

    torch.set_num_threads(args.threads)
    model = explorer.load_model(DEFAULT_MODEL)
    rows = []
    for task in args.tasks:
        for method in args.methods:
            r = one(model, task, method, args.pairs, args.fraction, not args.no_nodes)
            rows.append(r)
            print(f"{task:13s} {method:6s} default {r['default_edges']:6,} edges "
                  f"{r['default_nodes']:3} nodes recovering {r['default_recovered']:.2f} "
                  f"[{r['interval'][0]:.2f}, {r['interval'][1]:.2f}] "
                  f"({'reached' if r['reached'] else 'NOT reached'}); drawn "
                  f"{r['drawn_edges']} edges {r['drawn_nodes']} nodes "
                  f"({r['drawn_share']:.1%} of the influence); nodes for "
                  f"{args.fraction:.0%}: {r.get('nodes_for_target')} "
                  f"({r.get('node_default_recovered', float('nan')):.2f} "
                  f"[{', '.join(f'{v:.2f}' for v in r.get('node_interval', []))}], "
                  f"node curve {r.get('node_curve_wall_s', float('nan')):.0f} s wall); default in "
                  f"{r['default_wall_s']:.0f} s wall / {r['default_cpu_s']:.0f} s CPU, "
                  f"load {r['load_after']:.1f}", flush=True)
            with open(args.out, "w") as f:
                json.dump({"threads": args.threads, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
