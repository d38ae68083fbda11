"""`explorer neuron-eval` (flags, parsing and printing over `explorer.analyses.neuron_eval`):
the missing-labels and extra-labels sanity checks of every metric, on synthetic units or on
ITDA atoms of a model, as a pass/fail table.
"""
from __future__ import annotations

import argparse
from typing import Any

import xarray as xr

from explorer._checks import InputError, check_int
from explorer.analyses.neuron_eval import ATOM_EXPLANATIONS, SANITY_TESTS, itda_atom_sanity_checks
from explorer.analyses.neuron_eval import synthetic_sanity_checks
from explorer.commands._common import add_command, load_cli_model, print_json, read_prompts


def register_cli(subparsers: Any) -> None:
    """Add ``explorer neuron-eval``: the sanity-check pass/fail table."""
    p = add_command(
        subparsers, "neuron-eval", _cmd_neuron_eval, paper="neuron-eval",
        help="neuron-explanation metrics: sanity-check pass/fail table (Oikarinen et al. 2025)",
        description="Run the missing-labels and extra-labels sanity checks on every metric of the "
                    "unified framework: on synthetic units (--synthetic, the paper's theoretical "
                    "test) or on ITDA atoms of a model explained by their own tokens.")
    p.add_argument("--synthetic", action="store_true", help="the theoretical test (no model)")
    p.add_argument("--n-inputs", type=int, default=100_000, help="synthetic inputs (default: 100000)")
    p.add_argument("--frequencies", default="0.499,0.1,0.01,0.001,0.0001",
                   help="synthetic activation frequencies (default: 0.499,0.1,0.01,0.001,0.0001)")
    p.add_argument("--prompts", metavar="FILE", help="probing prompts, one per line (real units)")
    p.add_argument("--layer", type=int, help="layer of the ITDA atoms (real units)")
    p.add_argument("--tau", type=float, default=0.3, help="ITDA tau (default: 0.3)")
    p.add_argument("--alpha", type=float, default=0.01, help="top fraction counted active (default: 0.01)")
    p.add_argument("--seeds", type=int, default=100, help="perturbation seeds (default: 100)")
    p.add_argument("--epsilon", type=float, default=1e-3, help="decrease tolerance (default: 0.001)")
    p.add_argument("--explanation", default="own_token", choices=ATOM_EXPLANATIONS,
                   help="real units: atom explained by its own token or its token family")
    p.add_argument("--min-pos", type=int, default=1,
                   help="real units: leave out positions below this (default: 1, the attention sink)")


def _table(ds: xr.Dataset) -> list[dict[str, Any]]:
    """One row per metric: decrease accuracy on both tests and whether it passes each."""
    rows = []
    for m in ds["metric"].values:
        rows.append({
            "metric": str(m),
            "missing_labels": float(ds["pooled_decrease_accuracy"].sel(test="missing_labels", metric=m)),
            "extra_labels": float(ds["pooled_decrease_accuracy"].sel(test="extra_labels", metric=m)),
            "passed_missing": bool(ds["passed"].sel(test="missing_labels", metric=m)),
            "passed_extra": bool(ds["passed"].sel(test="extra_labels", metric=m)),
            "passed": bool(ds["passed_both"].sel(metric=m)),
        })
    return rows


def _cmd_neuron_eval(args: argparse.Namespace) -> int:
    check_int("--seeds", args.seeds, low=1)
    if args.synthetic:
        try:
            freqs = [float(f) for f in args.frequencies.split(",") if f.strip()]
        except ValueError:
            raise InputError(f"`--frequencies` must be comma-separated numbers; got {args.frequencies!r}.") from None
        ds = synthetic_sanity_checks(frequencies=freqs, n_inputs=args.n_inputs, n_seeds=args.seeds,
                                     epsilon=args.epsilon)
        result: dict[str, Any] = {"units": "synthetic", "n_inputs": args.n_inputs, "frequencies": freqs,
                                  "seeds": args.seeds, "rule": "every frequency > 90% on both tests"}
        table = _table(ds)
        for row in table:
            m = row["metric"]
            row["per_frequency"] = {
                test: [float(v) for v in ds["decrease_accuracy"].sel(test=test, metric=m).values]
                for test in SANITY_TESTS}
    else:
        if args.prompts is None or args.layer is None:
            raise InputError("pass --synthetic, or --prompts FILE and --layer N for real units.")

        from explorer.analyses.itda import ITDA, cached_activations

        prompts = read_prompts(args.prompts)
        model = load_cli_model(args)
        layer = model.check_layer(args.layer)
        acts = cached_activations(model, prompts, layers=[layer])
        half = max(1, len(prompts) // 2)
        build, probe = acts.isel(prompt=slice(0, half)), acts.isel(prompt=slice(half, None))
        if probe.sizes["prompt"] == 0:
            raise InputError("real units need at least 2 prompts (one half builds, one half probes).")
        min_pos = check_int("--min-pos", args.min_pos, low=0)
        itda = ITDA(tau=args.tau, l0=8).fit(build, layer=layer, min_pos=min_pos)
        ds = itda_atom_sanity_checks(itda, probe, layer=layer, n_seeds=args.seeds, epsilon=args.epsilon,
                                     alpha=args.alpha, explanation=args.explanation, min_pos=min_pos)
        result = {"units": f"itda_atoms ({args.explanation})", "model": model.spec.name, "layer": layer,
                  "n_units": int(ds.sizes["unit"]), "n_inputs": int(ds.attrs["n_inputs"]),
                  "seeds": args.seeds, "rule": "pooled decrease accuracy > 90% on both tests"}
        table = _table(ds)
    result["table"] = table
    if args.json:
        print_json(result)
        return 0
    print(f"sanity checks ({result['units']}, {args.seeds} seeds; {result['rule']})")
    print(f"{'metric':<28}{'missing':>9}{'extra':>9}  result")
    for row in table:
        print(f"{row['metric']:<28}{100 * row['missing_labels']:>8.1f}%{100 * row['extra_labels']:>8.1f}%  "
              f"{'pass' if row['passed'] else 'FAIL'}")
    return 0
