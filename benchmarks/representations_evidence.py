"""Evidence for docs/representations.md: ITDA vs SAE, layer matching, neuron-eval sanity checks.

Parts (each writes its numbers into ``docs/figures/representations_summary.json``):

``itda``      SmolLM2-135M resid_post at one layer over the shipped corpus: tau sweep (size,
              error, L0, FVE on held-out prompts); ITDA versus a TopK SAE trained on the same
              activations to the same error (wall-time ratio, held-out error and FVE); the
              CE loss score of both spliced into the model.
``matching``  Layer matching (Kornblith et al. 2019) with ITDA-Jaccard, linear CKA and SVCCA:
              three seeds of a 6-layer Llama trained here on the corpus, and SmolLM2 versus a
              lightly fine-tuned copy.
``sanity``    The missing/extra-labels sanity checks: synthetic units (the paper's theoretical
              test, 10^5 inputs, 100 seeds) and SmolLM2's ITDA atoms explained by their own token.
``meta``      The known-unit meta-evaluation (the paper's meta-AUPRC): SmolLM2's ITDA atoms, each
              explained by its own source token against the other atoms' tokens; every metric's
              pooled AUPRC on 95 % of the atoms, alpha picked on the other 5 %.
``streaming`` An ITDA over a million tokens streamed from the activation store (tiny model):
              time and peak memory against the size of the stored activations.
``figures``   PNGs of the results (rendered by chromium) and of both pages.

Usage::

    python benchmarks/representations_evidence.py --part itda --part matching --part sanity
    python benchmarks/representations_evidence.py --part streaming
    python benchmarks/representations_evidence.py --part figures

Activations are cached in the activation store ($EXPLORER_CACHE), trained models under
``$EXPLORER_CACHE/models/representations-evidence``. ``--threads 1`` (default) is fastest on
a busy machine.
"""
from __future__ import annotations

import argparse
import json
import re
import resource
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

import _figures  # benchmarks/_figures.py, beside this script
from _figures import browser_on_pages, log
from explorer.commands._common import add_number_options
from explorer.defaults import DEFAULT_MODEL

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
FIGURES = ROOT / "docs" / "figures"
SUMMARY = FIGURES / "representations_summary.json"
CORPUS = ROOT / "datasets" / "corpus"

ITDA_LAYER = 15          # a middle layer of SmolLM2's 30
ITDA_TAUS = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.7)
ITDA_TAU = 0.2
ITDA_L0 = 8
MIN_POS = 1              # each prompt's first token is SmolLM2's attention sink (norm ~130x): left out


# -- bookkeeping ------------------------------------------------------------------------------

def write_summary(part: str, data: dict[str, Any]) -> None:
    _figures.update_summary(SUMMARY, part, data)


def read_summary() -> dict[str, Any]:
    return json.loads(SUMMARY.read_text()) if SUMMARY.exists() else {}


def corpus_prompts(tokenizer: Any, *, max_tokens: int = 64) -> list[str]:
    """The shipped corpus cut into prompts of at most ``max_tokens`` tokens, at sentence ends."""
    prompts = []
    for f in sorted(CORPUS.glob("*.txt")):
        for par in re.split(r"\n\s*\n", f.read_text(encoding="utf-8")):
            cur = ""
            for sent in re.split(r"(?<=[.!?;:])\s+", par.strip()):
                cand = f"{cur} {sent}".strip()
                if cur and len(tokenizer(cand, add_special_tokens=False)["input_ids"]) > max_tokens:
                    prompts.append(cur)
                    cur = sent
                else:
                    cur = cand
            if len(cur.split()) >= 3:
                prompts.append(cur)
    return [p for p in prompts
            if 4 <= len(tokenizer(p, add_special_tokens=False)["input_ids"]) <= max_tokens]


def split(prompts: list[str], every: int = 5) -> tuple[list[str], list[str]]:
    """Every ``every``-th prompt held out (spread over all documents)."""
    held = [p for i, p in enumerate(prompts) if i % every == every - 1]
    train = [p for i, p in enumerate(prompts) if i % every != every - 1]
    return train, held


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# -- part 1: ITDA on SmolLM2 vs an SAE ------------------------------------------------------------

def part_itda(args: argparse.Namespace) -> None:
    from explorer import ActivationStore, load_model
    from explorer.analyses.itda import (
        ITDA,
        SparseAutoencoder,
        cached_activations,
        downstream_loss,
        itda_reconstruction,
        itda_tau_sweep,
    )

    model = load_model(DEFAULT_MODEL)
    prompts = corpus_prompts(model.tokenizer)[: args.itda_prompts]
    train, held = split(prompts)
    store = ActivationStore()
    log(f"tracing {len(train)} + {len(held)} prompts at layer {ITDA_LAYER}")
    acts_train = cached_activations(model, train, layers=[ITDA_LAYER], store=store, progress=True)
    acts_held = cached_activations(model, held, layers=[ITDA_LAYER], store=store, progress=True)
    n_train, n_held = int(acts_train["mask"].sum()), int(acts_held["mask"].sum())
    log(f"{n_train} train tokens, {n_held} held-out tokens; tau sweep")
    sweep = itda_tau_sweep(acts_train, taus=ITDA_TAUS, l0=ITDA_L0, layer=ITDA_LAYER,
                           eval_activations=acts_held, min_pos=MIN_POS)
    rows = [{"tau": float(t), **{k: float(sweep[k].sel(tau=t)) for k in
                                ("n_atoms", "mean_error", "mean_l0", "fve", "fit_seconds")}}
            for t in sweep["tau"].values]
    for r in rows:
        log(f"  tau {r['tau']:.2f}: {r['n_atoms']:.0f} atoms, held-out error {r['mean_error']:.3f}, "
            f"L0 {r['mean_l0']:.2f}, FVE {r['fve']:.3f}, {r['fit_seconds']:.2f} s")

    def tokens(acts):
        keep = acts["mask"].values & (acts["pos"].values >= MIN_POS)[None, :]
        return acts["resid_post"].sel(layer=ITDA_LAYER).values[keep]

    x_train, x_held = tokens(acts_train), tokens(acts_held)

    def rel_err(x, xhat):
        x64, xh = x.astype(np.float64), xhat.astype(np.float64)
        res = ((x64 - xh) ** 2).sum(1)
        return (float((res / (x64 ** 2).sum(1)).mean()),
                float(1 - res.sum() / ((x64 - x64.mean(0)) ** 2).sum()))

    def compare(tau: float, *, ce: bool) -> dict[str, Any]:
        log(f"ITDA tau={tau} and an SAE trained to its held-out error")
        itda = ITDA(tau=tau, l0=ITDA_L0).fit(acts_train, layer=ITDA_LAYER, min_pos=MIN_POS)
        itda_train_err, _ = rel_err(x_train, itda.reconstruct(x_train))
        itda_held = rel_err(x_held, itda.reconstruct(x_held))
        sae = SparseAutoencoder(itda.n_atoms, k=ITDA_L0, lr=args.sae_lr, batch_size=256, max_epochs=10_000,
                                max_seconds=args.sae_seconds, target_error=itda_held[0], seed=0
                                ).fit(x_train, x_val=x_held)
        log(f"  ITDA {itda.n_atoms} atoms in {itda.fit_seconds_:.2f} s (held-out error {itda_held[0]:.4f}); "
            f"SAE {sae.epochs_} epochs in {sae.fit_seconds_:.1f} s, held-out error {sae.val_history_[-1]:.4f}, "
            f"best {sae.val_history_.min():.4f}, reached: {sae.reached_target_}")
        sae_held = rel_err(x_held, sae.reconstruct(x_held))
        rec = itda_reconstruction(itda, acts_held, layer=ITDA_LAYER, min_pos=MIN_POS)
        out = {
            "tau": tau, "itda_atoms": itda.n_atoms, "itda_seconds": itda.fit_seconds_,
            "itda_train_error": itda_train_err, "target": "ITDA held-out error",
            "sae_latents": itda.n_atoms, "sae_k": ITDA_L0,
            "sae_seconds": sae.fit_seconds_, "sae_epochs": sae.epochs_, "sae_train_error": sae.error_,
            "sae_best_heldout_error": float(sae.val_history_.min()),
            "sae_reached_target": bool(sae.reached_target_), "sae_lr": args.sae_lr,
            "sae_max_seconds": args.sae_seconds,
            "time_ratio_itda_over_sae": itda.fit_seconds_ / sae.fit_seconds_,
            "itda_heldout_error": itda_held[0], "itda_heldout_fve": itda_held[1],
            "itda_heldout_l0": float(rec["mean_l0"]),
            "sae_heldout_error": sae_held[0], "sae_heldout_fve": sae_held[1],
            "sae_val_history": [float(v) for v in sae.val_history_],
        }
        if ce:
            ce_prompts = held[: args.ce_prompts]
            log(f"CE loss score on {len(ce_prompts)} held-out prompts")
            ce_itda = downstream_loss(model, ce_prompts, itda.reconstruct, layer=ITDA_LAYER, min_pos=MIN_POS)
            ce_sae = downstream_loss(model, ce_prompts, sae.reconstruct, layer=ITDA_LAYER, min_pos=MIN_POS)
            log(f"  ITDA {float(ce_itda['ce_loss_score']):.3f}, SAE {float(ce_sae['ce_loss_score']):.3f}")
            out.update({
                "ce_prompts": len(ce_prompts),
                "loss_clean": float(ce_itda["loss_clean"].mean()),
                "loss_zero": float(ce_itda["loss_zero"].mean()),
                "itda_loss": float(ce_itda["loss_reconstructed"].mean()),
                "sae_loss": float(ce_sae["loss_reconstructed"].mean()),
                "itda_ce_loss_score": float(ce_itda["ce_loss_score"]),
                "sae_ce_loss_score": float(ce_sae["ce_loss_score"])})
        return out

    main = compare(ITDA_TAU, ce=True)
    extra = [compare(t, ce=False) for t in args.extra_taus]
    write_summary("itda", {
        "model": model.spec.name, "layer": ITDA_LAYER, "site": "resid_post", "l0": ITDA_L0,
        "n_train_tokens": n_train, "n_heldout_tokens": n_held, "tau_sweep": rows,
        "comparison": main, "more_comparisons": extra, "min_pos": MIN_POS,
        "torch_threads": args.threads,
    })


# -- part 2: layer matching -------------------------------------------------------------------------

def corpus_tokenizer(vocab_size: int = 1024) -> Any:
    """A byte-level BPE tokenizer trained on the corpus (deterministic)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([f.read_text(encoding="utf-8") for f in sorted(CORPUS.glob("*.txt"))],
                            trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>", bos_token="<|endoftext|>")


def lm_steps(hf: Any, ids: Any, opt: Any, *, steps: int, seq: int, batch: int, seed: int,
             sched: Any = None, clip: float | None = None, every: int = 1, label: str) -> None:
    """``steps`` next-token steps of ``hf`` on random ``seq``-token windows of ``ids``
    (``batch`` a step, drawn from a generator seeded with ``seed``), logging the loss every
    ``every`` steps and at the last."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.enable_grad():
        for step in range(steps):
            starts = torch.randint(0, len(ids) - seq - 1, (batch,), generator=gen)
            x = torch.stack([ids[s: s + seq] for s in starts])
            loss = hf(input_ids=x, labels=x).loss
            opt.zero_grad()
            loss.backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(hf.parameters(), clip)
            opt.step()
            if sched is not None:
                sched.step()
            if step % every == 0 or step == steps - 1:
                log(f"    {label} {step}: loss {loss.item():.3f}")


def train_small_llama(tokenizer: Any, texts: list[str], *, seed: int, steps: int, n_layers: int = 6,
                      d_model: int = 64, seq: int = 64, batch: int = 16, lr: float = 3e-3) -> Any:
    """A small Llama trained from scratch on ``texts``; the seed sets the init and the batches.

    Saved under ``$EXPLORER_CACHE/models/representations-evidence/`` and reloaded from there.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from explorer.models import cache_dir, wrap_model

    folder = cache_dir() / "models" / "representations-evidence" / f"llama{n_layers}L-d{d_model}-s{seed}-{steps}"
    name, weights = f"corpus-llama-{n_layers}L-seed{seed}", f"trained:seed={seed},steps={steps}"
    if (folder / "config.json").exists():
        log(f"    loading {folder}")
        return wrap_model(AutoModelForCausalLM.from_pretrained(folder), tokenizer, name=name, weights=weights)

    config = AutoConfig.for_model("llama", num_hidden_layers=n_layers, num_attention_heads=4,
                                  num_key_value_heads=4, hidden_size=d_model, intermediate_size=4 * d_model,
                                  max_position_embeddings=seq, vocab_size=len(tokenizer),
                                  tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(config)
    ids = torch.tensor([i for t in texts for i in tokenizer(t + "\n\n")["input_ids"]])
    opt = torch.optim.AdamW(hf.parameters(), lr=lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1)
    hf.train()
    lm_steps(hf, ids, opt, steps=steps, seq=seq, batch=batch, seed=seed, sched=sched, clip=1.0,
             every=100, label=f"seed {seed} step")
    hf.save_pretrained(folder)
    return wrap_model(hf, tokenizer, name=name, weights=weights)


def finetuned_copy(model: Any, texts: list[str], *, steps: int, lr: float, seq: int = 64, batch: int = 2,
                   seed: int = 0) -> Any:
    """SmolLM2 fine-tuned for a few steps on ``texts`` (a lightly fine-tuned sibling)."""
    import copy

    import torch

    from explorer.models import wrap_model

    hf = copy.deepcopy(model.hf)
    hf.requires_grad_(True)
    hf.train()
    ids = torch.tensor([i for t in texts for i in model.tokenizer(t + "\n\n")["input_ids"]])
    opt = torch.optim.AdamW(hf.parameters(), lr=lr)
    lm_steps(hf, ids, opt, steps=steps, seq=seq, batch=batch, seed=seed, label="fine-tune step")
    return wrap_model(hf, model.tokenizer, name=f"{model.spec.name}-ft{steps}",
                      weights=f"{model.spec.weights}+finetune(steps={steps},lr={lr},seed={seed})")


def matching_result(out: Any) -> dict[str, Any]:
    return {"accuracy": {str(m): float(out["accuracy"].sel(measure=m)) for m in out["measure"].values},
            "models": [str(m) for m in out["model_a"].values],
            "n_tokens": int(out.attrs["n_tokens"]),
            "similarity": {str(m): out["similarity"].sel(measure=m).isel(model_a=0, model_b=1).values.round(4).tolist()
                           for m in out["measure"].values}}


def part_matching(args: argparse.Namespace) -> None:
    from explorer import load_model
    from explorer.analyses.similarity import layer_matching
    from explorer.trace import trace

    results: dict[str, Any] = {}
    # (a) three seeds of a small Llama trained on the corpus
    tok = corpus_tokenizer()
    prompts = corpus_prompts(tok, max_tokens=60)
    train, held = split(prompts)
    held = held[: args.match_prompts]
    acts = {}
    for seed in range(args.seeds):
        log(f"training seed {seed}")
        t0 = time.perf_counter()
        m = train_small_llama(tok, train, seed=seed, steps=args.train_steps)
        log(f"  trained in {time.perf_counter() - t0:.0f} s")
        acts[f"seed{seed}"] = trace(m, held, progress=False)
    log(f"layer matching over {len(acts)} seeds, {int(acts['seed0']['mask'].sum())} held-out tokens")
    t0 = time.perf_counter()
    out = layer_matching(acts, tau=ITDA_TAU, l0=ITDA_L0, min_pos=MIN_POS)
    results["small_llama_seeds"] = {**matching_result(out), "seconds": time.perf_counter() - t0,
                                    "train_steps": args.train_steps, "n_layers": 6, "d_model": 64}
    log(f"  accuracy {results['small_llama_seeds']['accuracy']}")
    write_summary("matching", results)
    # (b) SmolLM2 and a lightly fine-tuned copy
    base = load_model(DEFAULT_MODEL)
    sm_prompts = corpus_prompts(base.tokenizer)
    sm_train, sm_held = split(sm_prompts)
    log(f"fine-tuning SmolLM2 for {args.ft_steps} steps")
    ft = finetuned_copy(base, sm_train, steps=args.ft_steps, lr=args.ft_lr)
    held_sm = sm_held[: args.smollm_prompts]
    log(f"tracing {len(held_sm)} held-out prompts through both")
    sm_acts = {"smollm2": trace(base, held_sm, progress=True), "smollm2-ft": trace(ft, held_sm, progress=True)}
    t0 = time.perf_counter()
    out = layer_matching(sm_acts, tau=ITDA_TAU, l0=ITDA_L0, min_pos=MIN_POS)
    results["smollm2_finetuned"] = {**matching_result(out), "seconds": time.perf_counter() - t0,
                                    "ft_steps": args.ft_steps, "ft_lr": args.ft_lr}
    log(f"  accuracy {results['smollm2_finetuned']['accuracy']}")
    write_summary("matching", results)


# -- part 3: sanity checks -----------------------------------------------------------------------------

def table_rows(ds: Any, *, every_unit: bool) -> list[dict[str, Any]]:
    rows = []
    for m in ds["metric"].values:
        row = {"metric": str(m), "passed": bool(ds["passed_both"].sel(metric=m)),
               "mean_score": float(np.nanmean(ds["score"].sel(metric=m).values))}
        for t in ("missing_labels", "extra_labels"):
            if every_unit:
                row[t] = [float(v) for v in ds["decrease_accuracy"].sel(test=t, metric=m).values]
            else:
                row[t] = float(ds["pooled_decrease_accuracy"].sel(test=t, metric=m))
            row[f"{t}_mean_delta"] = float(np.nanmean(ds["mean_delta"].sel(test=t, metric=m).values))
        rows.append(row)
    return rows


def smollm2_atoms(args: argparse.Namespace):
    """SmolLM2's ITDA at ITDA_LAYER fitted on the training prompts, and the held-out
    activations the sanity checks and the meta-evaluation probe it on."""
    from explorer import ActivationStore, load_model
    from explorer.analyses.itda import ITDA, cached_activations

    model = load_model(DEFAULT_MODEL)
    prompts = corpus_prompts(model.tokenizer)[: args.itda_prompts]
    train, held = split(prompts)
    store = ActivationStore()
    acts_train = cached_activations(model, train, layers=[ITDA_LAYER], store=store)
    acts_held = cached_activations(model, held, layers=[ITDA_LAYER], store=store)
    itda = ITDA(tau=ITDA_TAU, l0=ITDA_L0).fit(acts_train, layer=ITDA_LAYER, min_pos=MIN_POS)
    return itda, acts_held


def part_sanity(args: argparse.Namespace) -> None:
    from explorer.analyses.neuron_eval import itda_atom_sanity_checks, synthetic_sanity_checks

    log("synthetic sanity checks")
    t0 = time.perf_counter()
    syn = synthetic_sanity_checks(n_inputs=args.synthetic_inputs, n_seeds=args.synthetic_seeds)
    result: dict[str, Any] = {"synthetic": {
        "n_inputs": args.synthetic_inputs, "n_seeds": args.synthetic_seeds,
        "frequencies": [float(f) for f in syn["frequency"].values], "seconds": time.perf_counter() - t0,
        "rows": table_rows(syn, every_unit=True)}}
    log(f"  {time.perf_counter() - t0:.0f} s; passed: "
        f"{[r['metric'] for r in result['synthetic']['rows'] if r['passed']]}")
    itda, acts_held = smollm2_atoms(args)
    log(f"real units: {itda.n_atoms} atoms, probing on {int(acts_held['mask'].sum())} held-out tokens")
    t0 = time.perf_counter()
    real = itda_atom_sanity_checks(itda, acts_held, layer=ITDA_LAYER, min_count=args.min_count,
                                   max_units=args.max_units, n_seeds=args.real_seeds, alpha=args.alpha,
                                   min_pos=MIN_POS)
    result["smollm2_atoms"] = {
        "layer": ITDA_LAYER, "tau": ITDA_TAU, "n_units": int(real.sizes["unit"]),
        "n_inputs": int(real.attrs["n_inputs"]), "n_seeds": args.real_seeds, "alpha": args.alpha,
        "min_count": args.min_count, "seconds": time.perf_counter() - t0,
        "rows": table_rows(real, every_unit=False),
        "median_concept_count": float(np.median(real["n_concept"].values))}
    log(f"  {real.sizes['unit']} units; passed: "
        f"{[r['metric'] for r in result['smollm2_atoms']['rows'] if r['passed']]}")
    fam = itda_atom_sanity_checks(itda, acts_held, layer=ITDA_LAYER, explanation="token_family",
                                  min_count=args.min_count, max_units=args.max_units, n_seeds=args.real_seeds,
                                  alpha=args.alpha, min_pos=MIN_POS)
    names, counts = np.unique(fam["explanation"].values, return_counts=True)
    result["smollm2_atoms_family"] = {
        "layer": ITDA_LAYER, "tau": ITDA_TAU, "n_units": int(fam.sizes["unit"]),
        "units_per_family": {str(n): int(c) for n, c in zip(names, counts)},
        "n_inputs": int(fam.attrs["n_inputs"]), "n_seeds": args.real_seeds, "alpha": args.alpha,
        "rows": table_rows(fam, every_unit=False)}
    log(f"  token families {result['smollm2_atoms_family']['units_per_family']}; passed: "
        f"{[r['metric'] for r in result['smollm2_atoms_family']['rows'] if r['passed']]}")
    write_summary("sanity", result)


def _meta_rows(over) -> dict[str, dict[str, float]]:
    """Per metric: the mean meta-AUPRC over unit splits and its percentile interval."""
    return {str(m): {"mean": round(float(over.meta_auprc_mean.sel(metric=m)), 4),
                     "low": round(float(over.meta_auprc_low.sel(metric=m)), 4),
                     "high": round(float(over.meta_auprc_high.sel(metric=m)), 4)}
            for m in over.metric.values}


def part_meta(args: argparse.Namespace) -> None:
    """Known-unit meta-AUPRC on two unit sets of SmolLM2's layer-15 residual: ITDA atoms
    explained by their own source token (the easy set) and logistic-regression probes
    explained by the token category they were trained on (a learned direction, a concept
    of many tokens); each over ``--meta-splits`` validation / test splits of the units."""
    from functools import partial

    from explorer.analyses.neuron_meta import (itda_known_atom_meta_auprc,
                                               meta_auprc_over_splits,
                                               probe_known_unit_meta_auprc)

    itda, acts_held = smollm2_atoms(args)
    result: dict[str, Any] = {"layer": ITDA_LAYER, "tau": ITDA_TAU, "n_splits": args.meta_splits}
    t0 = time.perf_counter()
    atoms = partial(itda_known_atom_meta_auprc, itda, acts_held, layer=ITDA_LAYER,
                    min_count=args.min_count, max_units=args.max_units, min_pos=MIN_POS)
    one = atoms(seed=0)
    over = meta_auprc_over_splits(atoms, n_splits=args.meta_splits)
    result["atoms"] = {
        "min_count": args.min_count,
        **{k: one.attrs[k] for k in ("n_units", "n_test_units", "n_concepts", "chance",
                                     "n_inputs")},
        "chance_mean": round(float(over.chance.mean()), 4),
        "meta_auprc": _meta_rows(over), "seconds": time.perf_counter() - t0}
    log(f"atoms: {result['atoms']['n_units']} units, {result['atoms']['n_concepts']} concepts")
    t0 = time.perf_counter()
    probes = partial(probe_known_unit_meta_auprc, acts_held, layer=ITDA_LAYER, min_pos=MIN_POS)
    one = probes(seed=0)
    over = meta_auprc_over_splits(probes, n_splits=args.meta_splits)
    result["probes"] = {
        "concepts": list(one.attrs["concepts"]),
        "probes_per_concept": int(one.attrs["probes_per_concept"]),
        **{k: one.attrs[k] for k in ("n_units", "n_test_units", "n_concepts", "chance",
                                     "n_inputs")},
        "chance_mean": round(float(over.chance.mean()), 4),
        "meta_auprc": _meta_rows(over), "seconds": time.perf_counter() - t0}
    log(f"probes: {result['probes']['n_units']} units over {result['probes']['concepts']}")
    write_summary("meta", result)


# -- part 4: streaming ----------------------------------------------------------------------------------

def part_streaming(args: argparse.Namespace) -> None:
    import tracemalloc

    from explorer import ActivationStore, load_model
    from explorer.analyses.itda import ITDA, cached_activations

    model = load_model("tiny-llama")
    base = corpus_prompts(model.tokenizer, max_tokens=120)
    rng = np.random.default_rng(0)
    prompts, n = [], 0
    while n < args.stream_tokens:                 # the corpus in shuffled sentence orders
        for p in rng.permutation(len(base)):
            prompts.append(base[p])
            n += len(model.tokenizer(base[p], add_special_tokens=False)["input_ids"])
            if n >= args.stream_tokens:
                break
    store = ActivationStore()
    log(f"tracing {len(prompts)} prompts ({n} tokens) of {model.spec.name} into the store")
    t0 = time.perf_counter()
    acts = cached_activations(model, prompts, layers=[1], store=store, batch_size=64,
                              chunk_prompts=args.stream_chunk_prompts, progress=False)
    trace_s = time.perf_counter() - t0
    trace_rss = peak_rss_mb()
    stored_mb = sum(a["resid_post"].nbytes for a in acts) / 2**20
    n_chunks = sum(len(a["resid_post"].chunks[0]) for a in acts)
    log(f"  {trace_s:.0f} s; {stored_mb:.0f} MiB of activations in {n_chunks} chunks; ITDA, streamed")
    tracemalloc.start()
    t0 = time.perf_counter()
    itda = ITDA(tau=args.stream_tau, l0=ITDA_L0, batch_size=1024).fit(acts, layer=1)
    fit_s = time.perf_counter() - t0
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    log(f"  {itda.n_tokens_seen_} tokens -> {itda.n_atoms} atoms in {fit_s:.0f} s; "
        f"peak traced memory {peak / 2**20:.0f} MiB")
    write_summary("streaming", {
        "model": model.spec.name, "layer": 1, "tau": args.stream_tau, "l0": ITDA_L0,
        "n_tokens": int(itda.n_tokens_seen_), "n_atoms": itda.n_atoms, "stored_mib": stored_mb,
        "n_chunks": n_chunks, "n_store_entries": len(acts), "trace_seconds": trace_s, "fit_seconds": fit_s,
        "peak_traced_mib_during_fit": peak / 2**20, "peak_rss_mib_after_trace": trace_rss,
        "peak_rss_mib": peak_rss_mb(),
        "growth": itda.growth_[:: max(1, len(itda.growth_) // 50)].tolist()})


# -- part 5: figures -----------------------------------------------------------------------------------

def render_png(obj: Any, path: Path, *, width: int = 1100, height: int = 500) -> None:
    """Render a HoloViews object to PNG without its toolbar (see benchmarks/_figures.py)."""
    import holoviews as hv

    if isinstance(obj, hv.Layout):
        obj = obj.opts(toolbar=None)
    else:
        obj = obj.opts(responsive=False, width=width, height=height, toolbar=None)
    _figures.render_png(obj, path, width=width, height=height, settle_ms=800)
    log(f"  wrote {path.relative_to(ROOT)}")


def part_figures(args: argparse.Namespace) -> None:
    import holoviews as hv
    import pandas as pd
    import xarray as xr

    from apps import theme
    from apps.itda import plot_similarity, plot_tau_curves

    hv.extension("bokeh", logo=False)
    summary = read_summary()
    if "itda" in summary:
        rows = summary["itda"]["tau_sweep"]
        sweep = xr.Dataset({k: ("tau", [r[k] for r in rows]) for k in ("n_atoms", "mean_error", "mean_l0", "fve")},
                           coords={"tau": [r["tau"] for r in rows]})
        curves = plot_tau_curves(sweep, ITDA_TAU)
        render_png(hv.Layout([c.opts(responsive=False, width=360, height=260) for c in curves]).cols(3),
                   FIGURES / "representations_tau_sweep.png", width=1150, height=300)
        comps = [summary["itda"]["comparison"], *summary["itda"].get("more_comparisons", [])]
        rows_t = []
        for c in comps:
            label = (f"tau {c['tau']:g}, {c['itda_atoms']} atoms/latents"
                     + ("" if c["sae_reached_target"] else " (SAE stopped at 600 s, not there)"))
            rows_t.append({"setting": label, "method": "ITDA", "seconds": c["itda_seconds"],
                           "held-out error": c["itda_heldout_error"]})
            rows_t.append({"setting": label, "method": "SAE", "seconds": c["sae_seconds"],
                           "held-out error": c["sae_heldout_error"]})
        df = pd.DataFrame(rows_t)
        ratios = ", ".join(f"tau {c['tau']:g}: {c['time_ratio_itda_over_sae']:.3f}" for c in comps)
        bars = hv.Bars(df, ["setting", "method"], ["seconds", "held-out error"]).opts(
            color="method", cmap=[theme.CATEGORICAL[0], theme.CATEGORICAL[1]],
            ylabel="wall seconds to the ITDA's held-out error", xlabel="",
            title=f"SmolLM2 layer {summary['itda']['layer']}: ITDA vs TopK SAE (time ratio {ratios})",
            width=900, height=360, show_legend=True, tools=["hover"], multi_level=True)
        render_png(bars, FIGURES / "representations_itda_vs_sae.png", width=900, height=360)
    if "matching" in summary:
        for key, names in (("small_llama_seeds", ("seed0", "seed1")), ("smollm2_finetuned", ("smollm2", "smollm2-ft"))):
            if key not in summary["matching"]:
                continue
            res = summary["matching"][key]
            panels = []
            for method, sim in res["similarity"].items():
                s = np.array(sim)
                layers = np.arange(s.shape[0])
                matched = np.array([int(np.argmax(r)) for r in s])
                ds = xr.Dataset({"similarity": (("layer_a", "layer_b"), s),
                                 "matched_layer": ("layer_a", matched), "matched": ("layer_a", matched == layers)},
                                coords={"layer_a": layers, "layer_b": layers},
                                attrs={"method": method, "model_a": names[0], "model_b": names[1]})
                panels.append(plot_similarity(ds).opts(responsive=False, width=420, height=380,
                                                       title=f"{method}: accuracy {res['accuracy'][method]:.0%}"))
            render_png(hv.Layout(panels).cols(3), FIGURES / f"representations_matching_{key}.png",
                       width=1300, height=400)
    if "sanity" in summary:
        rows = []
        for setting, label in (("synthetic", "synthetic"), ("smollm2_atoms", "atoms/own token"),
                               ("smollm2_atoms_family", "atoms/token family")):
            if setting not in summary["sanity"]:
                continue
            for r in summary["sanity"][setting]["rows"]:
                for t in ("missing_labels", "extra_labels"):
                    v = r[t]
                    v = min(v) if isinstance(v, list) else v
                    rows.append({"metric": r["metric"], "test": f"{label}: {t.replace('_', ' ')}",
                                 "decrease accuracy": v})
        df = pd.DataFrame(rows)
        heat = hv.HeatMap(df, ["test", "metric"], "decrease accuracy").opts(
            cmap=theme.MAGNITUDE_CMAP, clim=(0, 1), colorbar=True, xrotation=15, invert_yaxis=True,
            title="Decrease accuracy of each metric (pass: > 90% on both tests)", tools=["hover"])
        colors = theme.text_colors(df["decrease accuracy"].tolist(), theme.MAGNITUDE_CMAP)
        labels = hv.Labels(df.assign(text=[f"{v:.0%}" for v in df["decrease accuracy"]], color=colors),
                           ["test", "metric"], ["text", "color"]).opts(text_font_size="9pt", text_color="color")
        render_png(heat * labels, FIGURES / "representations_sanity_table.png", width=1100, height=560)
    if args.pages:
        page_screenshots(args)


def page_screenshots(args: argparse.Namespace) -> None:
    """Screenshots of both pages, served with SmolLM2."""
    from apps import theme
    from apps._session import get_model
    from apps.itda import ITDAView
    from apps.neuron_eval import NeuronEvalView

    model = get_model(args.page_model)
    pages = {"itda": lambda: theme.page([ITDAView(model)], title="Explorer: ITDA dictionaries"),
             "neuron": lambda: theme.page([NeuronEvalView(model)],
                                          title="Explorer: evaluating neuron explanations")}
    shadow_text = """el => el.shadowRoot
        ? Array.from(el.shadowRoot.children).filter(c => !['STYLE', 'LINK'].includes(c.tagName))
            .map(c => c.innerText).join(' ')
        : el.innerText"""
    with browser_on_pages(pages) as (url, browser):
        for slug, ready, done in (("itda", ".itda-summary", r"atoms from"),
                                  ("neuron", ".neuron-score-table", r"Unit: atom")):
            page = browser.new_page(viewport={"width": 1500, "height": 1900 if slug == "itda" else 1500})
            page.goto(f"{url}/{slug}", timeout=120_000)
            page.wait_for_selector(ready, state="attached", timeout=600_000)
            for _ in range(900):                       # wait for the first result
                if re.search(done, page.locator(ready).first.evaluate(shadow_text)):
                    break
                page.wait_for_timeout(1000)
            page.wait_for_timeout(4000)
            page.screenshot(path=str(FIGURES / f"representations_{slug}_page.png"), full_page=True)
            log(f"  wrote docs/figures/representations_{slug}_page.png")
            page.close()

PARTS = {"itda": part_itda, "matching": part_matching, "sanity": part_sanity, "meta": part_meta,
         "streaming": part_streaming, "figures": part_figures}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--part", action="append", choices=list(PARTS), help="part to run (repeatable)")
    add_number_options(p, threads=1)
    p.add_argument("--itda-prompts", type=int, default=120, help="corpus prompts for the SmolLM2 ITDA")
    add_number_options(p, sae_seconds=900.0, sae_lr=1e-3, ce_prompts=8)
    p.add_argument("--extra-taus", type=float, nargs="*", default=[0.05],
                   help="more ITDA-vs-SAE comparisons at these taus (no CE loss)")
    add_number_options(p, seeds=3, train_steps=800, match_prompts=60, ft_steps=20, ft_lr=2e-5,
                          smollm_prompts=24, synthetic_inputs=100_000, synthetic_seeds=100,
                          real_seeds=50, min_count=3, max_units=300)
    p.add_argument("--meta-splits", type=int, default=20,
                   help="with --part meta: validation / test splits of the units")
    add_number_options(p, alpha=0.01, stream_tokens=1_000_000, stream_tau=0.2,
                          stream_chunk_prompts=1000)
    p.add_argument("--pages", action="store_true", help="with --part figures: screenshot both pages")
    p.add_argument("--page-model", default=DEFAULT_MODEL)
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    for part in args.part or ["itda", "matching", "sanity"]:
        log(f"== {part}")
        PARTS[part](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
