"""The result cache's warm-up: the cached pages' results on their default inputs, computed
before anyone opens them.

`warm_result_cache` opens each page of `WARM_PAGES` as the gallery opens it for a new
session (`apps.gallery.Gallery` with that page in view: the sidebar's default prompt, no
edits, the page's own defaults), in this process and without a browser. A page whose result
is already in the result cache (`apps._result_cache`) reads it and nothing runs; else the
page computes it and stores it, so the next session's page shows it at once with the
"Shown from the result cache" note. Pages that wait for a button on a CPU (ICL heads) are
pressed (`_PRESS`).

``explorer serve`` runs it in a child process once the server listens
(`apps._result_cache.start_warmup`): ``python -m apps._result_warmup --model NAME`` lowers
its own priority (``os.nice``), runs torch on one thread and exits when done, or as soon as
the server is gone (``--parent``). Nothing here is shared with the server's process: the
child loads its own copy of the model.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from apps._result_cache import result_cache

__all__ = ["WARM_PAGES", "warm_result_cache", "main", "NICE"]

log = logging.getLogger(__name__)

WARM_PAGES: tuple[str, ...] = ("saturation", "conflicts", "icl-heads", "features")
"""The gallery pages whose first result is kept on disk, in warm-up order: in the result
cache (Saturation, Knowledge conflicts, ICL heads), or, for Feature dashboards, its
dictionary's feature index in the activation store (`explorer.store`; training it reads
SmolLM2's activations on the corpus, ~11 CPU s)."""

NICE = 15
"""How much the child lowers its priority (``os.nice``): the server's sessions come first."""


def _press_icl(view: Any) -> None:
    if view.scores is None:
        view._compute()


# slug -> what to do after the page opened, for a page that does not compute on open
_PRESS: dict[str, Callable[[Any], None]] = {"icl-heads": _press_icl}


def warm_result_cache(model_name: str, slugs: Sequence[str] = WARM_PAGES, *,
                      say: Callable[[str], None] = lambda text: log.info(text)
                      ) -> list[tuple[str, str, float]]:
    """Open each page ``slugs`` on its default inputs with ``model_name``, computing and
    storing what the result cache lacks; (slug, "cached" or "computed", CPU seconds) for
    each. Nothing is done (an empty list) while the result cache is off."""
    if result_cache() is None:
        say("the result cache is off: nothing to warm up")
        return []
    from apps.gallery import VIEWS, Gallery   # the pages load here, not when serving

    views = {slug: (title, slug, factory) for title, slug, factory in VIEWS}
    unknown = [s for s in slugs if s not in views]
    if unknown:
        raise ValueError(f"no gallery page {unknown[0]!r}; the pages are {', '.join(views)}.")
    done = []
    for slug in slugs:
        start = time.process_time()
        gallery = Gallery(model_name, views=[views[slug]], view=slug)
        try:
            view = gallery.page(slug)
            cached = _from_cache(view)
            if not cached and slug in _PRESS:
                _PRESS[slug](view)
        finally:
            gallery.close()
        seconds = time.process_time() - start
        state = "cached" if cached else "computed"
        say(f"{slug}: {state} ({seconds:.1f} CPU s)")
        done.append((slug, state, seconds))
    return done


def _from_cache(view: Any) -> bool:
    """Whether ``view`` opened on a result read from disk: the result cache (its note says
    so) or, on Feature dashboards, the activation store (its ``cached`` flag)."""
    if getattr(view, "cached", None) is True:
        return True
    for name in ("result_note", "_scores_note"):
        if str(getattr(view, name, "") or "").startswith("Shown from the result cache"):
            return True
    return False


def _exit_with(parent: int, every_s: float = 2.0) -> None:
    """End this process once ``parent`` is no longer its parent (the server stopped without
    stopping it, e.g. on SIGTERM or SIGKILL): checked now and every ``every_s``."""
    if os.getppid() != parent:
        os._exit(0)

    def watch() -> None:
        while True:
            time.sleep(every_s)
            if os.getppid() != parent:
                os._exit(0)

    threading.Thread(target=watch, name="warm-up parent watch", daemon=True).start()


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m apps._result_warmup --model NAME [--pages a,b]``: the warm-up, niced."""
    parser = argparse.ArgumentParser(prog="python -m apps._result_warmup",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="the model the server serves")
    parser.add_argument("--pages", default=",".join(WARM_PAGES),
                        help="comma-separated page slugs (default: %(default)s)")
    parser.add_argument("--parent", type=int, default=None,
                        help="the server's process id: the warm-up stops when it is gone")
    args = parser.parse_args(argv)
    if args.parent is not None:
        _exit_with(args.parent)
    try:
        os.nice(NICE)
    except (AttributeError, OSError):   # not on this platform: run as is
        pass
    import torch

    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING)

    def say(text: str) -> None:
        print(f"[result cache warm-up] {text}", file=sys.stderr, flush=True)

    try:
        warm_result_cache(args.model, [s for s in args.pages.split(",") if s], say=say)
    except Exception as err:   # a failed warm-up costs the pages nothing: they compute
        say(f"stopped: {type(err).__name__}: {err}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
