"""A logit-lens slider drag and release in one process, without a browser: per release the
wall and CPU time from the release to the exact result on the page, and the moves' time to
their drawn preview.

The lens page (`apps.lens.LensView`, computing in a worker thread as served) on ``--model``
with a ``--tokens``-token prompt, torch at ``--threads``: ``--drags`` drags of ``--moves``
moves of the steering-strength slider (one step each, ``--pause`` seconds after each drawn
preview, alternating direction), each ended by a release. The release's CPU time is the
process's (every thread), so a run whose threads spin-wait shows it.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/lens_release.py [--threads 2] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from explorer.commands._common import add_number_options  # noqa: E402
from explorer.defaults import DEFAULT_MODEL  # noqa: E402


def _until(predicate, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            return False
        time.sleep(0.005)
    return True


def measure(*, model: str, threads: int, tokens: int, drags: int, moves: int,
            pause: float) -> dict:
    import param
    import torch

    import explorer
    from apps.lens import LensView
    from explorer.bench import text_prompts

    torch.set_num_threads(threads)
    m = explorer.load_model(model)
    view = LensView(m, prompt=text_prompts(m, 1, tokens)[0], k=5, background=True)
    view._runners["run"].wait(600)
    _until(lambda: not view._slot.busy, 60)          # the warm-up preview
    slider = view.alpha_slider()
    step = view.param.alpha.step
    out: dict = {"release_ms": [], "release_cpu_ms": [], "move_ms": []}
    alpha = 0.0
    try:
        for d in range(drags):
            for _ in range(moves):
                alpha += step if d % 2 == 0 else -step
                drawn = len(view.preview_timings)
                t = time.perf_counter()
                slider.value = alpha
                if _until(lambda: len(view.preview_timings) > drawn, 30):
                    out["move_ms"].append(round(1e3 * (time.perf_counter() - t), 1))
                _until(lambda: not view._slot.busy, 30)
                time.sleep(pause)
            before = view.result
            t, cpu = time.perf_counter(), time.process_time()
            with param.parameterized.edit_constant(slider):
                slider.param.update(value=alpha, value_throttled=alpha)
            _until(lambda: view.result is not before and view.preview is None, 300)
            out["release_ms"].append(round(1e3 * (time.perf_counter() - t), 1))
            out["release_cpu_ms"].append(round(1e3 * (time.process_time() - cpu), 1))
            _until(lambda: not view._slot.busy, 60)
            time.sleep(pause)
    finally:
        view.close()
    out.update(release_p50_ms=statistics.median(out["release_ms"]),
               release_cpu_p50_ms=statistics.median(out["release_cpu_ms"]),
               move_p50_ms=statistics.median(out["move_ms"]) if out["move_ms"] else None,
               steer_layer=view.steer_layer, threads=threads, tokens=tokens, model=model,
               load=[round(x, 2) for x in os.getloadavg()])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    add_number_options(ap, threads=2, tokens=16, drags=3, moves=6, pause=0.3)
    ap.add_argument("--json", help="write the result here as JSON")
    args = ap.parse_args()
    result = measure(model=args.model, threads=args.threads, tokens=args.tokens,
                     drags=args.drags, moves=args.moves, pause=args.pause)
    text = json.dumps(result, indent=1)
    if args.json:
        Path(args.json).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
