"""`explorer features` (flags, parsing and printing over
`explorer.analyses.feature_dashboards`): a dictionary trained on the shipped corpus (cached in
the activation store), one feature's dashboard, or the features found by a token.
"""
from __future__ import annotations

from typing import Any

from explorer.commands._common import add_command, load_cli_model, print_summary


def register_cli(subparsers: Any) -> None:
    """Add ``explorer features``."""
    p = add_command(
        subparsers, "features", _cmd_features,
        help="feature dashboards of an ITDA dictionary or a TopK SAE",
        description="Train (once; then read from the activation cache) a dictionary on the "
                    "shipped corpus at one layer's residual stream and show a feature's top "
                    "contexts, activation histogram and logit effects, or find features by a "
                    "token they fire on or promote.")
    p.add_argument("--kind", default="itda", choices=("itda", "sae"), help="dictionary kind")
    p.add_argument("--layer", type=int, default=None, help="layer (default: the middle one)")
    p.add_argument("--corpus-tokens", type=int, default=2048,
                   help="corpus tokens to train on (default 2048)")
    p.add_argument("--tau", type=float, default=0.3, help="ITDA's tau (default 0.3)")
    p.add_argument("--n-latents", type=int, default=1024, help="SAE latents (default 1024)")
    p.add_argument("--feature", type=int, default=0, help="the feature shown (default 0)")
    p.add_argument("--query", default=None, help="find features by this token instead")


def _cmd_features(args: Any) -> int:
    from explorer.analyses import feature_dashboards as F
    from explorer.analyses.saturation.corpus import corpus_chunks, load_corpus

    model = load_cli_model(args)
    layer = model.spec.n_layers // 2 if args.layer is None else model.check_layer(args.layer)
    settings: dict[str, Any] = {"kind": args.kind, "layer": layer}
    if args.kind == "itda":
        settings.update(tau=args.tau, l0=8)
    else:
        settings.update(n_latents=args.n_latents, k=16, max_epochs=10)
    texts = corpus_chunks(model, load_corpus(), chunk_tokens=128, max_tokens=args.corpus_tokens)
    index, cached = F.cached_feature_index(model, texts, **settings)
    out: dict[str, Any] = {"model": model.spec.name, "kind": args.kind, "layer": layer,
                           "n_features": int(index.sizes["feature"]),
                           "n_tokens": int(index.attrs["n_tokens"]), "cached": cached}
    if args.query is not None:
        found = F.search_features(model, index, args.query)
        out["query"] = args.query
        for how in found.how.values.tolist():
            row = found.sel(how=how)
            out[how.replace(" ", "_")] = [{"feature": int(f), "score": float(s)} for f, s in
                                          zip(row.feature.values, row.score.values) if f >= 0]
    else:
        top = F.top_activating_contexts(index, args.feature, k=10)
        hist = F.feature_histogram(index, args.feature)
        eff = F.feature_logit_effects(model, index, args.feature)
        out.update(feature=args.feature, n_active=hist.attrs["n_active"], contexts=[
            {"activation": float(top.activation[r]), "text": "".join(
                f"[{t}]" if o == 0 else t for o, t in
                zip(top.offset.values.tolist(), top.context_token.values[r].tolist()))}
            for r in range(top.sizes["rank"])],
            promoted=eff.promoted_token.values.tolist(),
            suppressed=eff.suppressed_token.values.tolist())
    print_summary(out, as_json=args.json)
    return 0
