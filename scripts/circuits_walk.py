"""A person's walk of the Circuits page in the gallery, in headless chromium, with screenshots.

Serves the gallery as ``make app`` does (`apps.gallery.serve`, a child process on a free
127.0.0.1 port), types the sidebar prompt, opens Circuits, picks the task "your prompt",
clicks the second occurrence of ``--word`` in the token strip, types ``--replacement``, computes
with EAP, then switches to EAP-IG and computes again, then presses "Same pair with other
names" (eight pairs: the recovery's interval). After each computation it writes a
full-page screenshot and prints what the page says: the plot's title (read from Bokeh's
document), the counterfactual line, the caption and the recovery line, so a reader can check
that they name the same experiment (the clicked position, the method) and the recovery's
interval or the reason it has none.

    python scripts/circuits_walk.py                          # SmolLM2, 1280 and 1920 px
    python scripts/circuits_walk.py --widths 1280 --out /tmp/walk
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from _browser import settle_gallery_page  # noqa: E402
from _served_gallery import gallery_in_chromium  # noqa: E402

from explorer.defaults import DEFAULT_MODEL  # noqa: E402

PROMPT = "When Mary and John went to the store, John gave a drink to"
PLACEHOLDER = "Enter a prompt and press Enter"   # the sidebar's prompt box

# the Bokeh titles of the plots on show (titles are drawn on canvas: read from the document)
_TITLES = """() => [...Bokeh.index.all_views()]
  .filter(v => (v.model.type === 'Figure' || v.model.type === 'Plot') && v.el.isConnected)
  .map(v => v.model.title ? v.model.title.text : '')"""


def _text(tab, css: str) -> str:
    """The text a Panel pane shows (its content lives in the element's shadow root)."""
    loc = tab.locator(css)
    shown = ("el => el.shadowRoot ? [...el.shadowRoot.children].filter(c => !['STYLE', 'LINK']"
             ".includes(c.tagName)).map(c => c.innerText).join(' ') : el.innerText")
    return loc.first.evaluate(shown).strip() if loc.count() else ""


def _compute(tab, label: str, timeout: float) -> float:
    """Press Compute and wait until the circuit's title names ``label`` (the method's)."""
    started = time.time()
    tab.locator("button", has_text="Compute circuit").first.click()
    while not any(t.startswith("Circuit:") and t.split(", ")[1:2] == [label]
                  for t in tab.evaluate(_TITLES)):
        if time.time() - started > timeout:
            raise SystemExit(f"no {label} circuit after {timeout:.0f} s: {tab.evaluate(_TITLES)}")
        tab.wait_for_timeout(500)
    settle_gallery_page(tab, timeout=timeout)
    return time.time() - started


def _report(tab, width: int, method: str, seconds: float, out: Path) -> dict:
    path = out / f"circuits_walk_{method.lower().replace('-', '_')}_{width}.png"
    tab.screenshot(path=str(path))
    tab.locator(".circuit-caption").first.scroll_into_view_if_needed()
    tab.screenshot(path=str(path.with_name(path.stem + "_caption.png")))
    said = {"width": width, "method": method, "seconds": round(seconds, 1),
            "titles": tab.evaluate(_TITLES),
            "strip_selected": tab.locator(".circuit-prompt-strip .pos-strip").first
                                 .get_attribute("data-positions-selected"),
            "caption": _text(tab, ".circuit-caption"),
            "readout": _text(tab, ".circuit-readout"),
            "sideways_px": tab.evaluate("document.scrollingElement.scrollWidth - "
                                        "document.scrollingElement.clientWidth"),
            "screenshot": str(path)}
    print(json.dumps(said, indent=1), flush=True)
    return said


def walk(browser, url: str, width: int, args: argparse.Namespace) -> list[dict]:
    tab = browser.new_page(viewport={"width": width, "height": 1100})
    tab.goto(url + "/", timeout=180_000)
    tab.wait_for_selector(".bk-btn-group button", state="attached", timeout=300_000)
    box = tab.locator(f'input[placeholder="{PLACEHOLDER}"]').first
    box.fill(args.prompt)
    box.press("Enter")
    tab.locator(".bk-btn-group button", has_text="Circuits").first.click()
    tab.mouse.move(width // 2, 10)
    settle_gallery_page(tab, timeout=args.timeout)
    task = tab.locator("select").filter(has=tab.locator("option", has_text="your prompt")).first
    task.select_option(label="your prompt")
    tab.wait_for_selector(".circuit-prompt-strip .pos-token", timeout=120_000)
    tokens = tab.locator(".circuit-prompt-strip .pos-token")
    texts = [tokens.nth(i).inner_text() for i in range(tokens.count())]
    hits = [i for i, t in enumerate(texts) if t.replace("·", " ") == args.word]  # · marks a space
    if len(hits) < 2:
        raise SystemExit(f"{args.word!r} occurs {len(hits)} time(s) in the strip {texts}")
    tokens.nth(hits[1]).click()
    replacement = tab.locator(".bk-input-group", has_text="Replace the clicked word by") \
        .locator("input").first
    replacement.fill(args.replacement)
    replacement.press("Enter")
    said = []
    for method in ("eap", "eap-ig"):
        tab.get_by_role("button", name=method, exact=True).first.click()
        seconds = _compute(tab, method.upper(), args.timeout)
        said.append(_report(tab, width, method, seconds, args.out) |
                    {"clicked_position": hits[1]})
    # more pairs from the prompt (other names): the recovery gets its bootstrap interval
    started = time.time()
    tab.locator(".name-variants button").first.click()
    while "bootstrap interval over the" not in _text(tab, ".circuit-caption"):
        if time.time() - started > args.timeout:
            raise SystemExit(f"no interval after {args.timeout:.0f} s: "
                             f"{_text(tab, '.circuit-caption')[:300]}")
        tab.wait_for_timeout(500)
    settle_gallery_page(tab, timeout=args.timeout)
    said.append(_report(tab, width, "eap-ig-8-pairs", time.time() - started, args.out))
    tab.close()
    return said


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--prompt", default=PROMPT)
    p.add_argument("--word", default=" John", help="the word whose second occurrence is clicked")
    p.add_argument("--replacement", default=" Mary")
    p.add_argument("--widths", default="1280,1920")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--out", type=Path, default=ROOT / "test-artifacts")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    said = []
    with gallery_in_chromium(args.model, args.out / ".circuits_walk_server.log") as (url, browser):
        for width in [int(w) for w in args.widths.split(",")]:
            said += walk(browser, url, width, args)
    (args.out / "circuits_walk.json").write_text(json.dumps(said, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
