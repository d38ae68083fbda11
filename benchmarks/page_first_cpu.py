"""CPU seconds of each gallery page's first result, in-process, as on a fresh install.

Each page runs in a child process of its own (``--page SLUG``): the model loaded and one
forward run first (not counted), then `apps.gallery.Gallery` built with that page in view, as a
new browser session builds it (outside a server the page's jobs run at once, in the caller's
thread), and then the page's Bokeh models made (``get_root``). It prints ``time.process_time``
of both, with torch at one thread. CPU seconds hardly change with what else the machine runs,
where wall time grows with its load. Each child gets an empty activation store (a temporary
``EXPLORER_CACHE`` with the converted models linked in) and the pages' result cache off, so
nothing a previous run stored is read.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/page_first_cpu.py [--pages lens,saturation]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _one(slug: str, model_name: str) -> dict:
    os.environ["EXPLORER_RESULT_CACHE"] = "off"
    import torch

    torch.set_num_threads(1)
    import panel as pn
    from bokeh.document import Document

    from apps._page_titles import PAGE_TITLES
    from apps._session import get_model
    from apps.gallery import VIEWS, Gallery

    model = get_model(model_name)
    with torch.no_grad():
        model.hf(**model.tokenize(["Warm the weights up once"]).model_inputs())
    rows = {s: (t, s, f) for t, s, f in VIEWS}
    Gallery(model_name, views=[rows["study"]], view="study")      # imports, the sidebar
    t0, w0 = time.process_time(), time.perf_counter()
    gallery = Gallery(model_name, views=[rows[slug]], view=slug)
    cpu, wall = time.process_time() - t0, time.perf_counter() - w0
    t1 = time.process_time()
    pn.panel(gallery.page(slug)).get_root(Document())
    return {"page": PAGE_TITLES[slug], "slug": slug, "first_result_cpu_s": round(cpu, 2),
            "render_cpu_s": round(time.process_time() - t1, 2), "wall_s": round(wall, 2)}


def main() -> int:
    from explorer.defaults import DEFAULT_MODEL

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pages", default=None, help="comma-separated slugs (default: all)")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--page", default=None, help=argparse.SUPPRESS)   # the child's
    args = parser.parse_args()
    if args.page:
        print(json.dumps(_one(args.page, args.model)), flush=True)
        return 0
    from apps._page_titles import PAGE_TITLES
    from explorer.models import cache_dir

    slugs = args.pages.split(",") if args.pages else list(PAGE_TITLES)
    print("| page | first result (CPU s) | Bokeh models (CPU s) |")
    print("| --- | ---: | ---: |")
    for slug in slugs:
        with tempfile.TemporaryDirectory() as folder:
            (Path(folder) / "models").symlink_to((cache_dir() / "models").resolve())
            env = {**os.environ, "EXPLORER_CACHE": folder, "OMP_NUM_THREADS": "1"}
            out = subprocess.run([sys.executable, __file__, "--page", slug, "--model", args.model],
                                 env=env, capture_output=True, text=True)
        if out.returncode:
            print(f"| {PAGE_TITLES[slug]} | failed: {out.stderr.strip().splitlines()[-1]} | |")
            continue
        row = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"| {row['page']} | {row['first_result_cpu_s']:.2f} | {row['render_cpu_s']:.2f} |",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
