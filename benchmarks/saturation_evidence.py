"""Evidence for docs/saturation.md: the saturation analysis of SmolLM2 over the shipped corpus.

Runs `explorer.analyses.saturation.saturation_analysis` on the packaged SmolLM2-135M and on
a random-init model of the same architecture, over the whole shipped corpus (about 21k
tokens), with every result cached in the activation store (a second run is served from
it), then writes the headline numbers to ``docs/figures/saturation_summary.json`` and,
with ``--figures``, renders the view's plots to ``docs/figures/saturation_*.png``.

Usage::

    python benchmarks/saturation_evidence.py --weights trained          # compute (about an hour
    python benchmarks/saturation_evidence.py --weights random           #   each on a busy 2-core CPU)
    python benchmarks/saturation_evidence.py --figures                   # from the cache

The random-init model is analysed over the first ``--random-tokens`` (4,000) tokens.

``--threads 1`` (the default) is much faster than torch's default on a busy machine:
its parallel regions spin while other processes hold the cores.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIGURES = ROOT / "docs" / "figures"
SUMMARY = FIGURES / "saturation_summary.json"


def analyse(weights: str, *, max_tokens: int | None, seed: int) -> dict:
    """Run (or read from the store) the analysis for one set of weights; its summary."""
    from explorer import ActivationStore, load_model
    from explorer.analyses import saturation as sat

    model = load_model("smollm2-135m")
    if weights == "random":
        model = sat.random_init_twin(model, seed=seed)
    texts = sat.corpus_chunks(model, sat.load_corpus(), max_tokens=max_tokens)
    t0 = time.perf_counter()
    ds = sat.saturation_analysis(model, texts, seed=seed, store=ActivationStore(), progress=True)
    summary = sat.saturation_summary(ds)
    summary.update(model=model.spec.name, weights=weights, seconds=round(time.perf_counter() - t0, 1))
    return summary


def write_summary(weights: str, summary: dict) -> None:
    FIGURES.mkdir(parents=True, exist_ok=True)
    data = json.loads(SUMMARY.read_text()) if SUMMARY.exists() else {}
    data[weights] = summary
    SUMMARY.write_text(json.dumps(data, indent=1) + "\n")


def figures(*, max_tokens: int | None, random_tokens: int | None, seed: int) -> None:
    """Render the view's plots (trained and random-init) to PNG files from the cached results."""
    from apps.saturation import export_figures

    export_figures(FIGURES, max_tokens=max_tokens, random_tokens=random_tokens, seed=seed)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--weights", choices=("trained", "random"), action="append",
                   help="which model(s) to analyse (repeatable; default both)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="trained model: use only the first N corpus tokens (default all)")
    p.add_argument("--random-tokens", type=int, default=4000,
                   help="random-init model: the first N corpus tokens (default 4000)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    p.add_argument("--figures", action="store_true", help="render the figures from the cache")
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    if args.figures:
        figures(max_tokens=args.max_tokens, random_tokens=args.random_tokens, seed=args.seed)
        return 0
    for weights in args.weights or ("trained", "random"):
        tokens = args.max_tokens if weights == "trained" else args.random_tokens
        summary = analyse(weights, max_tokens=tokens, seed=args.seed)
        write_summary(weights, summary)
        print(json.dumps(summary, indent=1), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
