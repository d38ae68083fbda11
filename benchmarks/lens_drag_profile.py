"""Where a logit-lens slider move's time goes, from the pointer event to the changed pixels.

The gallery on ``--model`` is served in this process (Panel's threaded server, torch at
``--threads``), opened on the lens in headless chromium (Playwright, /usr/bin/chromium) with
the page bench's recorder (`explorer.benches.pages`); the steering-strength slider is
dragged ``--drags`` times in ``--moves`` steps. Per step the browser gives its parts: the
pointer event to the first websocket message sent (``input``), that to the last message
received before the changed frame (``roundtrip``), and that to the frame (``paint``: applying
the patch and Bokeh's repaint). The session's lens view gives the server's parts of each
preview drawn (`apps._lens_preview.PreviewPart.preview_timings`): ``compute`` (the preview's
lens), ``queue`` (the move's event to the job's start), ``deliver`` (the job's end to the
session's event loop drawing it) and ``draw`` (the in-place redraw, including building the
document patch); the rest of the roundtrip is the transport (the messages both ways, Panel's
handling of the widget's event). Medians, and each
part's share of the median step. With ``--continuous N``, N drags as a hand makes them (a
move every 40 ms for 3 s, no waiting) with `PreviewPart.overlap_previews` on and N with it
off, alternating: the median time between changed frames during the drag on each side.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/lens_drag_profile.py [--threads 1] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from explorer.benches import pages as bp  # noqa: E402
from explorer.benches.child import answers, unused_port  # noqa: E402
from explorer.benches.serve import CHROMIUM, CHROMIUM_ARGS  # noqa: E402
from explorer.defaults import DEFAULT_MODEL  # noqa: E402


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 1) if values else None


def profile(*, model: str, threads: int, moves: int, drags: int, tokens: int,
            continuous: int) -> dict[str, Any]:
    import panel as pn
    import torch
    from playwright.sync_api import sync_playwright

    from apps import theme
    from apps.gallery import Gallery, get_model

    torch.set_num_threads(threads)
    prompt = None
    if tokens:
        from explorer.bench import text_prompts

        prompt = text_prompts(get_model(model), 1, tokens)[0]
    theme.enable_extension()
    sessions: list[Any] = []

    def app():
        gallery = Gallery(model, view="lens")
        if prompt is not None:
            gallery.prompt = prompt
        sessions.append(gallery)
        return gallery.template()

    port = unused_port()
    server = pn.serve({"/": app}, port=port, address="127.0.0.1", threaded=True, show=False,
                      websocket_origin=[f"127.0.0.1:{port}"])
    try:
        deadline = time.time() + 120
        while not answers(port):
            if time.time() > deadline:
                raise RuntimeError(f"the page server did not answer on port {port}")
            time.sleep(0.2)
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True,
                                         args=CHROMIUM_ARGS)
            context = browser.new_context(viewport={"width": 1400, "height": 1000})
            context.add_init_script(bp.RECORDER)
            tab = context.new_page()
            tab.goto(f"http://127.0.0.1:{port}/", timeout=300_000)
            tab.locator("[data-lens-digest]").first.wait_for(state="attached", timeout=600_000)
            bp._wait_quiet(tab, quiet_s=1.5, timeout_s=300)
            done = []
            for d in range(drags):
                direction = None if not done else -done[-1]["direction"]
                done.append(bp._drag(tab, bp.SLIDERS["lens"], moves=moves, direction=direction,
                                     move_timeout_s=10, settle_s=0.3, quiet_s=1.5,
                                     timeout_s=300))
            lens = sessions[-1].page("lens")
            drawn = sum(len(d["steps"]) for d in done)   # the step drags' previews only
            server_parts = list(lens.preview_timings)[-drawn:] if drawn else []
            hand: dict[str, list] = {"overlap": [], "no_overlap": []}
            from apps._lens_preview import PreviewPart

            for i in range(2 * continuous):           # alternating: on, off, off, on, ...
                side = ("overlap", "no_overlap")[(i + i // 2) % 2]
                PreviewPart.overlap_previews = side == "overlap"
                bp._wait_quiet(tab, quiet_s=1.5, timeout_s=300)
                got = bp.continuous_drag(tab, bp.SLIDERS["lens"], seconds=3.0,
                                         interval_ms=40)     # towards the farther end
                got["side"] = side
                hand[side].append(got)
                print(f"[profile] continuous drag, {side}: {got}", file=sys.stderr, flush=True)
            PreviewPart.overlap_previews = True
            costs = tab.evaluate(bp._COSTS)
            browser.close()
    finally:
        server.stop()
    steps = [s for d in done for s in d["steps"] if s.get("ms") is not None]
    browser_parts = {name: _median([s[f"{name}_ms"] for s in steps if f"{name}_ms" in s])
                     for name in ("input", "server", "paint")}
    total = _median([s["ms"] for s in steps])
    server = {name: _median([t[f"{name}_ms"] for t in server_parts
                             if t.get(f"{name}_ms") is not None])
              for name in ("queue", "compute", "deliver", "draw")}
    inside = [v for v in server.values() if v is not None]
    rest = None if browser_parts["server"] is None or len(inside) < 4 else round(
        browser_parts["server"] - sum(inside), 1)
    parts = {"input_ms": browser_parts["input"], "server_queue_ms": server["queue"],
             "server_compute_ms": server["compute"], "server_deliver_ms": server["deliver"],
             "server_draw_patch_ms": server["draw"], "transport_ms": rest,
             "apply_paint_ms": browser_parts["paint"]}
    continuous_out = {}
    for side, runs in hand.items():
        vals = [r["update_interval_ms"] for r in runs if r.get("update_interval_ms")]
        continuous_out[side] = {"update_interval_ms": _median(vals), "each": runs}
    a, b = (continuous_out[s]["update_interval_ms"] for s in ("no_overlap", "overlap"))
    if a and b:
        continuous_out["no_overlap_vs_overlap_ratio"] = round(a / b, 3)
    return {"continuous_drags": continuous_out, "step_p50_ms": total,
            "step_p90_ms": round(bp.percentile([s["ms"] for s in steps], 90), 1) if steps else None,
            "steps": len(steps),
            "missing": sum(1 for d in done for s in d["steps"] if s.get("ms") is None),
            "release_exact_ms": [d["release_exact_ms"] for d in done],
            "parts_p50": parts,
            "shares": {k: round(v / total, 3) for k, v in parts.items()
                       if v is not None and total},
            "previews_drawn": len(server_parts), "recorder": costs,
            "each_step": [d["steps"] for d in done], "server_each": server_parts}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--moves", type=int, default=6)
    ap.add_argument("--drags", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=0,
                    help="a prompt of this many tokens of the bench text (0: the gallery's own)")
    ap.add_argument("--continuous", type=int, default=0,
                    help="continuous drags (a move every 40 ms for 3 s) with the preview "
                         "overlap on and as many with it off, alternating")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    out = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "uptime_before": uptime,
           "params": vars(args) | {"json": None},
           **profile(model=args.model, threads=args.threads, moves=args.moves,
                     drags=args.drags, tokens=args.tokens, continuous=args.continuous)}
    out["uptime_after"] = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    text = json.dumps(out, indent=1, default=str)
    if args.json:
        args.json.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
