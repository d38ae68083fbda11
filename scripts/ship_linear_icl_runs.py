"""Write datasets/dynamics/linear_icl_seed0.safetensors: the Linear ICL page's default runs.

Trains one layer of multi-head softmax attention on in-context linear regression with
`explorer.analyses.linear_icl.DEFAULTS` (seed 0) for every head count in `SHIPPED_HEADS`
(1, 2, 4), in full precision on one thread, rounds the weights to float16, analyses the rounded
weights (`linear_icl_analysis`, 2,048 prompts, as `stored_linear_icl_analysis` does) and writes
runs and analyses into one safetensors file. Prints what float16 changed against the
full-precision analysis. About 3 minutes of one CPU core.

    python scripts/ship_linear_icl_runs.py                       # train, write the shipped file
    python scripts/ship_linear_icl_runs.py --cache /tmp/runs     # keep/reuse the full-precision runs
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    import numpy as np
    import torch

    from explorer.analyses import linear_icl as lin

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=lin.SHIPPED_RUNS, help="file to write")
    p.add_argument("--cache", type=Path, default=None,
                   help="an activation-store folder for the full-precision runs (trained there "
                        "when missing, reused when present); default: train afresh, store nothing")
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # the model is tiny; one thread is fastest and deterministic

    runs, analyses, report = {}, {}, {}
    for H in lin.SHIPPED_HEADS:
        full = {**lin.DEFAULTS, "n_heads": H}
        started = time.perf_counter()
        if args.cache is None:
            run = lin.train_linear_icl(**full)
        else:
            from explorer.store import ActivationStore

            store = ActivationStore(args.cache)
            run = store.get_or_compute(lin.run_key_parts(full), lambda: lin.train_linear_icl(**full)).load()
        trained = time.perf_counter() - started
        rounded = run.copy()
        for name in ("W_Q", "W_K", "W_V", "W_O"):
            rounded[name] = run[name].astype(np.float16).astype(np.float32)
        analyses[H] = lin.linear_icl_analysis(rounded)
        runs[H] = run
        exact = lin.linear_icl_analysis(run)
        report[H] = {
            "train_seconds": round(trained, 1),
            "pattern_step": [exact.attrs["pattern_step"], analyses[H].attrs["pattern_step"]],
            "final_model_loss_at_40": [float(a["baseline_model"].sel(context_length=40))
                                       for a in (exact, analyses[H])],
            "largest_weight_rounding": max(float(np.abs(rounded[n] - run[n]).max())
                                           for n in ("W_Q", "W_K", "W_V", "W_O")),
            "checkpoints_with_other_pattern_flag": int(
                (exact["pattern_reached"].values != analyses[H]["pattern_reached"].values).sum()),
        }
        print(f"H={H}: {json.dumps(report[H])}", flush=True)
    path = lin.save_linear_icl_runs_safetensors(runs, args.out, analyses=analyses)
    print(f"wrote {path} ({path.stat().st_size:,} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
