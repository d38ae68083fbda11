"""Evidence for docs/saturation.md: the saturation analysis of SmolLM2 over the shipped corpus.

Runs `explorer.analyses.saturation.saturation_analysis` on the packaged SmolLM2-135M and on
a random-init model of the same architecture, over the whole shipped corpus (about 21k
tokens), with every result cached in the activation store (a second run is served from
it), then writes the headline numbers to ``docs/figures/saturation_summary.json`` and,
with ``--figures``, renders the view's plots to ``docs/figures/saturation_*.png``.

The lens pass (the costly part: a trace and a 30-layer logit lens per token) runs in
parts of ``--part-texts`` texts, each stored as it finishes; a run starts no new part
after ``--budget-s`` seconds and says how many parts are cached, so on a busy machine the
corpus is filled over several runs of under ~10 minutes each. Once all parts are cached
the analysis (order test, probe, early exit, intervention) runs and is stored too.

Usage::

    python benchmarks/saturation_evidence.py --weights trained   # repeat until "complete"
    python benchmarks/saturation_evidence.py --weights random
    python benchmarks/saturation_evidence.py --figures            # from the cache
    python benchmarks/saturation_evidence.py --resummarise        # from the cache

``--unembed-dtype bfloat16`` (the default here) screens the vocabulary in bfloat16 and
recomputes the top candidates in float32 (`explorer.lens.lens_readout`); a float32 run
with ``--check-unembed`` compares its ranks and saturation layers with the bfloat16 parts
of the same texts found in the store, and records the agreement. ``--cached-parts-only``
analyses just the texts whose lens parts are cached (for a corpus not yet complete).

Recorded runs (docs/saturation.md): trained, ``--unembed-dtype float32 --check-unembed``
(the float32 lens pass was in the store); random init, ``--weights random --part-texts 8``
rerun until complete, with ``--from-end --lens-only`` in a second process.

``--resummarise`` reads the stored whole-corpus results (it refuses to recompute) and adds
each early-exit rule's speed-up at fixed accuracy targets (`explorer.analyses.saturation.
speedup_at_accuracy`: 0.8, 0.9, 0.95, 0.99 of the full model's token, and the same
fractions of the full model's true-next-token accuracy) to the summary JSON, under
``early_exit.at_accuracy``.

``--threads 1`` (the default) is much faster than torch's default on a busy machine:
its parallel regions spin while other processes hold the cores.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from explorer.defaults import DEFAULT_MODEL

ROOT = Path(__file__).resolve().parents[1]
FIGURES = ROOT / "docs" / "figures"
SUMMARY = FIGURES / "saturation_summary.json"


def _model(weights: str, seed: int):
    from explorer import load_model
    from explorer.analyses import saturation as sat

    model = load_model(DEFAULT_MODEL)
    return sat.random_init_twin(model, seed=seed) if weights == "random" else model


def analyse(weights: str, *, max_tokens: int | None, seed: int, part_texts: int,
            budget_s: float, unembed_dtype: str, check_unembed: bool,
            from_end: bool = False, lens_only: bool = False) -> dict:
    """Fill the store part by part; once complete, run (or read) the analysis; its summary."""
    from explorer import ActivationStore
    from explorer.analyses import saturation as sat

    store = ActivationStore()
    model = _model(weights, seed)
    texts = sat.corpus_chunks(model, sat.load_corpus(), max_tokens=max_tokens)
    t0 = time.perf_counter()
    status = sat.cache_saturation_parts(model, texts, store=store, part_texts=part_texts,
                                        seed=seed, unembed_dtype=unembed_dtype,
                                        time_budget_s=budget_s, reverse=from_end,
                                        progress=True)
    lens_s = round(time.perf_counter() - t0, 1)
    if status["cached"] < status["parts"] or lens_only:
        return {"weights": weights, "complete": False, "lens_parts": status, "lens_seconds": lens_s}
    t1 = time.perf_counter()
    ds = sat.saturation_analysis(model, texts, seed=seed, unembed_dtype=unembed_dtype,
                                 part_texts=part_texts, store=store, progress=True)
    summary = sat.saturation_summary(ds)
    summary.update(model=model.spec.name, weights=weights, complete=True,
                   unembed_dtype=unembed_dtype, lens_parts=status, lens_seconds=lens_s,
                   analysis_seconds=round(time.perf_counter() - t1, 1),
                   settings={key: ds.attrs["params"][key] for key in (
                       "k", "max_ratio", "min_ranks", "n_permutations", "n_tasks",
                       "sample_positions", "n_pairs", "min_gap", "min_sat_layer", "window",
                       "rank_cap", "seed")})
    if check_unembed and unembed_dtype == "float32":
        summary["unembed_check"] = screened_parts_agreement(model, texts, ds, store,
                                                            part_texts=part_texts, seed=seed)
    return summary


def screened_parts_agreement(model, texts, ds, store, *, part_texts: int, seed: int) -> dict:
    """Agreement of this float32 lens pass with the bfloat16-screened parts in the store."""
    import numpy as np

    from explorer.analyses import saturation as sat

    params = sat._lens_params(model, k=int(ds.sizes["rank"]), rank_cap=50,
                              sample_positions=1000, seed=seed, unembed_dtype="bfloat16")
    lens = sat.saturation_layers(model, texts, seed=seed, store=store)   # the float32 pass
    sample = np.stack([lens.sample_prompt.values, lens.sample_pos.values], 1)
    eq_rank = eq_sat = n = 0
    diff = 0.0
    parts = []
    for a in range(0, len(texts), part_texts):
        b = min(a + part_texts, len(texts))
        part = store.get(store.key(sat._part_key_parts(model, texts, a, b, sample, params)))
        if part is None:
            continue
        parts.append([a, b])
        w = part.sizes["pos"]
        m = part.mask.values
        ref = lens.isel(prompt=slice(a, b), pos=slice(0, w))
        eq_rank += int(np.all(part.final_rank.values[m] == ref.final_rank.values[m], axis=(1, 2)).sum())
        eq_sat += int(np.all(part.sat_layer.values[m] == ref.sat_layer.values[m], axis=1).sum())
        diff = max(diff, float(np.nanmax(np.abs(part.top_prob.values[m] - ref.top_prob.values[m]))))
        n += int(m.sum())
    if not n:
        return {"compared": False, "note": "no bfloat16-screened parts of these texts in the store"}
    return {"compared": True, "screened_parts": parts, "positions": n,
            "final_rank_rows_equal": eq_rank / n, "sat_layer_equal": eq_sat / n,
            "top_prob_max_abs_diff": diff}


def unembed_agreement(model, texts, ds, store, *, seed: int) -> dict:
    """Agreement of this lens pass with a float32 one of the same texts from the store."""
    import numpy as np

    best = None
    for entry in store.ls():
        parts = entry.get("parts") or {}
        params = parts.get("params") or {}
        if (parts.get("method") == "saturation_layers" and "unembed_dtype" not in params
                and (parts.get("model") or {}).get("name") == model.spec.name
                and params.get("k") == int(ds.sizes["rank"]) and params.get("seed") == seed):
            shared = [i for i, t in enumerate(parts.get("texts") or []) if i < len(texts) and t == texts[i]]
            if shared and (best is None or len(shared) > len(best[1])):
                best = (entry["key"], shared)
    if best is None:
        return {"compared": False, "note": "no float32 lens pass of these texts in the store"}
    ref = store.get(best[0])
    rows = best[1]
    width = min(ref.sizes["pos"], ds.sizes["pos"])
    mask = ds.mask.values[rows, :width]
    a = ref.final_rank.values[rows, :width][mask]              # [n, layer, rank]
    b = ds.final_rank.values[rows, :width][mask]
    sa = ref.sat_layer.values[rows, :width][mask]
    sb = ds.sat_layer.values[rows, :width][mask]
    pa = ref.top_prob.values[rows, :width][mask]
    pb = ds.top_prob.values[rows, :width][mask]
    return {"compared": True, "positions": int(mask.sum()), "texts": len(rows),
            "final_rank_rows_equal": float(np.mean(np.all(a == b, axis=(1, 2)))),
            "sat_layer_equal": float(np.mean(np.all(sa == sb, axis=1))),
            "top_prob_max_abs_diff": float(np.nanmax(np.abs(pa - pb)))}


def analyse_cached_parts(weights: str, *, seed: int, part_texts: int, unembed_dtype: str) -> dict:
    """The analysis over only the texts whose lens parts are in the store (not stored).

    For a corpus whose lens pass is not complete yet: the cached parts are joined as they
    are (their probe samples are the whole-corpus sample's positions inside them) and run
    through the same analysis as `saturation_analysis`, with its default settings.
    """
    import numpy as np

    from explorer import ActivationStore
    from explorer.analyses import saturation as sat

    store = ActivationStore()
    model = _model(weights, seed)
    texts = sat.corpus_chunks(model, sat.load_corpus())
    params = sat._lens_params(model, k=10, rank_cap=50, sample_positions=1000, seed=seed,
                              unembed_dtype=unembed_dtype)
    sample = sat._sample_positions(model.tokenize(texts).lengths, 1000, seed)
    have = [(a, min(a + part_texts, len(texts))) for a in range(0, len(texts), part_texts)]
    have = [(a, b) for a, b in have if store.get(store.key(
        sat._part_key_parts(model, texts, a, b, sample, params)), verify=False) is not None]
    if not have:
        raise SystemExit(f"no cached lens parts for {weights}")
    sub = [t for a, b in have for t in texts[a:b]]
    new_index = {old: i for i, old in enumerate(i for a, b in have for i in range(a, b))}
    keep = np.isin(sample[:, 0], list(new_index))
    sub_sample = np.stack([[new_index[p] for p in sample[keep, 0]], sample[keep, 1]], 1)
    t0 = time.perf_counter()
    lens = sat._join_parts(model, sub, store, part_texts, sub_sample.astype(np.int64), params)
    n_layers = model.n_layers
    min_gap, min_sat_layer = sat.intervention_pair_defaults(n_layers, None, None)
    settings = dict(k=10, max_ratio=0.85, min_ranks=3, n_permutations=1000, n_tasks=4,
                    sample_positions=int(keep.sum()), probe_min_layer=0, n_pairs=8,
                    min_gap=min_gap, min_sat_layer=min_sat_layer,
                    window=max(1, round(5 * n_layers / 48)), rank_cap=50, seed=seed)
    ds = sat.saturation_from_lens(model, sub, lens, **settings)
    summary = sat.saturation_summary(ds)
    summary.update(model=model.spec.name, weights=weights, complete=False,
                   unembed_dtype=unembed_dtype, cached_parts=[list(x) for x in have],
                   parts_total=-(-len(texts) // part_texts), corpus_texts=len(texts),
                   analysis_seconds=round(time.perf_counter() - t0, 1), settings=settings)
    return summary


def _no_nan(value):
    """NaN (a target not reached) as JSON null."""
    if isinstance(value, float) and value != value:
        return None
    if isinstance(value, dict):
        return {k: _no_nan(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_no_nan(v) for v in value]
    return value


def resummarise(weights: str, *, seed: int, part_texts: int, unembed_dtype: str) -> dict:
    """Speed-ups at fixed accuracies from the stored whole-corpus result (never recomputed)."""
    from explorer import ActivationStore
    from explorer.analyses import saturation as sat
    from explorer.analyses.saturation import analysis

    def refuse(*args, **kwargs):
        raise SystemExit(f"no stored {weights} result with these settings: run the analysis first")

    model = _model(weights, seed)
    texts = sat.corpus_chunks(model, sat.load_corpus())
    real = analysis.saturation_from_lens, analysis.saturation_layers       # patched where they are called
    analysis.saturation_from_lens = analysis.saturation_layers = refuse
    try:
        ds = sat.saturation_analysis(model, texts, seed=seed, unembed_dtype=unembed_dtype,
                                     part_texts=part_texts, store=ActivationStore())
    finally:
        analysis.saturation_from_lens, analysis.saturation_layers = real
    return {against: _no_nan(sat.speedup_at_accuracy(ds, against=against))
            for against in ("full model", "true next token")}


def write_summary(weights: str, summary: dict) -> None:
    FIGURES.mkdir(parents=True, exist_ok=True)
    data = json.loads(SUMMARY.read_text()) if SUMMARY.exists() else {}
    data[weights] = summary
    SUMMARY.write_text(json.dumps(data, indent=1) + "\n")


def figures(*, max_tokens: int | None, seed: int, unembed_dtype: str,
            weights: tuple[str, ...]) -> None:
    """Render the view's plots to PNG files from the cached results."""
    from apps._page_benches import export_figures

    export_figures(FIGURES, max_tokens=max_tokens, random_tokens=max_tokens, seed=seed,
                   analysis_options={"unembed_dtype": unembed_dtype},
                   weights=["random-init" if w == "random" else w for w in weights])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--weights", choices=("trained", "random"), action="append",
                   help="which model(s) to analyse (repeatable; default both)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="use only the first N corpus tokens (default all)")
    p.add_argument("--part-texts", type=int, default=16,
                   help="texts per cached part of the lens pass (a multiple of 4)")
    p.add_argument("--budget-s", type=float, default=480,
                   help="start no new lens part after this many seconds (default 480)")
    p.add_argument("--unembed-dtype", choices=("float32", "bfloat16"), default="bfloat16")
    p.add_argument("--check-unembed", action="store_true",
                   help="compare with a float32 lens pass of the same texts in the store")
    p.add_argument("--from-end", action="store_true",
                   help="fill the lens parts from the last one (a second run in parallel)")
    p.add_argument("--lens-only", action="store_true", help="only fill the lens parts")
    p.add_argument("--cached-parts-only", action="store_true",
                   help="analyse only the texts whose lens parts are cached (not stored)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    p.add_argument("--figures", action="store_true", help="render the figures from the cache")
    p.add_argument("--resummarise", action="store_true",
                   help="add speed-ups at fixed accuracies to the summary, from the cache")
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    if args.figures:
        figures(max_tokens=args.max_tokens, seed=args.seed, unembed_dtype=args.unembed_dtype,
                weights=tuple(args.weights or ("trained", "random")))
        return 0
    if args.resummarise:
        # the recorded runs: trained float32 in parts of 16, random bfloat16 in parts of 8
        recorded = {"trained": ("float32", 16), "random": ("bfloat16", 8)}
        data = json.loads(SUMMARY.read_text())
        for weights in args.weights or ("trained", "random"):
            dtype, parts = recorded[weights]
            table = resummarise(weights, seed=args.seed, part_texts=parts, unembed_dtype=dtype)
            data[weights]["early_exit"]["at_accuracy"] = table
            print(weights, json.dumps(table, indent=1), flush=True)
        SUMMARY.write_text(json.dumps(data, indent=1) + "\n")
        return 0
    for weights in args.weights or ("trained", "random"):
        if args.cached_parts_only:
            summary = analyse_cached_parts(weights, seed=args.seed, part_texts=args.part_texts,
                                           unembed_dtype=args.unembed_dtype)
            write_summary(f"{weights}_cached_parts", summary)
            print(json.dumps(summary, indent=1), flush=True)
            continue
        summary = analyse(weights, max_tokens=args.max_tokens, seed=args.seed,
                          part_texts=args.part_texts, budget_s=args.budget_s,
                          unembed_dtype=args.unembed_dtype, check_unembed=args.check_unembed,
                          from_end=args.from_end, lens_only=args.lens_only)
        parts = summary["lens_parts"]
        if summary.get("complete"):
            write_summary(weights, summary)
        elif parts["cached"] == parts["parts"]:
            print(f"{weights}: all {parts['parts']} lens parts cached.", flush=True)
        else:
            print(f"{weights}: {summary['lens_parts']['cached']} of "
                  f"{summary['lens_parts']['parts']} lens parts cached; run again to continue.",
                  flush=True)
        print(json.dumps(summary, indent=1), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
