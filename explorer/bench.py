"""Benchmarks: ratios measured in one run (ours vs a plain forward, ours vs a peer).

`run_bench` runs one registered bench and returns one JSON-able dict::

    {"bench": name, "machine": {...}, "date": ISO 8601, "params": {...},
     "figures": {...}, "notes": {...}, "accuracy": {...}}

``figures`` is a flat map of positive numbers whose names say their unit: ratios end in
``_ratio``, times in ``_ms``, memory in ``_mb``, throughput in ``_mb_per_s``. Times are
medians; a ratio is the median of per-repetition ratios of alternating runs (A, B, A, B,
...), so that a shared, busy machine slows both sides alike. ``notes`` says what could not
be measured and why; ``accuracy`` holds checks of results (agreements, errors).

A bench is a function of keyword options returning ``{"params", "figures", ...}``,
registered with the `bench` decorator; `explorer bench NAME --json` runs it.
"""
from __future__ import annotations

import contextlib
import importlib
import inspect
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ._checks import InputError, check_choice, check_int, suggest
from .benches.peers import transformer_lens_bridge
from .benches.timing import interleaved_times, median_ms, paired_ratio
from .defaults import DEFAULT_MODEL

__all__ = ["BENCHES", "ANALYSIS_BENCHES", "bench", "run_bench", "machine_info", "interleaved_times"]

BENCHES: dict[str, Callable[..., dict[str, Any]]] = {}

_UNITS = ("_ratio", "_ms", "_mb", "_mb_per_s")

# Benches that live beside their analysis: name -> (module, function).
ANALYSIS_BENCHES: dict[str, tuple[str, str]] = {
    "saturation": ("explorer.commands.saturation", "bench_saturation"),
    "conflicts": ("explorer.benches.conflicts", "bench_conflicts"),
    "patching": ("explorer.benches.patching", "bench_patching"),
    "icl-heads": ("explorer.benches.icl_heads", "bench_icl_heads"),
    "itda": ("explorer.benches.itda", "bench_itda"),
    "store": ("explorer.benches.store", "bench_store"),
    "eap": ("explorer.commands.circuits", "bench_eap"),
    "serve": ("explorer.benches.serve", "bench_serve"),
    "pages": ("explorer.benches.pages", "bench_pages"),
}


def bench(name: str) -> Callable[[Callable[..., dict]], Callable[..., dict]]:
    """Register a bench function under ``name`` (its keyword options become bench options)."""
    def register(fn: Callable[..., dict]) -> Callable[..., dict]:
        BENCHES[name] = fn
        return fn
    return register


def run_bench(name: str, *, model: str | None = None, **options: Any) -> dict[str, Any]:
    """Run the bench ``name`` and return its result as one JSON-able dict.

    Parameters
    ----------
    name : str
        A key of `BENCHES` (``"trace-overhead"``, ``"slider"``, ...).
    model : str, optional
        Model name or path; default the bench's own (the packaged SmolLM2).
    **options
        The bench's keyword options (sizes, repetitions); unknown ones raise InputError.
        ``threads`` (any bench) sets torch's thread count for the run.

    Returns
    -------
    dict
        ``bench``, ``machine``, ``date``, ``params``, ``figures`` and, where the bench has
        them, ``notes`` and ``accuracy``.
    """
    if name not in BENCHES and name in ANALYSIS_BENCHES:
        module, attr = ANALYSIS_BENCHES[name]  # imported on demand: analyses load sklearn etc.
        BENCHES[name] = getattr(importlib.import_module(module), attr)
    check_choice("bench", name, [*BENCHES, *(n for n in ANALYSIS_BENCHES if n not in BENCHES)])
    fn = BENCHES[name]
    threads = options.pop("threads", None)
    params = inspect.signature(fn).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    allowed = [p for p, v in params.items()
               if p != "model" and v.kind is not inspect.Parameter.VAR_KEYWORD]
    for key in () if takes_any else options:
        if key not in allowed:
            raise InputError(f"bench {name!r} has no option {key!r}; its options are "
                             f"{', '.join([*allowed, 'threads'])}.{suggest(key, allowed)}")
    if model is not None:
        options["model"] = model
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(check_int("threads", threads, low=1))
    load_start = os.getloadavg()
    date = datetime.now(timezone.utc).isoformat(timespec="seconds")
    try:
        with torch.no_grad():
            out = fn(**options)
        machine = machine_info()
    finally:
        torch.set_num_threads(before)
    machine["loadavg_1min"] = [round(load_start[0], 2), round(os.getloadavg()[0], 2)]
    figures = out["figures"]
    for key, value in figures.items():
        if not key.endswith(_UNITS):  # a bench's own bug, not a user error
            raise ValueError(f"bench figure {key!r} must end in one of {', '.join(_UNITS)}")
        figures[key] = float(value)
    result = {"bench": name, "machine": machine, "date": date, "params": out["params"],
              "figures": figures}
    for extra in ("notes", "accuracy"):
        if out.get(extra):
            result[extra] = out[extra]
    return result


def machine_info() -> dict[str, Any]:
    """Cores, torch threads, CPU model and capability, and the versions that matter."""
    import nnsight
    import transformers

    from ._version import __version__

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count()
    versions = {"python": platform.python_version(), "torch": torch.__version__,
                "transformers": transformers.__version__, "nnsight": nnsight.__version__,
                "explorer": __version__}
    if "transformer_lens" in sys.modules:
        from importlib.metadata import version

        versions["transformer_lens"] = version("transformer-lens")
    from ._kernels import bfloat16_matmul_is_fast, gemm_backend

    return {"cores": cores, "torch_threads": torch.get_num_threads(), "cpu": cpu,
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "unembed_gemm": gemm_backend(), "bfloat16_matmul_fast": bfloat16_matmul_is_fast(),
            "platform": platform.platform(), "versions": versions}


# -- text -----------------------------------------------------------------------------------

# Plain English prose written for these benches (public domain, no external source).
BENCH_TEXT = """\
The river town woke slowly on market days. Before the sun cleared the hills, farmers were \
already backing their carts up to the square, unloading crates of apples, onions and late \
summer tomatoes. The baker on the corner opened his shutters at six, and the smell of warm \
bread drifted down the street toward the bridge, where a few fishermen stood in silence with \
their lines in the water.

Most visitors came for the old stone church, which had stood at the top of the hill for nearly \
eight hundred years. Its bell tower leaned a little to the west, and local children liked to \
tell strangers that it would fall down one day soon. It never did. Inside, the walls were cool \
and dim, and the light from the narrow windows made long yellow stripes across the floor.

In the physics lecture that afternoon, the professor wrote a single equation on the board and \
asked the students to explain what each symbol meant. Energy, she said, is neither created nor \
destroyed; it only changes form. A ball rolling down a slope turns height into speed, and \
friction turns some of that speed into heat. Nobody in the room was surprised by this, but \
several of them struggled when she asked them to calculate how much heat was produced.

The committee met on Tuesday to review the budget for the coming year. The chair opened the \
meeting by thanking the volunteers who had organised the spring fair, which had raised more \
money than any event in the previous decade. Then the treasurer presented the figures: income \
had grown by twelve percent, but the cost of heating the hall had nearly doubled, and the roof \
would need to be repaired before winter.

Learning a second language as an adult is hard, but it is far from impossible. The most useful \
habit is to practise a little every day rather than a lot once a week. Reading simple stories, \
listening to the radio, and speaking with patient friends all help. Mistakes are not a sign of \
failure; they are how the brain discovers the rules that nobody wrote down.

The recipe called for two cups of flour, a pinch of salt, three eggs and a generous amount of \
butter. First, mix the dry ingredients in a large bowl. Then beat the eggs with the melted \
butter and pour them slowly into the flour, stirring all the time so that no lumps form. Let \
the dough rest for half an hour before rolling it out on a floured table.

When the storm finally reached the coast, the harbour was already empty. The fishing boats had \
been pulled onto the beach the night before, and the ferry to the island had been cancelled. \
Waves broke over the sea wall and ran across the road in sheets of white foam. By morning the \
wind had dropped, and people came out to look at the damage: a fallen tree, a few broken \
windows, and a great deal of sand where there had been none.

Computers store numbers in binary, using only the digits zero and one. A single binary digit \
is called a bit, and eight bits make a byte. With one byte you can count from zero to two \
hundred and fifty five. Larger numbers need more bytes, and numbers with fractions are stored \
in a special format that trades a little precision for an enormous range of values.

The old map showed a path through the forest that no longer existed. Trees had grown across \
it, streams had changed their course, and a new road now cut through the valley where the map \
promised only fields. Still, the two friends decided to follow it as far as they could, partly \
out of curiosity and partly because neither of them wanted to admit that they were lost.

Sleep is one of the least understood activities of the human body. We spend roughly a third of \
our lives asleep, yet scientists still argue about exactly why we need it. Some believe that \
sleep helps the brain to store memories; others think that it clears away waste that builds up \
during the day. Most agree that people who sleep too little become forgetful, irritable and \
more likely to fall ill.

At the end of the season the team gathered in the clubhouse to hand out the awards. The \
youngest player, who had joined only in the spring, won the prize for the most improved. The \
captain gave a short speech, thanked the coach and the parents who had driven them to every \
away game, and promised that next year they would finally win the league.

The museum had recently opened a new wing devoted to the history of flight. Visitors could \
climb into the cockpit of an early passenger plane, watch films of the first balloon \
crossings, and try a simulator that let them land a small aircraft on a windy day. The most \
popular object, however, was a simple wooden glider built by two brothers who had tested it \
on the dunes more than a century ago.

Good writing is usually the result of patient rewriting. The first draft only needs to exist; \
its job is to put the ideas on the page so that they can be examined. In the second draft the \
writer removes what is unnecessary, moves paragraphs into a clearer order, and replaces vague \
words with precise ones. By the third draft, with luck, the text says what the writer meant \
and nothing else.
"""

# The two prompts whose mean residual difference is the slider's steering vector.
CONTRAST_PROMPTS = ("I love this. It is wonderful, happy, kind and full of joy.",
                    "I hate this. It is terrible, sad, cruel and full of pain.")


def text_prompts(model: Any, n: int, tokens: int) -> list[str]:
    """``n`` prompts cut from `BENCH_TEXT`, each exactly ``tokens`` tokens for ``model``.

    Windows are spread evenly over the text (wrapping around); a window whose decoded text
    does not tokenise back to the same ids moves on by one token.
    """
    ids = model.tokenizer(BENCH_TEXT, add_special_tokens=False)["input_ids"]
    limit = len(ids)
    ids = ids * (1 + (tokens + limit - 1) // limit)  # wrap around
    prompts: list[str] = []
    for i in range(n):
        start = (i * limit) // n
        for _ in range(limit):
            window = ids[start:start + tokens]
            text = model.tokenizer.decode(window)
            retokenised = model.tokenizer(text, add_special_tokens=False)["input_ids"]
            if text.strip() and retokenised == window:
                prompts.append(text)
                break
            start = (start + 1) % limit
        else:
            raise InputError(f"could not cut a prompt of {tokens} tokens from the bench text.")
    return prompts


def _load(model: str) -> Any:
    from .models import load_model

    return load_model(model)


# -- trace-overhead -------------------------------------------------------------------------

@bench("trace-overhead")
def trace_overhead(*, model: str = DEFAULT_MODEL, prompts: int = 8, tokens: int = 128,
                   repeats: int = 7, peer: bool = True, store: bool = True) -> dict[str, Any]:
    """`trace` of resid_post and attn_z at every layer vs a plain Hugging Face forward.

    Also: `run_batch` alone (the nnsight part), TransformerLens ``run_with_cache`` vs its own
    forward on the same weights, and ActivationStore write throughput vs ``np.save``.
    """
    from .store import ActivationStore
    from .trace import run_batch, trace

    n_prompts = check_int("prompts", prompts, low=1)
    tokens = check_int("tokens", tokens, low=2)
    repeats = check_int("repeats", repeats, low=1)
    m = _load(model)
    texts = text_prompts(m, n_prompts, tokens)
    batch = m.tokenize(texts)
    sites = ("resid_post", "attn_z")
    save = {(layer, s) for layer in range(m.n_layers) for s in sites}

    def plain():
        m.hf(**batch.model_inputs())

    def plain_no_logits():  # the forward without the unembedding, which trace does not read
        m.hf(**batch.model_inputs(), logits_to_keep=1)

    def ours():
        return trace(m, texts, sites=sites, batch_size=n_prompts, progress=False)

    def ours_run_batch():
        run_batch(m, batch, save=save, logits=False)

    fns = {"plain": plain, "trace": ours, "run_batch": ours_run_batch,
           "plain_no_logits": plain_no_logits}
    notes: dict[str, str] = {}
    bridge = None
    if peer:
        bridge, reason = transformer_lens_bridge(m)
        if reason:
            notes["peer"] = reason
        else:
            ids = batch.input_ids                                # equal lengths: no padding
            wanted = {f"blocks.{layer}.{hook}" for layer in range(m.n_layers)
                      for hook in ("hook_resid_post", "attn.hook_z")}

            def peer_plain():
                bridge(ids)

            def peer_cache():
                bridge.run_with_cache(ids, names_filter=lambda name: name in wanted)

            fns.update(peer_plain=peer_plain, peer_cache=peer_cache)
            from importlib.metadata import version

            notes["peer"] = (f"TransformerLens {version('transformer-lens')} TransformerBridge "
                             "(HookedTransformer was removed in 4.0) on a copy of the same "
                             "weights, unpadded input ids, run_with_cache(names_filter=resid_post, "
                             "attn z) vs its own forward")
    else:
        notes["peer"] = "not measured (peer=False)"
    times, cpu = interleaved_times(fns, repeats=repeats)
    figures = {
        "trace_overhead_ratio": paired_ratio(times["trace"], times["plain"]),
        "trace_overhead_cpu_ratio": paired_ratio(cpu["trace"], cpu["plain"]),
        "trace_vs_plain_no_logits_ratio": paired_ratio(times["trace"], times["plain_no_logits"]),
        "run_batch_overhead_ratio": paired_ratio(times["run_batch"], times["plain"]),
        "run_batch_overhead_cpu_ratio": paired_ratio(cpu["run_batch"], cpu["plain"]),
        "plain_forward_ms": median_ms(times["plain"]),
        "plain_forward_no_logits_ms": median_ms(times["plain_no_logits"]),
        "trace_ms": median_ms(times["trace"]),
        "run_batch_ms": median_ms(times["run_batch"]),
    }
    if "peer_cache" in times:
        figures["peer_overhead_ratio"] = paired_ratio(times["peer_cache"], times["peer_plain"])
        figures["peer_overhead_cpu_ratio"] = paired_ratio(cpu["peer_cache"], cpu["peer_plain"])
        figures["trace_vs_peer_ratio"] = paired_ratio(times["trace"], times["peer_cache"])
        figures["trace_vs_peer_cpu_ratio"] = paired_ratio(cpu["trace"], cpu["peer_cache"])
        figures["peer_plain_forward_ms"] = median_ms(times["peer_plain"])
        figures["peer_run_with_cache_ms"] = median_ms(times["peer_cache"])
    del bridge

    ds = ours()
    n_bytes = sum(v.nbytes for v in ds.data_vars.values())
    figures["dataset_mb"] = n_bytes / 2**20
    if store:
        with tempfile.TemporaryDirectory(prefix="explorer-bench-") as tmp:
            st = ActivationStore(Path(tmp) / "store")
            arrays = {name: np.asarray(v.values) for name, v in ds.data_vars.items()}
            count = [0]

            def store_put():
                count[0] += 1
                st.put(f"bench{count[0]}", ds)

            def np_save():
                count[0] += 1
                folder = Path(tmp) / f"npy{count[0]}"
                folder.mkdir()
                for name, a in arrays.items():
                    np.save(folder / f"{name}.npy", a)

            wt, _ = interleaved_times({"store": store_put, "np_save": np_save},
                                      repeats=max(3, repeats // 2))
        figures["store_write_mb_per_s"] = figures["dataset_mb"] / statistics.median(wt["store"])
        figures["npsave_write_mb_per_s"] = figures["dataset_mb"] / statistics.median(wt["np_save"])
        figures["store_vs_npsave_time_ratio"] = paired_ratio(wt["store"], wt["np_save"])
    params = {"model": model, "prompts": n_prompts, "tokens": tokens, "repeats": repeats,
              "sites": list(sites), "layers": m.n_layers, "peer": bool(peer),
              "store": bool(store)}
    return {"params": params, "figures": figures, "notes": notes}


# -- slider -----------------------------------------------------------------------------------

def steering_vector(model: Any, layer: int,
                    prompts: tuple[str, str] = CONTRAST_PROMPTS) -> np.ndarray:
    """Mean resid_post of the first prompt minus that of the second, at ``layer``: [d_model]."""
    from .trace import trace

    a, b = (trace(model, [p], sites="resid_post", layers=layer, progress=False).resid_post
            for p in prompts)
    return (a.mean("pos") - b.mean("pos")).values.reshape(-1)


def lens_agreement(exact: Any, fast: Any, *, margin: float = 1e-3) -> dict[str, float]:
    """How well a fast logit lens matches the exact one, over every real (prompt, pos, layer).

    Top-1 agreement is also given where the exact top-2 probabilities differ by more than
    ``margin`` (a near tie may swap in either direction without being an error).
    """
    mask = exact["mask"].values                                     # [prompt, pos]
    e_id = exact.top_token_id.values[mask]                          # [rows, layer, k]
    f_id = fast.top_token_id.values[mask]
    e_p = exact.top_prob.values[mask]
    f_p = fast.top_prob.values[mask]
    top1 = e_id[..., 0] == f_id[..., 0]
    clear = (e_p[..., 0] - e_p[..., 1]) > margin if e_p.shape[-1] > 1 else np.ones_like(top1)
    return {
        "rows": int(top1.size),
        "top1_agreement": float(top1.mean()),
        "top1_agreement_clear_margin": float(top1[clear].mean()) if clear.any() else 1.0,
        "topk_agreement": float((e_id == f_id).all(-1).mean()),
        "max_top_prob_abs_error": float(np.abs(e_p - f_p).max()),
        "max_final_prob_abs_error": float(np.abs(exact.final_prob.values[mask]
                                                 - fast.final_prob.values[mask]).max()),
        "final_rank_agreement": float((exact.final_rank.values[mask]
                                       == fast.final_rank.values[mask]).mean()),
    }


@bench("slider")
def slider(*, model: str = DEFAULT_MODEL, tokens: int = 32, layer: int | None = None,
           alpha: float = 8.0, k: int = 5, rank_cap: int = 32, repeats: int = 15,
           accuracy_prompts: int = 4, accuracy_tokens: int = 64,
           preview_moves: int = 16) -> dict[str, Any]:
    """One steering edit + logit lens update, as a slider move in the lens app does it.

    ``logit_lens(model, [prompt], k=k, edits=[Steer(layer, vector, alpha)], resume=clean)``
    in the default exact mode and in the page's fast mode (``unembed_dtype="auto"``,
    ``rank_cap``), each against the same call without ``resume`` (a full re-run), the
    exact mode without reuse of the clean layers' readouts, and the bfloat16 screen forced
    (``slider_bf16_ms``: what "auto" avoids on CPUs without native bfloat16). ``alpha``
    changes slightly on every call, as a slider does. ``accuracy`` compares the bfloat16
    screen with exact float32 on the bench text.

    The preview while the slider moves (``slider_preview_ms``, ``preview_moves`` moves):
    the lens page attached to a Bokeh Document, released once at ``alpha`` and then
    dragged from there towards ``alpha / 2``, each move timed from the slider's value
    change until the heatmap's data are replaced (`apps._page_benches.slider_preview_times`: on
    Llama-style models `explorer.lens_preview.steered_lens_preview`, the layers from the
    edit on re-run over candidate tokens, and the in-place redraw; its products' backend
    and both timings in ``params.kernel_decisions.preview``);
    ``preview_lens_ms`` / ``preview_vs_fast_ratio``: the page's fallback for other models,
    `logit_lens` ``preview_vocab``, against the page's exact call (``unembed_dtype="auto",
    rank_cap=k``), interleaved; ``accuracy.preview_vs_exact``: each move's preview against
    the exact lens at the same strength.
    """
    from .interventions import Steer
    from ._kernels import gemm_decisions
    from .lens import logit_lens, resolve_unembed_dtype, screen_decisions
    from .lens_preview import gemm_choices as preview_gemm_choices
    from .trace import clean_run

    tokens = check_int("tokens", tokens, low=2)
    repeats = check_int("repeats", repeats, low=1)
    m = _load(model)
    layer = m.n_layers // 2 if layer is None else m.check_layer(layer)
    prompt = text_prompts(m, 1, tokens)[0]
    vector = steering_vector(m, layer)
    fast = {"unembed_dtype": "auto", "rank_cap": rank_cap}
    bf16 = {"unembed_dtype": "bfloat16", "rank_cap": rank_cap}
    t0 = time.perf_counter()
    clean = clean_run(m, [prompt])
    clean_ms = (time.perf_counter() - t0) * 1e3
    calls = [0]

    def edit():
        calls[0] += 1
        return [Steer(layer, vector, alpha * (1 + 1e-3 * calls[0]))]

    def lens(**kw):
        return lambda: logit_lens(m, [prompt], k=k, edits=edit(), **kw)

    # the first edited read fills the clean-layer readouts; time it on its own
    t0 = time.perf_counter()
    lens(resume=clean)()
    first_ms = (time.perf_counter() - t0) * 1e3
    t0 = time.perf_counter()
    lens(resume=clean, **fast)()
    first_fast_ms = (time.perf_counter() - t0) * 1e3
    page = {"unembed_dtype": "auto", "rank_cap": k}
    preview = {}
    if preview_moves:
        from .lens import preview_vocabulary
        shown = logit_lens(m, [prompt], k=k, edits=[Steer(layer, vector, alpha)], resume=clean,
                           **page)
        preview = {**page, "preview_vocab": preview_vocabulary(m, results=[shown],
                                                               directions=[vector])}
    times, cpu = interleaved_times({
        **({"page_exact": lens(resume=clean, **page),
            "page_preview": lens(resume=clean, **preview)} if preview_moves else {}),
        "exact_resumed": lens(resume=clean),
        "exact_full": lens(),
        "exact_resumed_no_reuse": lens(resume=clean, reuse_clean=False),
        "fast_resumed": lens(resume=clean, **fast),
        "fast_full": lens(**fast),
        "bf16_resumed": lens(resume=clean, **bf16),
    }, repeats=repeats)
    figures = {
        "slider_exact_ms": median_ms(times["exact_resumed"]),
        "slider_fast_ms": median_ms(times["fast_resumed"]),
        "slider_bf16_ms": median_ms(times["bf16_resumed"]),
        "bf16_vs_fast_ratio": paired_ratio(times["bf16_resumed"], times["fast_resumed"]),
        "exact_resumed_vs_full_ratio": paired_ratio(times["exact_resumed"], times["exact_full"]),
        "fast_resumed_vs_full_ratio": paired_ratio(times["fast_resumed"], times["fast_full"]),
        "exact_reuse_vs_no_reuse_ratio": paired_ratio(times["exact_resumed"],
                                                       times["exact_resumed_no_reuse"]),
        "fast_vs_exact_ratio": paired_ratio(times["fast_resumed"], times["exact_resumed"]),
        "exact_resumed_vs_full_cpu_ratio": paired_ratio(cpu["exact_resumed"], cpu["exact_full"]),
        "fast_resumed_vs_full_cpu_ratio": paired_ratio(cpu["fast_resumed"], cpu["fast_full"]),
        "fast_vs_exact_cpu_ratio": paired_ratio(cpu["fast_resumed"], cpu["exact_resumed"]),
        "slider_exact_cpu_ms": median_ms(cpu["exact_resumed"]),
        "slider_fast_cpu_ms": median_ms(cpu["fast_resumed"]),
        "exact_full_ms": median_ms(times["exact_full"]),
        "fast_full_ms": median_ms(times["fast_full"]),
        "clean_run_ms": clean_ms,
        "first_edit_exact_ms": first_ms,
        "first_edit_fast_ms": first_fast_ms,
    }
    accuracy: dict[str, Any] = {}
    if preview_moves:
        moves = check_int("preview_moves", preview_moves, low=1)
        from explorer.commands.pages import lens_slider_preview_times

        drag = lens_slider_preview_times(
            m, prompt, steer_layer=layer, vector=vector, start_alpha=alpha,
            alphas=list(alpha * (1 - 0.5 * np.arange(1, moves + 1) / moves)))
        figures.update({
            "slider_preview_ms": median_ms(drag["wall"]),
            "slider_preview_p90_ms": float(np.percentile(drag["wall"], 90)) * 1e3,
            "slider_preview_cpu_ms": median_ms(drag["cpu"]),
            "preview_lens_ms": median_ms(times["page_preview"]),
            "page_exact_ms": median_ms(times["page_exact"]),
            "preview_vs_fast_ratio": paired_ratio(times["page_preview"], times["page_exact"]),
            "preview_vs_fast_cpu_ratio": paired_ratio(cpu["page_preview"], cpu["page_exact"]),
        })
        top1, topk, err = [], [], []
        for a, ds in zip(drag["alphas"], drag["previews"]):
            ex = logit_lens(m, [prompt], k=k, edits=[Steer(layer, vector, a)], resume=clean,
                            **page)
            same = ex.top_token_id.values[..., 0] == ds.top_token_id.values[..., 0]
            top1.append(same.mean())
            topk.append((ex.top_token_id.values == ds.top_token_id.values).all(-1).mean())
            err.append(np.abs(ex.top_prob.values[..., 0] - ds.top_prob.values[..., 0])[same])
        err = np.concatenate(err)
        accuracy["preview_vs_exact"] = {
            "moves": len(top1), "rows_per_move": int(drag["previews"][0].top_prob[..., 0].size),
            "top1_agreement": float(np.mean(top1)), "topk_agreement": float(np.mean(topk)),
            "top1_prob_abs_error_median": float(np.median(err)),
            "top1_prob_abs_error_p90": float(np.percentile(err, 90)),
            "top1_prob_abs_error_max": float(err.max()),
            "candidate_columns": drag["previews"][-1].attrs["params"]["preview_columns"],
            "preview_dtype": drag["previews"][-1].attrs["params"].get("preview_dtype")}
        last = drag["exact"]
        plain = logit_lens(m, [prompt], k=k, edits=[Steer(layer, vector, drag["alphas"][-1])],
                           unembed_dtype=last.attrs["params"]["unembed_dtype"], rank_cap=k)
        accuracy["release_equals_full_run"] = all(
            np.array_equal(last[v].values, plain[v].values, equal_nan=True)
            for v in ("top_token_id", "top_prob", "final_rank", "final_prob"))
    edits = [Steer(layer, vector, alpha)]
    reused = logit_lens(m, [prompt], k=k, edits=edits, resume=clean)
    recomputed = logit_lens(m, [prompt], k=k, edits=edits)
    accuracy["reuse_identical"] = all(
        np.array_equal(reused[v].values, recomputed[v].values, equal_nan=True)
        for v in ("top_token_id", "top_prob", "final_rank", "final_prob"))
    if accuracy_prompts:
        texts = text_prompts(m, check_int("accuracy_prompts", accuracy_prompts, low=1),
                             check_int("accuracy_tokens", accuracy_tokens, low=2))
        exact = logit_lens(m, texts, k=k, rank_cap=rank_cap)
        screened = logit_lens(m, texts, k=k, **bf16)
        accuracy["bf16_vs_exact"] = lens_agreement(exact, screened)
    params = {"model": model, "tokens": tokens, "layer": layer, "alpha": alpha, "k": k,
              "rank_cap": rank_cap, "repeats": repeats, "fast": fast,
              "fast_resolves_to": resolve_unembed_dtype("auto", m, 256),
              "kernel_decisions": {"screen": screen_decisions(m), "gemm": gemm_decisions(),
                                   "preview": preview_gemm_choices()},
              "accuracy_prompts": accuracy_prompts, "accuracy_tokens": accuracy_tokens,
              "layers": m.n_layers, "preview_moves": preview_moves}
    return {"params": params, "figures": figures, "accuracy": accuracy}


def slider_preview_compute(*, model: str = DEFAULT_MODEL, tokens: int = 32,
                           layer: int | None = None, alpha: float = 8.0, k: int = 5,
                           moves: int = 16) -> dict[str, Any]:
    """The slider preview's compute in this process, as a fresh page's first drag runs it:
    the GEMM backend `explorer.lens_preview.choose_backend` decides (timed on the first
    preview) and, interleaved over ``moves`` strengths from ``alpha`` towards ``alpha / 2``,
    `steered_lens_preview` against the page's exact call (`logit_lens` resumed,
    ``unembed_dtype="auto", rank_cap=k``). `benchmarks/slider_drag.py` runs this in
    several fresh processes to check that the decision does not flip."""
    from .interventions import Steer
    from .lens import logit_lens, preview_vocabulary
    from .lens_preview import gemm_choices, steered_lens_preview
    from .trace import clean_run

    m = _load(model)
    layer = m.n_layers // 2 if layer is None else m.check_layer(layer)
    prompt = text_prompts(m, 1, check_int("tokens", tokens, low=2))[0]
    vector = steering_vector(m, layer)
    clean = clean_run(m, [prompt])
    base = logit_lens(m, [prompt], k=k, rank_cap=k, unembed_dtype="auto")
    cand = preview_vocabulary(m, results=[base], directions=[vector])
    alphas = list(alpha * (1 - 0.5 * np.arange(1, check_int("moves", moves, low=1) + 1) / moves))
    at = iter(alphas * 4)

    def preview():
        return steered_lens_preview(m, prompt, k=k, edits=[Steer(layer, vector, next(at))],
                                    clean=clean, base=base, candidates=cand)

    t0 = time.perf_counter()
    first = preview()                          # decides the backend, as a page's first move
    first_ms = (time.perf_counter() - t0) * 1e3
    ran_on = first.attrs["params"].get("preview_backend", "torch")
    times, _ = interleaved_times({
        "preview": preview,
        "exact": lambda: logit_lens(m, [prompt], k=k, edits=[Steer(layer, vector, next(at))],
                                    resume=clean, rank_cap=k, unembed_dtype="auto")},
        repeats=moves)
    decision = [e for e in gemm_choices() if e["key"][:2] == [m.spec.name, layer]]
    return {"backend": ran_on,
            "decision": ("the CPU has native bfloat16 arithmetic" if ran_on == "bfloat16"
                         else decision[-1] if decision else "forced by EXPLORER_CPU_GEMM"),
            "preview_ms": median_ms(times["preview"]), "exact_ms": median_ms(times["exact"]),
            "preview_vs_exact_ratio": paired_ratio(times["preview"], times["exact"]),
            "first_preview_ms": first_ms, "load": os.getloadavg()[0],
            "threads": torch.get_num_threads()}


@bench("remote")
def remote_overhead(*, model: str = DEFAULT_MODEL, n_prompts: int = 8, steps: int = 3,
                    ft_steps: int = 10, fv_prompts: int = 8, repeats: int = 3) -> dict[str, Any]:
    """A remote model served on this machine (the loopback NDIF server) against the same
    calls on the local model, in one run.

    The server runs in a child process on 127.0.0.1 and computes on the same cores, so a
    ratio is what the remote path adds on top of the computation itself: serialising the
    trace and explorer's code, the protocol round trips, and the result download.
    ``remote_vs_local_eap_ratio``: `edge_scores` (EAP, one batch of ``n_prompts`` `add`
    pairs: one job) remote over local, wall time; ``remote_vs_local_eap_ig_ratio`` the same
    for EAP-IG(``steps``); ``remote_vs_local_trace_ratio``: `trace` of one prompt
    (resid_post, every layer). ``eap_request_mb``: size of the request an EAP batch sends;
    ``eap_result_mb``: the scores that come back (one float32 per edge).

    Training: `circuit_lora.finetune_lora` (rank 2 on every layer, ``ft_steps`` steps of
    ``n_prompts`` problems: one job) on the remote model, whose adapters are held in the job
    and hooked (`explorer.lora`), against the local peft run on a copy and the local hooks
    path. ``remote_vs_local_finetune_ratio`` is remote over local peft, wall time per call;
    ``finetune_job_mb`` the largest training request (adapters and optimiser state) and
    ``finetune_result_mb`` what a job sends back.

    FV scores: `icl_heads.fv_scores` on the antonym task (``fv_prompts`` prompts of 5 shots,
    the heads of every third layer) by the last-token path, whose remote runs are one NDIF
    session (`explorer.trace.runs_over_prefix`); ``remote_vs_local_fv_ratio`` remote over
    local, wall time. Attribution patching: `unlearning.attribution_patching` of 2 shipped
    facts (2 facts with the attributes blue, dog and moon where the model's tokenizer
    cannot tell the shipped sports apart: ``params["ap_facts"]``), one trace with gradient readouts per
    fact (remote: an NDIF session that turns gradient tracking on);
    ``remote_vs_local_attribution_ratio``.
    """
    from unittest import mock

    from explorer import lora as lora_jobs
    from explorer.analyses import circuit_lora as cl
    from explorer.analyses import circuits as ca
    from explorer.analyses import icl_heads as ih
    from explorer.analyses import unlearning as ul
    from explorer.models import load_model, smollm2_folder
    from explorer.ndif_server import LoopbackServer
    from explorer.remote import remote_backend_class
    from explorer.trace import trace

    n_prompts = check_int("n_prompts", n_prompts, low=1)
    steps = check_int("steps", steps, low=1, high=100)
    ft_steps = check_int("ft_steps", ft_steps, low=1, high=lora_jobs.STEPS_PER_JOB)
    fv_prompts = check_int("fv_prompts", fv_prompts, low=1)
    repeats = check_int("repeats", repeats, low=1)
    with contextlib.ExitStack() as stack:
        if model == DEFAULT_MODEL:
            folder = smollm2_folder()
        else:  # save the model to a folder the server can load
            folder = Path(stack.enter_context(tempfile.TemporaryDirectory()))
            m = load_model(model)
            m.hf.save_pretrained(folder)
            m.tokenizer.save_pretrained(folder)
        local = load_model(folder)
        key = "bench-" + os.urandom(8).hex()
        server = stack.enter_context(LoopbackServer(folder, api_key=key))
        stack.enter_context(mock.patch.dict(os.environ, {"NDIF_API_KEY": key,
                                                         "NDIF_HOST": server.url}))
        remote = load_model(folder, remote=True)
        task = ca.make_task("add", n_prompts, seed=0)
        prompt = text_prompts(local, 1, 32)

        def scores(m, method):
            with torch.enable_grad():
                return ca.edge_scores(m, task, method=method, steps=steps, batch_size=n_prompts)

        ft_task = ca.make_task("add", 4 * n_prompts, seed=1)
        ranks = cl.uniform_lora_ranks(local, 2)

        def finetune(m):
            return cl.finetune_lora(m, ft_task.clean, ft_task.answer, ranks=ranks,
                                    steps=ft_steps, batch_size=n_prompts, lr=1e-3, seed=0)

        def finetune_hooks():  # the remote path's loop, run on the local weights
            pairs = cl.encode_answers(local, ft_task.clean, ft_task.answer)
            draws = cl.batch_draws(len(pairs), n_prompts, ft_steps, 0)
            return cl.train_by_hooks(local, cl.lora_weights_init(local, ranks), pairs, draws,
                                      [1e-3] * ft_steps, [], lambda k, w: None, None)

        def fv(m):
            return ih.fv_scores(m, ["antonym"], n_prompts=fv_prompts, n_shots=5,
                                layers=list(range(0, m.n_layers, 3)), method="last_token")

        facts, ap_facts = ul.load_attribute_facts()[:2], "shipped"
        try:
            ul.attribute_token_ids(local, facts[0].attributes)
        except InputError:
            attrs = ("blue", "dog", "moon")
            facts, ap_facts = [ul.AttributeFact(f"Person {x}", attrs[i], attrs,
                                                "Fact: {subject} likes the",
                                                "Q: {subject} likes? {options}\nA:")
                               for i, x in enumerate("AB")], "blue-dog-moon"

        def attribution(m):
            return ul.attribution_patching(m, facts)

        fns = {"eap_local": lambda: scores(local, "eap"), "eap_remote": lambda: scores(remote, "eap"),
               "ig_local": lambda: scores(local, "eap-ig"),
               "ig_remote": lambda: scores(remote, "eap-ig"),
               "trace_local": lambda: trace(local, prompt), "trace_remote": lambda: trace(remote, prompt),
               "ft_local": lambda: finetune(local), "ft_hooks": finetune_hooks,
               "ft_remote": lambda: finetune(remote),
               "fv_local": lambda: fv(local), "fv_remote": lambda: fv(remote),
               "ap_local": lambda: attribution(local), "ap_remote": lambda: attribution(remote)}
        wall, _cpu = interleaved_times(fns, repeats=repeats, warmup=1)
        sizes: list[int] = []
        backend = remote_backend_class()
        serialize = backend._serialize

        def measured(self, tracer):
            blob = serialize(self, tracer)
            sizes.append(len(blob))
            return blob
        backend._serialize = measured
        try:
            result = scores(remote, "eap")
            eap_sizes, sizes[:] = list(sizes), []
            ft_remote, lora_remote = finetune(remote)
            ft_sizes = list(sizes)
        finally:
            backend._serialize = serialize
        ft_peft, peft_model = finetune(local)
        from peft import get_peft_model_state_dict
        theirs = get_peft_model_state_dict(peft_model)
        ft_same = bool(np.array_equal(ft_remote["loss"].values, ft_peft["loss"].values)) and all(
            torch.equal(lora_remote.state_dict()[k], theirs[k]) for k in theirs)
        ft_result_mb = 4 * 3 * lora_remote.n_params() / 2**20  # adapters + AdamW's 2 moments
        fv_same = bool(fv(remote).fv_score.equals(fv(local).fv_score))
        ap_remote, ap_local = attribution(remote), attribution(local)
        ap_same = all(bool(ap_remote[v].equals(ap_local[v])) for v in ("ap_mlp", "ap_head"))
        expect = scores(local, "eap").score.values
        same = bool(np.array_equal(result.score.values, expect))
        rel = float(np.abs(result.score.values - expect).max() / max(np.abs(expect).max(), 1e-30))

    def med(name):
        return statistics.median(wall[name])

    def pair(figure, local_run, remote_run):
        """Local and remote medians (ms) of one call and their paired ratio."""
        return {f"{figure}_local_ms": med(local_run) * 1e3,
                f"{figure}_remote_ms": med(remote_run) * 1e3,
                f"remote_vs_local_{figure}_ratio": paired_ratio(wall[remote_run],
                                                                wall[local_run])}

    return {
        "params": {"model": model, "n_prompts": n_prompts, "n_pos": int(
            local.tokenize(task.clean).width), "steps": steps, "ft_steps": ft_steps,
            "ft_trainable": int(lora_remote.n_params()), "fv_prompts": fv_prompts,
            "ap_facts": ap_facts,
            "repeats": repeats,
            "n_edges": int(result.sizes["edge"]), "threads": torch.get_num_threads()},
        "figures": {
            **pair("eap", "eap_local", "eap_remote"), **pair("eap_ig", "ig_local", "ig_remote"),
            **pair("trace", "trace_local", "trace_remote"),
            "eap_request_mb": max(eap_sizes) / 2**20 if eap_sizes else float("nan"),
            "eap_result_mb": 4 * result.sizes["edge"] / 2**20,
            **pair("finetune", "ft_local", "ft_remote"),
            "finetune_local_hooks_ms": med("ft_hooks") * 1e3,
            "hooks_vs_peft_finetune_ratio": paired_ratio(wall["ft_hooks"], wall["ft_local"]),
            "finetune_job_mb": max(ft_sizes) / 2**20 if ft_sizes else float("nan"),
            "finetune_result_mb": ft_result_mb,
            **pair("fv", "fv_local", "fv_remote"), **pair("attribution", "ap_local", "ap_remote"),
        },
        "accuracy": {"remote_scores_equal_local": same, "remote_vs_local_max_rel_diff": rel,
                     "remote_finetune_equals_local_peft": ft_same,
                     "remote_fv_scores_equal_local": fv_same,
                     "remote_attribution_equals_local": ap_same},
        "notes": {"ratios": "median over interleaved rounds of remote / local wall time; the "
                            "loopback server computes on the same cores",
                  "accuracy": "EAP scores remote vs local: bit for bit when the server and "
                              "this process use the same number of torch threads",
                  "eap_request_mb": "serialised trace of one EAP batch: the code (explorer's, "
                                    "by value), the prompts' ids and the arguments",
                  "finetune": "LoRA rank 2 on every layer; local: peft on a copy of the "
                              "weights, local hooks: the remote path's loop on the local "
                              "weights, remote: the same loop in one job on the server"},
    }
