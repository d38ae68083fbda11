"""How closely the logit lens page's heatmap follows a drag of its steering-strength slider.

Two measurements, one command:

- ``drag``: the gallery on SmolLM2 served in a child process (torch at ``--threads``
  threads, the sidebar prompt a 32-token window of the bench text), opened in headless
  chromium (Playwright, /usr/bin/chromium). After the first lens is drawn, the mouse goes
  down on the steering-strength handle and moves right in ``--step-px`` steps; after each
  move the page is watched (every animation frame) until the heatmap's frame pixels differ
  from those before the move, and the time from the browser's pointer event to that frame
  is recorded (a move not redrawn within ``--timeout`` seconds counts as missing). Then the
  mouse goes up. Reports p50 / p90 / max in ms and the moves missing.
- ``kernel``: ``--processes`` fresh Python processes in a row, each loading SmolLM2 and
  timing the slider preview (`explorer.bench.slider_preview_compute`): the GEMM backend each
  chose and the preview's median ms. Reports whether all chose the same and the spread of
  their medians (max / min).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/slider_drag.py [--threads 2] [--json OUT]

Prints one JSON object (also written to ``--json``), with ``uptime`` before and after.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _figures import CHROMIUM, CHROMIUM_ARGS, ROOT  # noqa: E402  (benchmarks/_figures.py)

from explorer.commands._common import add_number_options  # noqa: E402
from explorer.defaults import DEFAULT_MODEL as MODEL  # noqa: E402

# The lens heatmap's frame: a cheap fingerprint of its pixels (every 3rd pixel of every 3rd
# row, the frame only: a title change does not count as a redraw). The samples are taken by
# drawing the frame at a third of its size, without smoothing, into a small canvas and
# reading that one back. Reading back the whole frame held the browser's main thread 11.2 ms
# a call against 1.5 ms so (median of 25 calls on the lens page at 1400 px, 2026-12-05), on
# every animation frame of the wait: time the redraw being measured had to wait for. Both
# fingerprints changed on each of 6 preview moves of a drag. `fingerprint_ms` in the result.
_FRAME_HASH = """() => {
  const views = [...Bokeh.index.all_views()].filter(v =>
      (v.model.type === 'Figure' || v.model.type === 'Plot') && v.el.isConnected
      && v.el.offsetParent != null && v.model.title != null
      && /Logit lens|PREVIEW/.test(String(v.model.title.text)))
  if (!views.length) return null
  const v = views[0], frame = v.frame.bbox, cv = v.canvas_view
  const canvas = cv.primary.canvas
  const r = canvas.width / Math.max(1, cv.bbox.width)
  const x = Math.floor(frame.left * r), y = Math.floor(frame.top * r)
  const w = Math.floor(frame.width * r), h = Math.floor(frame.height * r)
  if (w < 1 || h < 1) return null
  const sw = Math.ceil(w / 3), sh = Math.ceil(h / 3)
  const small = window.__printCanvas || (window.__printCanvas = document.createElement('canvas'))
  if (small.width !== sw || small.height !== sh) { small.width = sw; small.height = sh }
  const ctx = small.getContext('2d', {willReadFrequently: true})
  ctx.imageSmoothingEnabled = false
  ctx.clearRect(0, 0, sw, sh)
  ctx.drawImage(canvas, x, y, sw * 3, sh * 3, 0, 0, sw, sh)
  const data = ctx.getImageData(0, 0, sw, sh).data
  let a = 0, b = 0
  for (let k = 0; k < data.length; k += 4) {
    a = (a * 31 + data[k] + 7 * data[k + 1] + 13 * data[k + 2]) | 0
    b = (b + data[k + 1]) | 0
  }
  return a + ':' + b
}"""

# Milliseconds one fingerprint holds the browser's main thread (median of 25 calls).
_FRAME_HASH_COST = """() => {
  const hash = %s, times = []
  for (let i = 0; i < 25; i++) {
    const t = performance.now(); hash(); times.push(performance.now() - t)
  }
  times.sort((p, q) => p - q)
  return times[12]
}""" % _FRAME_HASH

_WATCH_MOVES = """() => {
  window.__moves = []
  document.addEventListener('pointermove', e => {
    if (e.buttons) window.__moves.push(performance.now())
  }, true)
}"""

# Resolves (every animation frame) once the frame's fingerprint differs from ``before``:
# the time of that frame minus that of the last pointer move.
_WAIT_REDRAW = """([before, timeout]) => new Promise(resolve => {
  const hash = %s
  const start = performance.now()
  const tick = () => {
    const now = performance.now()
    const h = hash()
    if (h !== null && h !== before) {
      const moved = window.__moves.length ? window.__moves[window.__moves.length - 1] : start
      resolve({ms: now - moved, hash: h})
    } else if (now - start > timeout) resolve({ms: null, hash: h})
    else requestAnimationFrame(tick)
  }
  requestAnimationFrame(tick)
})""" % _FRAME_HASH


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(port: int, threads: int, tokens: int) -> None:
    """The gallery on SmolLM2 at ``port``, the sidebar prompt ``tokens`` tokens long."""
    import torch

    torch.set_num_threads(threads)
    import panel as pn

    from apps import theme
    from apps.gallery import Gallery, get_model
    from explorer.bench import text_prompts

    prompt = text_prompts(get_model(MODEL), 1, tokens)[0]
    theme.enable_extension()

    def app():
        gallery = Gallery(MODEL)
        gallery.prompt = prompt
        return gallery.template()

    pn.serve({"/": app}, port=port, address="127.0.0.1", show=False,
             websocket_origin=[f"127.0.0.1:{port}"], title="slider drag")


def _percentile(values: list[float], q: float) -> float:
    import numpy as np

    return float(np.percentile(values, q))


def drag_latencies(page, *, moves: int = 8, step_px: int = 12, timeout_s: float = 5.0,
                   settle_s: float = 0.3, direction: int = 1) -> list[float | None]:
    """Per move of a drag on the lens page's steering-strength handle: ms from the pointer
    event to the frame whose heatmap pixels changed (None: not within ``timeout_s``)."""
    handle = page.locator(".bk-input-group", has_text="Steering strength").locator(
        ".noUi-handle").first
    handle.scroll_into_view_if_needed()
    box = handle.bounding_box()
    x, y = box["x"] + box["width"] / 2, box["y"] + box["height"] / 2
    page.evaluate(_WATCH_MOVES)
    page.mouse.move(x, y)
    page.mouse.down()
    out: list[float | None] = []
    try:
        for i in range(moves):
            before = page.evaluate(_FRAME_HASH)
            page.mouse.move(x + direction * step_px * (i + 1), y)
            got = page.evaluate(_WAIT_REDRAW, [before, timeout_s * 1000])
            out.append(None if got["ms"] is None else round(got["ms"], 1))
            page.wait_for_timeout(settle_s * 1000)
    finally:
        page.mouse.up()
    return out


def summary(latencies: list[float | None]) -> dict[str, Any]:
    drawn = [v for v in latencies if v is not None]
    return {"moves": len(latencies), "missing": len(latencies) - len(drawn),
            "p50_ms": _percentile(drawn, 50) if drawn else None,
            "p90_ms": _percentile(drawn, 90) if drawn else None,
            "max_ms": max(drawn) if drawn else None, "each_ms": latencies}


# The drawn heatmap is the exact lens (its title is not a preview's) and the steering
# slider says a drag's first move finds the preview's inputs ready (`preview-ready`).
_READY = """() => {
  const views = [...Bokeh.index.all_views()].filter(v =>
      (v.model.type === 'Figure' || v.model.type === 'Plot') && v.el.isConnected
      && v.model.title != null && /Logit lens|PREVIEW/.test(String(v.model.title.text)))
  if (!views.length || /PREVIEW/.test(String(views[0].model.title.text))) return false
  return [...Bokeh.index.all_views()].some(v => v.model.type === 'Slider'
      && (v.model.css_classes || []).includes('preview-ready'))
}"""


def wait_ready(page, *, timeout_s: float = 300) -> float:
    """Wait until the exact lens is drawn and the page's drag preview is warm; seconds."""
    t0 = time.perf_counter()
    page.wait_for_function(_READY, timeout=timeout_s * 1000)
    return time.perf_counter() - t0


def open_lens_page(browser, url: str, *, timeout_s: float = 300):
    """A page on the gallery's lens once its first (exact) lens is drawn and its drag
    preview is warm."""
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.goto(url, timeout=180_000)
    page.locator("[data-lens-digest]").first.wait_for(state="attached",
                                                      timeout=timeout_s * 1000)
    page.wait_for_function(f"({_FRAME_HASH})() !== null", timeout=timeout_s * 1000)
    wait_ready(page, timeout_s=timeout_s)
    return page


def run_drag(*, threads: int, tokens: int, moves: int, step_px: int, timeout_s: float,
             drags: int, omp_wait_policy: str | None = None) -> dict[str, Any]:
    from playwright.sync_api import sync_playwright

    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
    if omp_wait_policy:
        env["OMP_WAIT_POLICY"] = omp_wait_policy
    log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
    proc = subprocess.Popen([sys.executable, __file__, "--serve", str(port),
                             "--threads", str(threads), "--tokens", str(tokens)],
                            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 300
        while True:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            if proc.poll() is not None or time.time() > deadline:
                raise RuntimeError("the server did not start: " + Path(log.name).read_text()[-2000:])
            time.sleep(0.3)
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, headless=True,
                                        args=CHROMIUM_ARGS)
            page = open_lens_page(browser, f"http://127.0.0.1:{port}/")
            fingerprint_ms = page.evaluate(_FRAME_HASH_COST)
            each: list[float | None] = []
            for d in range(drags):
                if d:
                    wait_ready(page)   # the exact run on release has drawn, the preview warm
                each += drag_latencies(page, moves=moves, step_px=step_px,
                                       timeout_s=timeout_s, direction=1 if d % 2 == 0 else -1)
            browser.close()
    finally:
        proc.terminate()
        proc.wait(20)
    return {**summary(each), "fingerprint_ms": round(fingerprint_ms, 2)}


def kernel_process(threads: int, tokens: int, moves: int) -> None:
    """One fresh process: the slider preview's backend and median ms (JSON on stdout)."""
    import torch

    torch.set_num_threads(threads)
    from explorer.bench import slider_preview_compute

    print(json.dumps(slider_preview_compute(model=MODEL, tokens=tokens, moves=moves)))


def run_kernel(*, processes: int, threads: int, tokens: int, moves: int,
               omp_wait_policy: str | None = None) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
    if omp_wait_policy:
        env["OMP_WAIT_POLICY"] = omp_wait_policy
    runs = []
    for _ in range(processes):
        out = subprocess.run([sys.executable, __file__, "--kernel-process", "--threads",
                              str(threads), "--tokens", str(tokens), "--kernel-moves",
                              str(moves)], cwd=ROOT, env=env,
                             capture_output=True, text=True, check=True)
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    chosen = sorted({r["backend"] for r in runs})
    ms = [r["preview_ms"] for r in runs]
    return {"processes": processes, "backends": [r["backend"] for r in runs],
            "same_backend": len(chosen) == 1, "preview_ms": ms,
            "spread": max(ms) / min(ms), "exact_ms": [r["exact_ms"] for r in runs],
            "runs": runs}


def _uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_number_options(ap, threads=2, tokens=32, moves=8, drags=2, step_px=12, timeout=5.0,
                           processes=5)
    ap.add_argument("--kernel-moves", type=int, default=16,
                    help="previews (and exact calls) timed per kernel process")
    ap.add_argument("--only", choices=("drag", "kernel"), default=None)
    ap.add_argument("--omp-wait-policy", choices=("ACTIVE", "PASSIVE"), default=None,
                    help="OMP_WAIT_POLICY of the served and kernel processes (default: unset)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--serve", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--kernel-process", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve is not None:
        return serve(args.serve, args.threads, args.tokens)
    if args.kernel_process:
        return kernel_process(args.threads, args.tokens, args.kernel_moves)
    result: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                              "uptime_before": _uptime(),
                              "params": {k: v for k, v in vars(args).items()
                                         if k not in ("serve", "kernel_process", "json")}}
    if args.only in (None, "kernel"):
        result["kernel"] = run_kernel(processes=args.processes, threads=args.threads,
                                      tokens=args.tokens, moves=args.kernel_moves,
                                      omp_wait_policy=args.omp_wait_policy)
    if args.only in (None, "drag"):
        result["drag"] = run_drag(threads=args.threads, tokens=args.tokens, moves=args.moves,
                                  step_px=args.step_px, timeout_s=args.timeout,
                                  drags=args.drags, omp_wait_policy=args.omp_wait_policy)
    result["uptime_after"] = _uptime()
    text = json.dumps(result, indent=1)
    if args.json:
        args.json.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
