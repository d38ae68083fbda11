"""Faithfulness of top-n-pruned vs greedy circuits by size, with bootstrap intervals.

For each task and scoring method: edge scores (`circuits.edge_scores`), then for each
selection rule (`circuit_select.SELECTION_RULES`: top-n edges pruned to input -> logits
paths, or the greedy construction from the logits of Hanna et al. 2024) the recovered
fraction of the logit difference at log-spaced sizes, patched pair by pair so that the
95 % interval comes from a bootstrap over prompt pairs. Writes a JSON file and a markdown
table (the one in docs/circuits.md).

    .venv/bin/python scripts/circuit_sizes.py --tasks add ioi --methods eap eap-ig \\
        --pairs 8 --out /tmp/circuit_sizes

Slow on CPU (SmolLM2: a few seconds per pair and circuit); results are written after each
(task, method, rule), so a stopped run keeps what it measured.

``--split-qkv`` scores the q/k/v-split graph of Hanna et al. 2024's code (each head's query,
key and value inputs separate destinations: 123,211 edges on SmolLM2, against 44,371);
``--sizes`` replaces the log-spaced grid with given sizes (those above the graph's edge
count are dropped).
"""
from __future__ import annotations

import argparse
import json
import pickle
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from explorer.defaults import DEFAULT_MODEL  # noqa: E402
from explorer import load_model  # noqa: E402
from explorer.analyses import circuit_select as cs  # noqa: E402
from explorer.analyses import circuits as ca  # noqa: E402


def rule_overlap(scores, sizes: list[int]) -> list[float | None]:
    """Jaccard overlap of the top-n and greedy circuits (pruned) at each size (None when both
    are empty)."""
    out = []
    for n in sizes:
        a = cs.circuit_by_rule(scores, n, "top-n").values
        b = cs.circuit_by_rule(scores, n, "greedy").values
        union = int((a | b).sum())
        out.append(None if union == 0 else float((a & b).sum()) / union)
    return out


def _markdown(rows: list[dict]) -> str:
    """One table per (task, method): a row per size, the rules side by side."""
    def cell(p: dict) -> str:
        if p["n_kept"] == 0:
            return "0 | -"
        return f"{p['n_kept']} | {p['recovered']:.2f} [{p['low']:.2f}, {p['high']:.2f}]"

    out = []
    keys = list(dict.fromkeys((r["task"], r["method"]) for r in rows))
    for task, method in keys:
        by_rule = {r["rule"]: r for r in rows if (r["task"], r["method"]) == (task, method)}
        rules = [r for r in ("top-n", "greedy") if r in by_rule]
        first = by_rule[rules[0]]
        graph = (f"q/k/v-split graph, {first['n_edges_total']:,} edges" if first.get("split_qkv")
                 else f"combined head inputs, {first['n_edges_total']:,} edges")
        out.append(f"**{task}, {method}, {graph}** ({first['n_pairs']} pairs, clean / corrupted logit "
                   f"diff {first['clean_metric']:.2f} / {first['corrupt_metric']:.2f}, clean "
                   f"accuracy {first['clean_accuracy']:.2f})\n")
        head = "| n | " + " | ".join(f"{r} kept | {r} recovered [95 % CI]" for r in rules)
        out.append(head + " | Jaccard |")
        out.append("|---:|" + "---:|---|" * len(rules) + "---:|")
        for i, p in enumerate(first["points"]):
            jac = first.get("jaccard_top_n_greedy", [None] * len(first["points"]))[i]
            cells = " | ".join(cell(by_rule[r]["points"][i]) for r in rules)
            out.append(f"| {p['n_edges']} | {cells} | "
                       f"{'-' if jac is None else f'{jac:.2f}'} |")
        out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--tasks", nargs="+", default=["add", "ioi"], choices=ca.TASK_NAMES)
    ap.add_argument("--methods", nargs="+", default=["eap", "eap-ig"], choices=ca.METHODS)
    ap.add_argument("--rules", nargs="+", default=list(cs.SELECTION_RULES),
                    choices=cs.SELECTION_RULES)
    ap.add_argument("--pairs", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--min-size", type=int, default=10)
    ap.add_argument("--max-size", type=int, default=1000)
    ap.add_argument("--points", type=int, default=13, help="log-spaced sizes")
    ap.add_argument("--n-boot", type=int, default=2000)
    ap.add_argument("--sizes", type=int, nargs="+", default=None,
                    help="circuit sizes (chosen edges) instead of the log-spaced grid")
    ap.add_argument("--split-qkv", action="store_true",
                    help="the q/k/v-split graph (separate query, key, value inputs per head)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="/tmp/circuit_sizes", help="folder for JSON + markdown")
    ap.add_argument("--scores-cache", default=None,
                    help="folder to keep edge scores in and read them back from (a rerun "
                         "with other sizes skips the scoring)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = load_model(args.model)
    rows: list[dict] = []
    sizes: list[int] = []
    for task_name in args.tasks:
        task = ca.make_task(task_name, args.pairs, seed=args.seed)
        for method in args.methods:
            t0 = time.time()
            cached = None if args.scores_cache is None else Path(args.scores_cache) / (
                f"{args.model}_{task_name}_{method}_{args.pairs}_{args.seed}"
                f"{'_qkv' if args.split_qkv else ''}.pkl")
            if cached is not None and cached.exists():
                scores = pickle.loads(cached.read_bytes())
            else:
                scores = ca.edge_scores(model, task, method=method, batch_size=args.pairs,
                                        split_qkv=args.split_qkv)
                if cached is not None:
                    cached.parent.mkdir(parents=True, exist_ok=True)
                    cached.write_bytes(pickle.dumps(scores))
            t_scores = time.time() - t0
            n_total = int(scores.sizes["edge"])
            if args.sizes:
                sizes = sorted({s for s in args.sizes if 0 <= s <= n_total})
            else:
                sizes = cs.default_sizes(n_total, args.max_size, low=args.min_size,
                                         n_points=args.points)
            overlap = rule_overlap(scores, sizes)
            for rule in args.rules:
                t0 = time.time()
                curve = cs.rule_faithfulness_curve(model, task, scores, sizes=sizes, rule=rule,
                                                   per_pair=True, batch_size=args.pairs)
                curve = cs.bootstrap_recovered(curve, n_boot=args.n_boot, seed=args.seed)
                row = {"task": task_name, "method": method, "rule": rule,
                       "split_qkv": bool(args.split_qkv),
                       "n_pairs": len(task), "n_edges_total": n_total,
                       "clean_metric": curve.attrs["clean_metric"],
                       "corrupt_metric": curve.attrs["corrupt_metric"],
                       "clean_accuracy": curve.attrs["clean_accuracy"],
                       "seconds_scores": round(t_scores, 1),
                       "seconds_curve": round(time.time() - t0, 1),
                       "jaccard_top_n_greedy": overlap,
                       "points": [{"n_edges": int(n), "n_kept": int(k), "recovered": float(r),
                                   "low": float(lo), "high": float(hi), "accuracy": float(a)}
                                  for n, k, r, lo, hi, a in zip(
                                      curve["n_edges"].values, curve["n_kept"].values,
                                      curve["recovered"].values, curve["recovered_low"].values,
                                      curve["recovered_high"].values, curve["accuracy"].values)]}
                rows.append(row)
                print(f"{task_name} {method} {rule}: " + ", ".join(
                    f"{p['n_edges']}->{p['n_kept']}:{p['recovered']:.2f}" for p in row["points"])
                    + f"  ({row['seconds_curve']} s)", flush=True)
                (out / "circuit_sizes.json").write_text(json.dumps(
                    {"model": args.model, "seed": args.seed, "sizes": sizes,
                     "split_qkv": bool(args.split_qkv), "rows": rows},
                    indent=1))
                (out / "circuit_sizes.md").write_text(_markdown(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
