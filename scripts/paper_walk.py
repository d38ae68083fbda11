"""A walk of every method page's *Paper's setting* in the gallery, in headless chromium, with
screenshots and a JSON report per page.

Serves the gallery as ``make app`` does (`apps.gallery.serve`, a child process on a free
127.0.0.1 port) and, for each page with a paper panel (`apps._paper.paper_panel`), opens it
from the sidebar at ``--width`` px, waits until it settles, shoots it, presses *Paper's
setting*, waits until the page settles again, presses the page's own run buttons where it has
them (`RUN_BUTTONS`: Analyse, Compute, Localize...), each in turn until the page settles (at
most ``--timeout`` seconds in all; a run still going then is stopped with the gallery's stop
button, after what the page says is recorded) and shoots it again. ``<out>/paper_walk_<slug>.json`` holds:

- ``card``: the numbers the "Paper vs here" card shows (label, value, interval, read from the
  card's bold numbers with Playwright locators) beside ``json``, the numbers of
  ``docs/figures/<figure>`` they should equal (`explorer.paper_settings.measured_numbers`), and
  ``card_matches_json`` (each shown number equal to its JSON number to the digits shown);
- ``differs_before`` / ``differs_after``: the line on which values differ from the paper, and
  its items (the words between "Differs from the paper:" and the first full stop);
- ``finished``, ``seconds``: whether the page settled after the press and its runs, and
  when; ``runs``: each run button's label as shown (with the page's estimate) and its seconds;
- ``page_says``: the page's lines on work, time, errors or slowness after the press;
- ``console_errors``, ``sideways_px`` (horizontal scroll of the window) and ``screenshots``.

``<out>/paper_walk.json`` gathers them. The exit status is 1 when a page did not finish, its
card does not equal its JSON, or the console had errors.

    python scripts/paper_walk.py                              # every page, SmolLM2, 1280 px
    python scripts/paper_walk.py --pages saturation --timeout 900 --out /tmp/walk
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from _browser import plot_ids, resize_and_settle, settle_gallery_page  # noqa: E402
from _served_gallery import gallery_in_chromium  # noqa: E402

from explorer.defaults import DEFAULT_MODEL  # noqa: E402
from explorer.paper_settings import PAPER_RESULTS, PAPER_SETTINGS, measured_numbers  # noqa: E402

HEIGHT = 1000

# The buttons that run a page's analysis on its settings, pressed in turn after the Paper's
# setting (the other pages recompute as their parameters change, or show stored runs).
RUN_BUTTONS: dict[str, tuple[str, ...]] = {
    "saturation": ("Analyse",),
    "icl-heads": ("Compute scores",),
    "conflicts": ("Select heads as JuICE does",),
    "circuits": ("Compute circuit",),
    "unlearning": ("Localize", "Run unlearning"),
}

# The card's "Here" paragraph: each bold number after the first bold word ("Here"), with the
# words before it (its label) and the interval "[low, high]" after it, if any.
_CARD_NUMBERS = """(p) => {
  const out = []
  const strongs = [...p.querySelectorAll('strong')].slice(1)
  for (const s of strongs) {
    const before = s.previousSibling ? s.previousSibling.textContent : ''
    const after = s.nextSibling ? s.nextSibling.textContent : ''
    const label = before.split(/; |\\): /).pop().trim()
    const m = after.match(/^\\s*\\[([^,\\]]+), ([^\\]]+)\\]/)
    out.push({label, value: s.textContent.trim(), low: m ? m[1] : null, high: m ? m[2] : null})
  }
  return out
}"""

# Every visible text node of the page, through shadow roots, one string each.
_VISIBLE_TEXTS = """() => {
  const out = []
  const walk = root => {
    for (const el of root.querySelectorAll('*')) {
      if (el.offsetParent != null && !['STYLE', 'SCRIPT'].includes(el.tagName))
        for (const n of el.childNodes)
          if (n.nodeType === 3 && n.textContent.trim()) out.push(n.textContent.trim())
      if (el.shadowRoot) walk(el.shadowRoot)
    }
  }
  walk(document)
  return out
}"""

# What a page says about its work after the press: running, timing, errors, slowness.
_SAYS = re.compile(r"(slow|minutes?\b|hours?\b|would take|too (long|many)|error|fail|"
                   r"cannot|can't|stopped|cancel|computing|training|running|measuring|"
                   r"loading|scoring|analysing|localiz|\d+ s\b)", re.I)


def _says(tab) -> list[str]:
    """The page's visible lines on work, time, errors or slowness (the stop button's label
    left out)."""
    return [t for t in dict.fromkeys(tab.evaluate(_VISIBLE_TEXTS))
            if _SAYS.search(t) and t != "Stop running work"][:40]


def _shown_equals(shown: str, value: float) -> bool:
    """``shown`` (a number as the card writes it: "1,221,120", "0.153", "1.2e-05") equals
    ``value`` to the digits shown."""
    text = shown.replace(",", "").replace("−", "-")
    try:
        number = float(text)
    except ValueError:
        return False
    mantissa, _, exponent = text.lower().partition("e")
    decimals = len(mantissa.partition(".")[2]) - (int(exponent) if exponent else 0)
    return abs(number - value) <= 0.5 * 10.0 ** -decimals * (1 + 1e-9)


def _items(line: str) -> list[str]:
    """The differences a differs line names: "Differs from the paper: a; b. Not set..." ->
    ["a", "b"]; [] when it names none."""
    head = "Differs from the paper:"
    if head not in line:
        return []
    body = line.split(head, 1)[1]
    body = body.split(" Not set on this page:", 1)[0].split(" Train the paper's setting", 1)[0]
    return [part.strip().rstrip(".") for part in body.split("; ") if part.strip()]


def _card(tab, method: str) -> dict:
    """The card's numbers as shown, the JSON's, and whether they agree."""
    card = tab.locator(".paper-card").first
    paragraphs = card.locator("p")
    texts = [paragraphs.nth(i).inner_text() for i in range(paragraphs.count())]
    here = next((i for i, t in enumerate(texts) if t.startswith("Here")), None)
    shown = paragraphs.nth(here).evaluate(_CARD_NUMBERS) if here is not None else []
    expected = measured_numbers(method)
    result = PAPER_RESULTS[method]
    paths = {m.label: m.path for m in result.measured}
    checks = []
    for label, numbers in expected.items():
        on_card = next((s for s in shown if s["label"] == label), None)
        same = on_card is not None and _shown_equals(on_card["value"], numbers["value"])
        for end in ("low", "high"):
            if numbers[end] is not None:
                same = same and on_card[end] is not None and _shown_equals(on_card[end], numbers[end])
        checks.append({"label": label, "shown": on_card, "json": numbers,
                       "json_path": f"docs/figures/{result.figure}: {paths[label]}",
                       "equal": same})
    return {"text": texts, "numbers": checks,
            "card_matches_json": bool(checks) and all(c["equal"] for c in checks)}


def _differs(tab) -> dict:
    paragraphs = tab.locator(".paper-differs").first.locator("p")
    line = " ".join(paragraphs.nth(i).inner_text().strip() for i in range(paragraphs.count()))
    return {"line": line, "items": _items(line)}


# The height the window needs to show the whole page: the gallery's main area scrolls inside
# the window, so a full-page screenshot would show only the window.
_WHOLE_HEIGHT = """() => Math.max(document.scrollingElement.scrollHeight,
  ...[...document.querySelectorAll('*')].filter(e => e.clientHeight > 0
      && e.scrollHeight > e.clientHeight + 1 && getComputedStyle(e).overflowY !== 'visible')
    .map(e => e.scrollHeight + e.getBoundingClientRect().top))"""


def _shoot(tab, out: Path, name: str, width: int) -> list[str]:
    """The window as shown, and the whole page (the window made as tall as the page, at most
    8,000 px, then set back)."""
    window, whole = out / f"{name}.png", out / f"{name}_whole.png"
    tab.screenshot(path=str(window))
    height = min(8000, int(tab.evaluate(_WHOLE_HEIGHT)))
    if height > HEIGHT:     # laid out again (a page still at work never settles: 15 s then)
        resize_and_settle(tab, width, height, timeout=15)
        tab.screenshot(path=str(whole))
        resize_and_settle(tab, width, HEIGHT, timeout=15)
        return [str(window), str(whole)]
    return [str(window)]


def _click(tab, button, width: int) -> None:
    """Press ``button``, move the mouse onto the title bar (no tooltip shown) and give the
    press time to reach the server."""
    button.click()
    tab.mouse.move(width // 2, 10)
    tab.wait_for_timeout(1500)


def walk_page(tab, slug: str, title: str, args: argparse.Namespace, errors: list[str]) -> dict:
    """Open ``slug`` from the sidebar, press its Paper's setting, and report."""
    first_error = len(errors)
    started = time.time()
    button = tab.locator(".bk-btn-group button", has_text=title).first
    before = plot_ids(tab)
    button.click()
    tab.mouse.move(args.width // 2, 10)       # onto the title bar: no tooltip shown
    opened = settle_gallery_page(tab, before=before, timeout=args.open_timeout)
    tab.wait_for_selector(".paper-setting button", timeout=60_000)
    said = {"page": slug, "title": title, "opened": opened,
            "open_seconds": round(time.time() - started, 1),
            "differs_before": _differs(tab),
            "screenshots": _shoot(tab, args.out, f"paper_walk_{slug}_before", args.width)}
    press = tab.locator(".paper-setting button").first
    said["button_enabled"] = press.is_enabled()
    started = time.time()
    if said["button_enabled"]:
        _click(tab, press, args.width)
    said["finished"] = settle_gallery_page(tab, timeout=args.timeout)
    said["runs"] = []
    for label in RUN_BUTTONS.get(slug, ()) if said["finished"] else ():
        run = tab.locator(f"button:visible:has-text({json.dumps(label)})").first
        shown = run.inner_text().strip() if run.count() else None
        if shown is None or not run.is_enabled():
            said["runs"].append({"button": label, "shown": shown, "pressed": False})
            continue
        pressed = time.time()
        _click(tab, run, args.width)
        left = max(1.0, args.timeout - (time.time() - started))
        said["finished"] = settle_gallery_page(tab, timeout=left)
        said["runs"].append({"button": shown, "pressed": True, "finished": said["finished"],
                             "seconds": round(time.time() - pressed, 1)})
        if not said["finished"]:
            break
    said["seconds"] = round(time.time() - started, 1)
    said["page_says"] = _says(tab)
    said["screenshots"] += _shoot(tab, args.out, f"paper_walk_{slug}_paper", args.width)
    if not said["finished"]:                      # stop the run, so the next page is not slowed
        stop = tab.locator(".stop-work button").first
        if stop.count() and stop.is_enabled():
            stop.click()
            settle_gallery_page(tab, timeout=120)
            said["page_says_after_stop"] = _says(tab)
            said["screenshots"] += _shoot(tab, args.out, f"paper_walk_{slug}_stopped", args.width)
    said["differs_after"] = _differs(tab)
    said["card"] = _card(tab, slug)
    said["sideways_px"] = tab.evaluate("document.scrollingElement.scrollWidth - "
                                       "document.scrollingElement.clientWidth")
    said["console_errors"] = errors[first_error:]
    return said


def main(argv: list[str] | None = None) -> int:
    from apps._page_titles import PAGE_TITLES

    pages = [slug for slug in PAGE_TITLES if slug in PAPER_SETTINGS]
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=DEFAULT_MODEL, help="model the gallery serves")
    p.add_argument("--pages", default="", help=f"comma-separated slugs (default: {','.join(pages)})")
    p.add_argument("--width", type=int, default=1280, help="browser width in pixels")
    p.add_argument("--timeout", type=float, default=900,
                   help="seconds a page's paper setting may take before it is stopped")
    p.add_argument("--open-timeout", type=float, default=420,
                   help="seconds a page may take to settle when opened")
    p.add_argument("--out", type=Path, default=ROOT / "test-artifacts" / "paper_walk")
    args = p.parse_args(argv)
    slugs = [s for s in args.pages.split(",") if s] or pages
    unknown = [s for s in slugs if s not in pages]
    if unknown:
        p.error(f"unknown pages {unknown}; the pages with a paper's setting are {pages}")
    args.out.mkdir(parents=True, exist_ok=True)

    reports, failed = [], []
    with gallery_in_chromium(args.model, args.out / ".paper_walk_server.log") as (url, browser):
        tab = browser.new_page(viewport={"width": args.width, "height": HEIGHT})
        errors: list[str] = []
        tab.on("pageerror", lambda exc: errors.append(str(exc)))
        tab.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
        tab.goto(url + "/", timeout=180_000)
        tab.wait_for_selector(".bk-btn-group button", state="attached", timeout=300_000)
        for slug in slugs:
            said = walk_page(tab, slug, PAGE_TITLES[slug], args, errors)
            (args.out / f"paper_walk_{slug}.json").write_text(json.dumps(said, indent=1))
            reports.append(said)
            ok = said["finished"] and said["card"]["card_matches_json"] and not said["console_errors"]
            if not ok:
                failed.append(slug)
            print(f"{slug}: {'finished' if said['finished'] else 'NOT finished'} in "
                  f"{said['seconds']:.0f} s; card "
                  f"{'= JSON' if said['card']['card_matches_json'] else '!= JSON'}; "
                  f"{len(said['console_errors'])} console errors; "
                  f"after: {said['differs_after']['line'][:120]}", flush=True)
    (args.out / "paper_walk.json").write_text(json.dumps(reports, indent=1))
    if failed:
        print(f"not finished, card not its JSON, or console errors: {failed}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
