"""`explorer saturation` (flags, parsing and printing over `explorer.analyses.saturation`) and
the ``saturation`` bench, which times the analysis against a plain forward and the page's
token-click latency (the page, `apps.saturation`, is loaded with ``importlib``).
"""
from __future__ import annotations

import importlib
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import xarray as xr

from explorer._checks import InputError, check_int
from explorer.analyses import saturation as sat
from explorer.benches._memory import PeakRSS
from explorer.commands._common import add_command, add_number_options, load_cli_model
from explorer.commands._common import print_summary
from explorer.commands.pages import saturation_click_latency
from explorer.defaults import DEFAULT_MODEL


def register_cli(subparsers: Any) -> None:
    """Add ``explorer saturation``: the analysis over the shipped corpus or a text file."""
    p = add_command(
        subparsers, "saturation", _cmd_saturation, paper="saturation",
        help="saturation layers of the top-k tokens, order test, probe, early exit",
        description="Saturation events (Lioubashevski et al., ICML 2025) over a corpus.")
    p.add_argument("--corpus", default=None, metavar="PATH",
                   help="folder of .txt documents or one text file (default: the shipped corpus)")
    p.add_argument("--max-tokens", type=int, default=None, metavar="N",
                   help="use only the first N tokens of the corpus")
    p.add_argument("--chunk-tokens", type=int, default=256, metavar="N")
    p.add_argument("--k", type=int, default=10, help="ranks tracked (default 10)")
    p.add_argument("--order-k", type=int, default=5, help="k of the reported order test")
    p.add_argument("--max-ratio", type=float, default=0.85,
                   help="keep positions with s_1 + 1 <= ratio * layers (default 0.85)")
    add_number_options(p, permutations=1000, sample_positions=1000)
    p.add_argument("--pairs", type=int, default=8, help="intervention pairs (0: skip)")
    p.add_argument("--min-gap", type=int, default=None, metavar="N",
                   help="pairs: s_1(late) - s_1(early) >= N (default round(10 L / 48))")
    p.add_argument("--min-sat-layer", type=int, default=None, metavar="N",
                   help="pairs: both tokens' s_1 >= N (default round(10 L / 48))")
    p.add_argument("--unembed-dtype", choices=("float32", "bfloat16"), default="float32",
                   help="lens unembedding: exact float32, or a bfloat16 screen refined in float32")
    p.add_argument("--part-texts", type=int, default=None, metavar="N",
                   help="cache the lens pass in parts of N texts (a multiple of 4)")
    p.add_argument("--scheduler", default=None, metavar="NAME",
                   help="compute saturation layers and tau out of core with dask over the "
                        "cached lens ranks: threads, synchronous, local (a LocalCluster) or "
                        "a scheduler address tcp://HOST:PORT (needs the cache)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--random-init", action="store_true",
                   help="analyse a random-init model of the same architecture instead")
    p.add_argument("--no-cache", action="store_true", help="do not read or write the store")


def _cmd_saturation(args: Any) -> int:
    from explorer.store import ActivationStore

    if args.scheduler is not None:
        from explorer.distributed import check_scheduler

        check_scheduler(args.scheduler)
        if args.no_cache:
            raise InputError("`--scheduler` works over the cache; drop `--no-cache`.")
    model = load_cli_model(args)
    if args.random_init:
        model = sat.random_init_twin(model, seed=args.seed)
    docs = sat.load_corpus(args.corpus)
    texts = sat.corpus_chunks(model, docs, chunk_tokens=args.chunk_tokens, max_tokens=args.max_tokens)
    store = None if args.no_cache else ActivationStore()
    t0 = time.perf_counter()
    ds = sat.saturation_analysis(model, texts, k=args.k, max_ratio=args.max_ratio,
                             n_permutations=args.permutations,
                             sample_positions=args.sample_positions, n_pairs=args.pairs,
                             min_gap=args.min_gap, min_sat_layer=args.min_sat_layer,
                             unembed_dtype=args.unembed_dtype, part_texts=args.part_texts,
                             seed=args.seed, scheduler=args.scheduler, store=store,
                             progress=not args.json)
    summary = sat.saturation_summary(ds, k=args.order_k)
    summary.update(model=model.spec.name, seconds=round(time.perf_counter() - t0, 2))
    print_summary(summary, as_json=args.json)
    return 0


def bench_saturation(model: Any = None, n_tokens: int = 2000, batch_size: int = 4,
                     k: int = 10, repeats: int = 1,
                     unembed_dtype: str = "float32", clicks: int = 30) -> dict[str, Any]:
    """Saturation layers of ``n_tokens`` corpus tokens vs a plain forward over them, and
    the page's token-click latency on that result.

    Both run over the same prompts in this process, alternating (`explorer.benches.timing.
    interleaved_times`, ``repeats`` rounds after a short warm-up forward); the analysis is
    `saturation_layers` (trace + lens in chunks of 256 rows + ranks), uncached. Then the
    order test runs on the last lens pass (100 permutations, no probe or intervention),
    the saturation page (`apps.saturation.SaturationView`) is given that result and
    attached to a Bokeh document, and ``clicks`` tokens of the first text are clicked at
    k = 5 and again at k = 10 (`apps._page_benches.click_latency`; 0 skips this). Shaped for
    `explorer.bench` (``explorer bench saturation --json``).

    Returns
    -------
    dict
        ``params`` (model, tokens, prompts, lens rows, batch size, k, unembed dtype);
        ``figures``: ``forward_ms``, ``analysis_ms`` (median wall times),
        ``analysis_vs_forward_ratio`` (median of per-round wall ratios),
        ``analysis_vs_forward_cpu_ratio`` (the same in process CPU time, steadier on a busy
        machine), ``lens_gemm_floor_ms`` (the bare unembedding products for the same lens
        rows, timed in the same rounds) and ``saturation_vs_floor_ratio``, and the peak resident memory above the start of each phase,
        ``forward_peak_mb`` and ``analysis_peak_mb``; the click latency over all clicks,
        ``click_ms`` (median wall), ``click_p90_ms``, ``click_max_ms``, ``click_cpu_ms``
        (median process CPU) and per k, ``click_k5_ms``, ``click_k10_ms``; ``notes``.
    """
    from explorer._checks import check_choice
    from explorer.benches.timing import interleaved_times
    from explorer.models import load_model

    n_tokens = check_int("n_tokens", n_tokens, low=8)
    batch_size = check_int("batch_size", batch_size, low=1)
    k = check_int("k", k, low=1, high=64)
    repeats = check_int("repeats", repeats, low=1)
    clicks = check_int("clicks", clicks, low=0)
    unembed_dtype = check_choice("unembed_dtype", unembed_dtype, ("float32", "bfloat16"))
    if model is None or isinstance(model, str):
        model = load_model(model or DEFAULT_MODEL)
    texts = sat.corpus_chunks(model, sat.load_corpus(), max_tokens=n_tokens)
    batch = model.tokenize(texts)

    def forward() -> None:
        with torch.no_grad():
            for b0 in range(0, len(texts), batch_size):
                sub = model.batch_from_ids(batch.token_ids[b0:b0 + batch_size])
                model.hf(**sub.model_inputs())

    last: dict[str, xr.Dataset] = {}

    def analysis() -> None:
        last["lens"] = sat.saturation_layers(model, texts, k=k, sample_positions=0,
                                         batch_size=batch_size, unembed_dtype=unembed_dtype,
                                         progress=False)

    # the floor: the bare unembedding products for the same lens rows, in the lens's
    # chunks of 256 rows, through the same kernel (no norm, no top-k, no trace)
    from explorer._kernels import unembed_product

    n_rows = int(sum(batch.lengths)) * model.n_layers
    weight = model.unembed_module.weight.detach().float()
    if unembed_dtype == "bfloat16":
        weight = weight.to(torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(256, weight.shape[1], generator=gen).to(weight.dtype)

    def floor() -> None:
        with torch.no_grad():
            for r0 in range(0, n_rows, 256):
                x = rows[: min(256, n_rows - r0)]
                if unembed_dtype == "bfloat16":
                    x @ weight.T
                else:
                    unembed_product(x, weight)

    peaks = {"forward": 0.0, "analysis": 0.0, "floor": 0.0}

    def measured(name: str, fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            with PeakRSS() as mem:
                fn()
            peaks[name] = max(peaks[name], mem.delta_mb)
        return run

    with torch.no_grad():                       # warm-up: one short forward (lazy inits)
        model.hf(**model.batch_from_ids(batch.token_ids[:1]).model_inputs())
    wall, cpu = interleaved_times({"forward": measured("forward", forward),
                                   "analysis": measured("analysis", analysis),
                                   "floor": measured("floor", floor)},
                                  repeats=repeats, warmup=0)
    ratio = [a / f for a, f in zip(wall["analysis"], wall["forward"])]
    cpu_ratio = [a / f for a, f in zip(cpu["analysis"], cpu["forward"])]
    floor_ratio = [a / f for a, f in zip(wall["analysis"], wall["floor"])]
    tokens = int(sum(batch.lengths))
    figures = {
        "forward_ms": round(float(np.median(wall["forward"])) * 1000, 1),
        "analysis_ms": round(float(np.median(wall["analysis"])) * 1000, 1),
        "analysis_vs_forward_ratio": round(float(np.median(ratio)), 3),
        "analysis_vs_forward_cpu_ratio": round(float(np.median(cpu_ratio)), 3),
        "lens_gemm_floor_ms": round(float(np.median(wall["floor"])) * 1000, 3),
        "saturation_vs_floor_ratio": round(float(np.median(floor_ratio)), 3),
        "forward_peak_mb": round(peaks["forward"], 1),
        "analysis_peak_mb": round(peaks["analysis"], 1),
    }
    notes = {"memory": "resident-set increase above the start of each phase, sampled "
                       "every 5 ms; the phases alternate in one process, so memory one "
                       "freed may be reused by the next",
             "floor": "the bare unembedding products for the same number of lens rows "
                      "(tokens x layers), 256 rows at a time, through the kernel the lens "
                      "uses; saturation_vs_floor_ratio is analysis / floor per round",
             "lens": "run in chunks of 256 rows by explorer.lens.lens_readout; only the "
                     "top rank_cap (50) tokens per row are kept"}
    if clicks:
        figures.update(_click_figures(model, texts, last["lens"].load(), k=k, clicks=clicks))
        notes["click"] = ("the page given this result and attached to a Bokeh document; "
                          "time from the token strip's `selected` change until the header "
                          "and the detail plots' data are updated in the document (sending "
                          "to a browser and drawing not included)")
    return {
        "params": {"model": model.spec.name, "n_tokens": tokens, "n_texts": len(texts),
                   "lens_rows": tokens * model.n_layers, "batch_size": batch_size, "k": k,
                   "repeats": repeats, "unembed_dtype": unembed_dtype, "clicks": clicks,
                   "torch_threads": torch.get_num_threads()},
        "figures": figures,
        "notes": notes,
    }


def _click_figures(model: Any, texts: list[str], lens: xr.Dataset, *, k: int,
                   clicks: int) -> dict[str, float]:
    """Token-click latency of the saturation page on a lens pass (see `bench_saturation`)."""
    page = importlib.import_module("apps.saturation")

    n_layers = model.n_layers
    min_gap, min_sat_layer = sat.intervention_pair_defaults(n_layers, None, None)
    ds = sat.saturation_from_lens(model, texts, lens, k=k, max_ratio=0.85, min_ranks=3, n_permutations=100,
                  n_tasks=4, sample_positions=0, probe_min_layer=0, n_pairs=0,
                  min_gap=min_gap, min_sat_layer=min_sat_layer,
                  window=max(1, round(5 * n_layers / 48)), rank_cap=50, seed=0)
    ds.attrs["model"] = model.spec.name
    view = page.SaturationView(model, store=None, background=False, result=ds)
    n = int(ds.mask.values[0].sum())
    positions = np.random.default_rng(0).choice(n, min(clicks, n), replace=False).tolist()
    wall, cpu, out = [], [], {}
    try:
        for kk in sorted({min(5, k), k}):
            t = saturation_click_latency(view, positions, k=kk)
            out[f"click_k{kk}_ms"] = round(float(np.median(t["wall"])) * 1000, 2)
            wall += t["wall"]
            cpu += t["cpu"]
    finally:
        view.close()
    return {"click_ms": round(float(np.median(wall)) * 1000, 2),
            "click_p90_ms": round(float(np.percentile(wall, 90)) * 1000, 2),
            "click_max_ms": round(float(np.max(wall)) * 1000, 2),
            "click_cpu_ms": round(float(np.median(cpu)) * 1000, 2), **out}
