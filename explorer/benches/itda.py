"""``explorer bench itda``: the build time of an ITDA dictionary (`explorer.analyses.itda`)
against a TopK sparse autoencoder trained to the same held-out error, in one run.
"""
from __future__ import annotations

from typing import Any

from explorer._checks import InputError, check_float, check_int
from explorer.analyses.itda import itda_vs_sae
from explorer.analyses.saturation.corpus import pack_units
from explorer.defaults import DATASETS_DIR, DEFAULT_MODEL

__all__ = ["bench_itda"]


def _corpus_prompts(model: Any, *, n_prompts: int, max_tokens: int = 64) -> list[str]:
    """Sentences of the shipped corpus packed into prompts of at most ``max_tokens`` tokens."""
    import re

    folder = DATASETS_DIR / "corpus"
    files = sorted(folder.glob("*.txt"))
    if not files:
        raise InputError(f"the shipped corpus is missing: no .txt file in {str(folder)!r}.")
    out: list[str] = []

    def n_tok(text: str) -> int:
        return len(model.tokenizer(text, add_special_tokens=False)["input_ids"])

    for f in files:
        for par in re.split(r"\n\s*\n", f.read_text(encoding="utf-8")):
            sentences = [x for x in re.split(r"(?<=[.!?;:])\s+", par.strip()) if x]
            out += pack_units(sentences, n_tok, max_tokens)
    out = [p for p in out if 4 <= n_tok(p) <= max_tokens]
    return out[:n_prompts]


def bench_itda(model: Any = None, n_prompts: int = 100, layer: int | None = None, tau: float = 0.2,
               l0: int = 8, sae_seconds: float = 300.0) -> dict[str, Any]:
    """ITDA build time versus a TopK SAE trained to the same held-out error, in one run.

    Corpus prompts (every 5th held out) are traced once at ``layer`` (default the middle);
    the dictionary is built on the rest, the SAE (as many latents as atoms, k = l0) trains
    until its held-out error reaches the dictionary's or ``sae_seconds`` pass. Shaped for
    `explorer.bench` (``explorer bench itda --json``).

    Returns
    -------
    dict
        ``params``; ``figures``: ``itda_build_ms``, ``sae_train_ms``,
        ``itda_vs_sae_time_ratio``; ``accuracy``: held-out errors and FVE of both and
        whether the SAE reached the target; ``notes``.
    """
    from explorer.models import load_model
    from explorer.trace import trace

    check_int("n_prompts", n_prompts, low=10)
    check_float("sae_seconds", sae_seconds, low=1.0)
    if model is None or isinstance(model, str):
        model = load_model(model or DEFAULT_MODEL)
    layer = model.n_layers // 2 if layer is None else model.check_layer(layer)
    prompts = _corpus_prompts(model, n_prompts=n_prompts)
    held = [p for i, p in enumerate(prompts) if i % 5 == 4]
    train = [p for i, p in enumerate(prompts) if i % 5 != 4]
    acts_train = trace(model, train, layers=[layer], progress=False)
    acts_held = trace(model, held, layers=[layer], progress=False)
    cmp_ = itda_vs_sae(acts_train, tau=tau, l0=l0, layer=layer, max_seconds=sae_seconds,
                       max_epochs=100_000, eval_activations=acts_held, min_pos=1)
    secs = cmp_["fit_seconds"].values
    reached = bool(cmp_["sae_reached_target"])
    return {
        "params": {"model": model.spec.name, "layer": layer, "tau": tau, "l0": l0,
                   "n_train_tokens": int(cmp_.attrs["n_tokens"]), "n_atoms": int(cmp_["size"].values[0]),
                   "sae_seconds_cap": sae_seconds},
        "figures": {"itda_build_ms": float(secs[0] * 1000), "sae_train_ms": float(secs[1] * 1000),
                    "itda_vs_sae_time_ratio": float(cmp_["time_ratio"])},
        "accuracy": {"itda_heldout_error": float(cmp_["mean_error"].values[0]),
                     "sae_heldout_error": float(cmp_["mean_error"].values[1]),
                     "itda_heldout_fve": float(cmp_["fve"].values[0]),
                     "sae_heldout_fve": float(cmp_["fve"].values[1]), "sae_reached_target": reached},
        "notes": {"ratio": "ITDA build seconds / SAE training seconds to ITDA's held-out error"
                           + ("" if reached else "; the SAE stopped at the cap, so the ratio is an upper bound")},
    }
