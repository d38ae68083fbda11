"""`explorer itda` (flags, parsing and printing over `explorer.analyses.itda`): build an ITDA
dictionary over prompts at one site and layer and report its measures, optionally per tau,
the downstream loss and the comparison with a TopK SAE.
"""
from __future__ import annotations

import argparse
from typing import Any

from explorer._checks import InputError, check_float, check_int
from explorer.analyses.itda import ENCODERS, ITDA, cached_activations, itda_downstream_loss
from explorer.analyses.itda import itda_reconstruction, itda_tau_sweep, itda_vs_sae
from explorer.commands._common import add_command, add_scheduler_option, load_cli_model
from explorer.commands._common import print_json
from explorer.commands._common import read_prompts


def register_cli(subparsers: Any) -> None:
    """Add ``explorer itda``: build a dictionary over prompts and report its measures."""
    p = add_command(
        subparsers, "itda", _cmd_itda, paper="itda",
        help="ITDA dictionary of one layer: size, error, L0, FVE (Leask et al. 2025)",
        description="Build an ITDA dictionary over the activations of prompts at one site and "
                    "layer; report its size, reconstruction error, L0 and fraction of variance "
                    "explained, optionally per tau, the downstream loss and the SAE comparison.")
    p.add_argument("--prompts", required=True, metavar="FILE",
                   help="text file with one prompt per line, or - for stdin")
    p.add_argument("--layer", type=int, required=True, help="layer to decompose")
    p.add_argument("--site", default="resid_post", help="site (default: resid_post)")
    p.add_argument("--tau", type=float, default=0.3, help="error threshold for a new atom (default: 0.3)")
    p.add_argument("--taus", metavar="LIST", help="comma-separated taus for a sweep, e.g. 0.1,0.3,0.5")
    p.add_argument("--l0", type=int, default=8, help="matching-pursuit steps (default: 8)")
    p.add_argument("--encoder", default="mp", choices=ENCODERS, help="mp (default) or omp")
    p.add_argument("--downstream", action="store_true",
                   help="also measure the next-token loss with the reconstruction spliced in")
    p.add_argument("--sae", action="store_true", help="also train a TopK SAE to the same error")
    p.add_argument("--min-pos", type=int, default=1,
                   help="leave out positions below this (default: 1, the attention-sink first token)")
    p.add_argument("--top", type=int, default=10, help="atoms listed (default: 10)")
    p.add_argument("--chunk-prompts", type=int, metavar="N",
                   help="trace and store N prompts per cache entry; the build streams the "
                        "entries one stored chunk at a time (default: one entry)")
    second = p.add_mutually_exclusive_group()
    second.add_argument("--compare-model", metavar="NAME_OR_PATH",
                        help="compare every layer with this second model's on the same prompts "
                             "(another checkpoint or a fine-tuned copy: same tokenizer, same "
                             "number of layers), the paper's cross-model similarity")
    second.add_argument("--compare-noise", type=float, metavar="S",
                        help="compare with a copy of --model whose weights get relative "
                             "Gaussian noise S (a stand-in second model, not a trained one)")
    p.add_argument("--similarity", default="itda", choices=("itda", "cka", "svcca"),
                   help="layer similarity of the comparison: itda (Jaccard index of the atom "
                        "labels, the paper's), cka or svcca (default: %(default)s)")
    add_scheduler_option(p)


def _cmd_itda(args: argparse.Namespace) -> int:
    from explorer.distributed import dask_scheduler

    # the greedy build is sequential; the scheduler runs the reads of the stored chunks
    with dask_scheduler(args.scheduler):
        return _itda_command(args)


def _second_model(args: argparse.Namespace, model: Any) -> tuple[Any, str]:
    """The model compared with ``model`` and how the output names it."""
    if args.compare_model is not None:
        from explorer.models import load_model

        other = load_model(args.compare_model)
        return other, f"a second model: {other.spec.name}"
    from explorer.analyses.similarity import perturbed_copy

    scale = check_float("--compare-noise", args.compare_noise, low=0.0)
    return (perturbed_copy(model, scale=scale, seed=1),
            f"a copy of {model.spec.name} with relative weight noise {scale:g} (a stand-in, "
            "not a second trained model)")


def _cross_model(args: argparse.Namespace, model: Any, prompts: list[str], min_pos: int
                 ) -> dict[str, Any]:
    """Every layer of ``model`` against every layer of the second model (Leask et al. sec. 5)."""
    from explorer.analyses.similarity import layer_matching_accuracy, layer_similarity
    from explorer.trace import trace

    other, described = _second_model(args, model)
    acts = trace(model, prompts, sites=(args.site,), progress=False)
    other_acts = trace(other, prompts, sites=(args.site,), progress=False)
    sim = layer_similarity(acts, other_acts, method=args.similarity, site=args.site, tau=args.tau,
                           l0=args.l0, min_pos=min_pos)
    matrix = sim["similarity"].values
    square = matrix.shape[0] == matrix.shape[1]
    return {"second_model": described, "similarity": args.similarity,
            "n_tokens": int(sim.attrs["n_tokens"]),
            "matched_layer": sim["matched_layer"].values.tolist(),
            "layer_matching_accuracy": layer_matching_accuracy(matrix) if square else None,
            "diagonal": [float(matrix[i, i]) for i in range(min(matrix.shape))],
            "matrix": matrix.tolist()}


def _itda_command(args: argparse.Namespace) -> int:
    prompts = read_prompts(args.prompts)
    check_float("--tau", args.tau, low=0.0, high=1.0)
    check_int("--l0", args.l0, low=1)
    taus = None
    if args.taus:
        try:
            taus = [float(t) for t in args.taus.split(",") if t.strip()]
        except ValueError:
            raise InputError(f"`--taus` must be comma-separated numbers; got {args.taus!r}.") from None
    min_pos = check_int("--min-pos", args.min_pos, low=0)
    model = load_cli_model(args)
    layer = model.check_layer(args.layer)
    chunk_prompts = None if args.chunk_prompts is None else check_int("--chunk-prompts",
                                                                       args.chunk_prompts, low=1)
    acts = cached_activations(model, prompts, site=args.site, layers=[layer],
                              chunk_prompts=chunk_prompts)
    itda = ITDA(tau=args.tau, l0=args.l0, method=args.encoder).fit(acts, site=args.site, layer=layer,
                                                                    min_pos=min_pos)
    rec = itda_reconstruction(itda, acts, site=args.site, layer=layer, min_pos=min_pos)
    result: dict[str, Any] = {
        "model": model.spec.name, "site": args.site, "layer": layer, "tau": args.tau, "l0": args.l0,
        "min_pos": min_pos,
        "encoder": args.encoder, "n_tokens": int(itda.n_tokens_seen_), "n_atoms": itda.n_atoms,
        "mean_error": float(rec["mean_error"]), "mean_l0": float(rec["mean_l0"]),
        "fve": float(rec["fve"]), "fit_seconds": itda.fit_seconds_,
        "atoms": [{"atom": i, "prompt": int(p), "pos": int(q), "token": str(t)}
                  for i, (p, q, t) in enumerate(zip(itda.atom_prompt_[: args.top],
                                                    itda.atom_pos_[: args.top],
                                                    itda.atom_token_[: args.top]))],
    }
    if taus:
        sweep = itda_tau_sweep(acts, taus=taus, l0=args.l0, method=args.encoder, site=args.site, layer=layer,
                               min_pos=min_pos)
        result["sweep"] = [{"tau": float(t), "n_atoms": int(sweep["n_atoms"].sel(tau=t)),
                            "mean_error": float(sweep["mean_error"].sel(tau=t)),
                            "mean_l0": float(sweep["mean_l0"].sel(tau=t)),
                            "fve": float(sweep["fve"].sel(tau=t))} for t in sweep["tau"].values]
    if args.downstream:
        if args.site not in ("resid_post", "resid_pre"):
            raise InputError("`--downstream` needs --site resid_post or resid_pre.")
        down = itda_downstream_loss(model, prompts, itda, layer=layer, site=args.site, min_pos=min_pos)
        result["downstream"] = {"loss_clean": float(down["loss_clean"].mean()),
                                "loss_reconstructed": float(down["loss_reconstructed"].mean()),
                                "loss_zero": float(down["loss_zero"].mean()),
                                "ce_loss_score": float(down["ce_loss_score"])}
    if args.sae:
        cmp_ = itda_vs_sae(acts, tau=args.tau, l0=args.l0, method=args.encoder, site=args.site, layer=layer,
                           min_pos=min_pos)
        result["sae"] = {k: {kind: float(cmp_[k].sel(model_kind=kind)) for kind in ("itda", "sae")}
                         for k in ("fit_seconds", "mean_error", "fve", "size")}
        result["sae"]["time_ratio"] = float(cmp_["time_ratio"])
        result["sae"]["sae_reached_target"] = bool(cmp_["sae_reached_target"])
    if args.compare_model is not None or args.compare_noise is not None:
        result["comparison"] = _cross_model(args, model, prompts, min_pos)
    if args.json:
        print_json(result)
        return 0
    print(f"ITDA {model.spec.name} {args.site} layer {layer}: {itda.n_atoms} atoms from "
          f"{itda.n_tokens_seen_} tokens (tau={args.tau}, l0={args.l0}, {args.encoder})")
    print(f"  mean relative error {result['mean_error']:.4f}  mean L0 {result['mean_l0']:.2f}  "
          f"FVE {result['fve']:.4f}  built in {itda.fit_seconds_:.2f} s")
    for row in result.get("sweep", []):
        print(f"  tau {row['tau']:<6g} atoms {row['n_atoms']:<6d} error {row['mean_error']:.4f}  "
              f"L0 {row['mean_l0']:.2f}  FVE {row['fve']:.4f}")
    if "downstream" in result:
        d = result["downstream"]
        print(f"  loss clean {d['loss_clean']:.3f}  reconstructed {d['loss_reconstructed']:.3f}  "
              f"zero-ablated {d['loss_zero']:.3f}  CE loss score {d['ce_loss_score']:.3f}")
    if "sae" in result:
        s = result["sae"]
        print(f"  SAE to the same error: ITDA/SAE time ratio {s['time_ratio']:.3f} "
              f"(SAE reached target: {s['sae_reached_target']})")
    for a in result["atoms"]:
        print(f"  atom {a['atom']:>4}: prompt {a['prompt']} pos {a['pos']} token {a['token']!r}")
    if "comparison" in result:
        c = result["comparison"]
        acc = c["layer_matching_accuracy"]
        print(f"compared with {c['second_model']} ({c['similarity']}, {c['n_tokens']} tokens):")
        if acc is not None:
            print(f"  layer-matching accuracy {acc:.3f} (chance {1 / len(c['diagonal']):.3f})")
        print("  most similar layer of the second model, per layer: "
              + " ".join(str(x) for x in c["matched_layer"]))
    return 0
