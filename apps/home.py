"""The gallery's first page: what the explorer is, its pages grouped by the question each
answers (each a link to the page), and a three-step first tour.

A link is ``?view=<slug>`` with a ``data-view`` attribute: the gallery's address bar opens the
page in the same session (the prompt, selection and edits stay); a middle click opens it in
a new tab, as any link does.
"""
from __future__ import annotations

import html
from collections.abc import Mapping

import panel as pn

from apps._page_titles import PAGE_TITLES
from apps._view import View, serve

__all__ = ["GROUPS", "TOUR", "HomeView", "home_html"]

# (question, what it means, the pages that answer it): every page of the gallery once
GROUPS: list[tuple[str, str, list[str]]] = [
    ("What does the model predict?", "Layer by layer, and where the answer is fixed.",
     ["lens", "saturation", "conflicts"]),
    ("Which parts carry this answer?", "Patch a clean run into a corrupted one, each head's "
     "and MLP's direct write to the answer, and two prompts side by side.",
     ["patching", "dla", "compare"]),
    ("Which heads do what?", "Attention patterns, head scores, neurons and dictionary features.",
     ["attention", "atlas", "icl-heads", "neuron-eval", "itda", "features"]),
    ("Which circuit, and what an edit does to it?", "Edges that carry a task; edits that remove "
     "or change knowledge.", ["circuits", "unlearning", "shattering"]),
    ("How does it learn?", "Small models trained in the page, watched as skills appear.",
     ["parity", "linear-icl", "task-emergence"]),
    ("Does an explanation help people?", "Show a page's explanation to participants, with a "
     "baseline and a placebo, and test it.", ["study"]),
]

TOUR: list[tuple[str, str]] = [
    ("Type a prompt", "in the sidebar's Prompt box and press Enter, then open the "
     "<a href='?view=lens' data-view='lens'>Logit lens</a>: what the model would predict after "
     "each layer."),
    ("Select a head", "on the <a href='?view=attention' data-view='attention'>Attention</a> page "
     "(click its tile): it joins the workspace in the sidebar, and every page outlines it."),
    ("Edit and compare", "with the sidebar menu's <i>Ablate</i>, then go back to the lens: it draws "
     "the prompt clean and edited. <i>Copy link</i> in the sidebar shares exactly this view."),
]

_CSS = """
.home { font-size: 15px; color: #222; max-width: 1100px; }
.home h2 { margin: 4px 0 6px 0; }
.home .groups { display: grid; grid-template-columns: repeat(auto-fit, minmax(190px, 1fr));
  gap: 12px; margin: 12px 0 18px 0; }
.home .group { border: 1px solid #d0d7de; border-radius: 6px; padding: 10px 12px; background: #fafbfc; }
.home .group h3 { font-size: 15px; margin: 0 0 2px 0; }
.home .group p { margin: 0 0 8px 0; color: #555; font-size: 13px; }
.home .group a { display: block; padding: 5px 8px; margin: 4px 0; border-radius: 4px;
  background: white; border: 1px solid #d0d7de; text-decoration: none; color: #0b5cad; }
.home .group a:hover { background: #eef4fb; }
.home ol { padding-left: 22px; } .home li { margin: 4px 0; }
"""


def home_html(titles: Mapping[str, str]) -> str:
    """The home page's HTML for the pages on offer (``titles``: slug -> title)."""
    cards = []
    for question, what, slugs in GROUPS:
        links = "".join(f"<a href='?view={s}' data-view='{s}' class='home-link'>"
                        f"{html.escape(titles[s])}</a>" for s in slugs if s in titles)
        if links:
            cards.append(f"<div class='group'><h3>{html.escape(question)}</h3>"
                         f"<p>{html.escape(what)}</p>{links}</div>")
    grouped = {s for _, _, slugs in GROUPS for s in slugs}
    rest = [s for s in titles if s not in grouped and s != "home"]
    if rest:
        links = "".join(f"<a href='?view={s}' data-view='{s}' class='home-link'>"
                        f"{html.escape(titles[s])}</a>" for s in rest)
        cards.append(f"<div class='group'><h3>More pages</h3><p></p>{links}</div>")
    tour = "".join(f"<li><b>{step}</b> {text}</li>" for step, text in TOUR
                   if all(f"'{s}'" not in text or s in titles for s in ("lens", "attention")))
    return ("<div class='home'><h2>Look inside a language model</h2>"
            "<p>The explorer runs a model on your prompt and shows what its layers, heads and "
            "circuits do, with the methods of recent interpretability papers. Every page reads "
            "one workspace (the sidebar): your prompt, the components you select and the edits "
            "you stack, so a head picked on one page is the head the next page shows.</p>"
            f"<div class='groups'>{''.join(cards)}</div>"
            f"<h3>A first tour</h3><ol>{tour}</ol></div>")


class HomeView(View):
    """The home page: no model work, links to the pages (``titles``: slug -> title)."""

    def __init__(self, titles: Mapping[str, str], **params):
        super().__init__(**params)
        self._titles = dict(titles)

    def __panel__(self) -> pn.pane.HTML:
        return pn.pane.HTML(home_html(self._titles), stylesheets=[_CSS],
                            sizing_mode="stretch_width", css_classes=["home-page"])


def _gallery_titles(_model: object) -> HomeView:
    return HomeView(PAGE_TITLES)


serve(__name__, _gallery_titles, title="Explorer", model=False)
