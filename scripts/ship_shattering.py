"""Regenerate the representation-shattering page's shipped result: datasets/shattering/.

Trains (or reads from the cache) the knowledge-graph transformer with the default settings
(`explorer.analyses.shattering.DEFAULTS`, seed 0: 12,000 steps, about 6 minutes of one CPU
thread), writes its weights as ``knowledge_model_seed0.safetensors`` and the page's R vs
accuracy-drop sweep of it (`apps.shattering.SWEEP_EDITS` ROME edits at block 0, sweep seed 0)
as ``edit_sweep_seed0.json``, so that the page opens on them at once instead of training
first. ``tests/test_shattering.py`` checks that a short retraining and a recomputation of
two edits match the files.

    python scripts/ship_shattering.py            # use the cached default model if there is one
    python scripts/ship_shattering.py --retrain  # train it again first
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--retrain", action="store_true", help="train again even if the cache has the model")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default: 1)")
    args = p.parse_args(argv)

    import torch

    from apps.shattering import SHIPPED_MODEL, SHIPPED_SWEEP, SWEEP_EDITS, save_shipped_sweep
    from explorer.analyses import shattering as sh

    torch.set_num_threads(args.threads)
    started = time.perf_counter()

    def progress(done: int, total: int) -> None:
        if done % 1000 == 0:
            print(f"step {done}/{total} ({time.perf_counter() - started:.0f} s)", flush=True)

    km = sh.knowledge_model(retrain=args.retrain, progress=progress, **sh.DEFAULTS)
    sh.save_knowledge_model(km, SHIPPED_MODEL)
    print(f"{SHIPPED_MODEL.relative_to(ROOT)}: trained in {km.train_seconds:.0f} s, "
          f"weights {km.weights_sha256()}", flush=True)
    sweep = sh.edit_sweep(km, n_edits=SWEEP_EDITS, method="rome", layer=0, seed=0)
    save_shipped_sweep(sweep, km, SHIPPED_SWEEP)
    print(f"{SHIPPED_SWEEP.relative_to(ROOT)}: {SWEEP_EDITS} edits, r2 = {sweep.attrs['r2']:.3f} "
          f"({time.perf_counter() - started:.0f} s in all)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
