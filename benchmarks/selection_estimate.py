"""The Knowledge conflicts page's time estimate for *Select heads as JuICE does* against the
selection itself, timed on the same machine one after the other; rerunnable.

Measures the selection's unit as the page does (`apps._conflicts_estimate.measure_selection_timing`
on the selection facts), says the range the page's button would show for the direction, then
runs `juice_head_selection` as the page runs it (K = 5, pruned, the paper's alpha grid) and
times it. Also gives the estimate with the share of heads this run actually scored per prompt
type (the count is then exact, and only the cost per run is estimated). Facts: the first
``--facts`` shipped country-capital facts the model knows closed-book (France, Germany, Italy,
Spain for SmolLM2, as `conflicts_evidence.py` selects them).

Writes ``docs/figures/conflicts_selection_estimate.json`` (one part per direction), with the
machine's load before and after: the time of a run moves with the load of a shared machine.

    .venv/bin/python benchmarks/selection_estimate.py --direction parametric
    .venv/bin/python benchmarks/selection_estimate.py --direction context --layers 0,10,20,29
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

import _figures  # benchmarks/_figures.py, beside this script

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SUMMARY = ROOT / "docs" / "figures" / "conflicts_selection_estimate.json"


def main(argv: list[str] | None = None) -> int:
    from apps._conflicts_estimate import (estimated_selection_seconds, measure_selection_timing,
                                          selection_seconds_range)
    from explorer import load_model
    from explorer.analyses import conflicts as C
    from explorer.defaults import DEFAULT_MODEL

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--direction", choices=list(C.DIRECTIONS), default="parametric")
    parser.add_argument("--facts", type=int, default=4, help="selection facts (the paper's 4)")
    parser.add_argument("--layers", default="",
                        help="comma-separated layers to score (default: every layer, as the page)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    args = parser.parse_args(argv)

    import torch
    torch.set_num_threads(args.threads)
    before = _figures.machine()
    model = load_model(args.model)
    kept = [f for f in C.closed_book_facts(model) if f.relation == "country_capital"]
    facts = kept[:args.facts]
    L, H = model.n_layers, model.spec.n_heads
    layers = [int(x) for x in args.layers.split(",")] if args.layers else list(range(L))
    _figures.log(f"{model.spec.name}: selection on {[f.subject for f in facts]}, "
                 f"{len(layers)} of {L} layers, toward {args.direction}")

    started = time.perf_counter()
    timing = measure_selection_timing(model, facts)
    measure_s = time.perf_counter() - started
    # the page's range scores every layer; a run on fewer layers scales its per-head part
    share = len(layers) / L
    low, high = selection_seconds_range(L, H, timing, args.direction)
    _figures.log(f"unit measured in {measure_s:.1f} s: the page says {low:.0f}-{high:.0f} s "
                 "for every layer")

    started = time.perf_counter()
    ds = C.juice_head_selection(model, facts, direction=args.direction, k=5, prune=True,
                                layers=layers)
    measured = time.perf_counter() - started
    scored = {k: int(np.isfinite(ds.delta_plus.values[i][layers]).sum())
              for i, k in enumerate(C.PROMPT_KINDS)}
    shares = {k: n / (len(layers) * H) for k, n in scored.items()}
    # the estimate for the layers scored: run 1 per type is paid once whatever the layers
    run1 = sum(timing.run_seconds(t / timing.n_alphas) for t in timing.tokens)
    with_shares = run1 + share * (estimated_selection_seconds(L, H, timing, shares) - run1)
    range_here = [run1 + share * (x - run1) for x in (low, high)]
    _figures.log(f"selection took {measured:.0f} s; estimate with its scored heads "
                 f"{with_shares:.0f} s, range {range_here[0]:.0f}-{range_here[1]:.0f} s")
    part = {"model": model.spec.name, "facts": [f.subject for f in facts],
            "layers": layers if args.layers else "all", "threads": args.threads,
            "timing": {"tokens": list(timing.tokens), "clean_s": timing.clean_seconds,
                       "coherent_s": timing.coherent_seconds, "measure_s": round(measure_s, 2)},
            "page_range_all_layers_s": [round(low, 1), round(high, 1)],
            "range_for_these_layers_s": [round(x, 1) for x in range_here],
            "scored_heads": scored, "estimate_with_scored_heads_s": round(with_shares, 1),
            "measured_s": round(measured, 1),
            "measured_over_estimate": round(measured / with_shares, 3),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "command": "python benchmarks/selection_estimate.py " + " ".join(argv or sys.argv[1:]),
            "machine_before": before}
    _figures.update_timed_summary(SUMMARY, args.direction, part)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
