"""The gallery's pages with small settings, for tests that build every page on a tiny model
(the gallery's browser test, the page-export test) or open the gallery headless (the menu and
page-link tests)."""
from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

KM_PARAMS = dict(n_entities=16, n_orders=2, max_hops=2, walk_length=4, d_model=32, n_heads=2,
                 d_mlp=64, steps=150, batch_size=64, lr=1e-2, seed=0)
"""A knowledge-graph model small enough to train in a test (representation shattering)."""


def tiny_facts_file(folder: Path) -> Path:
    """A small unlearning fact file for the tiny models, ``folder/facts.json``: 12 people each
    liking one of three attributes whose first tokens differ in the tiny tokenizer."""
    attrs = ["blue", "dog", "moon"]
    path = folder / "facts.json"
    path.write_text(json.dumps({
        "attributes": attrs,
        "templates": {"trained": "Fact: {subject} likes the",
                      "mc": "Q: What does {subject} like? Options: {options}\nA: {subject} likes the"},
        "facts": [[f"Person {a}{b}", attrs[i % 3]] for i, (a, b) in
                  enumerate((a, b) for a in "ABCD" for b in "xyz")]}))
    return path


def _one_thread_own_rng(train: Callable[[], Any]) -> Any:
    """``train()`` on one torch thread, the caller's torch random state kept as it was."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng():
            return train()
    finally:
        torch.set_num_threads(before)


@functools.cache
def linear_icl_runs() -> dict[int, Any]:
    """The Linear ICL page's runs for 1 and 2 heads (60 steps, seeded), trained once per test
    process: the tests that build that page share them (the page only reads them)."""
    from explorer.analyses import linear_icl

    return _one_thread_own_rng(lambda: {
        H: linear_icl.train_linear_icl(n_heads=H, steps=60, checkpoint_every=20, batch_size=64,
                                       n_test=64, test_lengths=[10, 40], seed=0)
        for H in (1, 2)})


@functools.cache
def knowledge_model_and_sweep() -> tuple[Any, Any]:
    """The tiny knowledge model (`KM_PARAMS`) and its edit sweep (6 edits, fine-tuning),
    trained once per test process for the shattering page."""
    from explorer.analyses import shattering as sh

    def train():
        km = sh.train_knowledge_model(**KM_PARAMS)
        return km, sh.edit_sweep(km, n_edits=6, distances=[1, 2, 3], method="finetune")

    return _one_thread_own_rng(train)


def small_gallery_views(*, circuits_autostart: bool | None = None,
                        icl_compute_on_open: bool | None = None
                        ) -> list[tuple[str, str, Callable[[Any], Any]]]:
    """`apps.gallery.VIEWS` with the slow pages small: few facts on the Knowledge conflicts
    page, few prompts and shots on the ICL heads page. ``circuits_autostart`` (when given) and
    ``icl_compute_on_open`` are those pages' own arguments (``None``: the page decides)."""
    from apps.circuits import CircuitsView
    from apps.conflicts import ConflictsView
    from apps.gallery import VIEWS
    from apps.icl_heads import ICLHeadsView
    from explorer.analyses.conflicts import load_facts

    small = {
        "conflicts": functools.partial(ConflictsView, facts=load_facts(["country_capital"])[:3],
                                       closed_book=False, n_new=2),
        "icl-heads": functools.partial(ICLHeadsView, n_prompts=3, n_shots=2,
                                       compute_on_open=icl_compute_on_open),
    }
    if circuits_autostart is not None:
        small["circuits"] = functools.partial(CircuitsView, autostart=circuits_autostart)
    return [(title, slug, small.get(slug, factory)) for title, slug, factory in VIEWS]


@contextlib.contextmanager
def small_galleries(**options: bool | None) -> Iterator[Callable[..., Any]]:
    """``make(view="lens", *, views=None, **kw)`` opens a gallery on tiny-llama showing
    ``view``, its pages ``views`` or else `small_gallery_views` (``options`` are that
    function's); every gallery made is closed on exit."""
    from apps.gallery import Gallery

    galleries = []

    def make(view: str = "lens", *, views: Any = None, **kw: Any) -> Any:
        g = Gallery("tiny-llama", views=views or small_gallery_views(**options), view=view, **kw)
        galleries.append(g)
        return g

    try:
        yield make
    finally:
        for g in galleries:
            g.close()


def cheap_gallery_views(tmp: Path, shattering: Callable[[Any, Any], Callable[[Any], Any]]
                        ) -> list[tuple[str, str, Callable[[Any], Any]]]:
    """`apps.gallery.VIEWS` in its order, the slow pages with small settings. ``tmp`` holds
    the unlearning page's fact file; ``shattering(km, sweep)`` returns that page's factory
    for the tiny knowledge model and sweep (`knowledge_model_and_sweep`)."""
    from apps.circuits import CircuitsView
    from apps.conflicts import ConflictsView
    from apps.features import FeaturesView
    from apps.gallery import VIEWS
    from apps.icl_heads import ICLHeadsView
    from apps.itda import ITDAView
    from apps.linear_icl import LinearICLView
    from apps.neuron_eval import NeuronEvalView
    from apps.saturation import SaturationView
    from apps.unlearning import UnlearningView
    from explorer.analyses.conflicts import load_facts

    facts_file = tiny_facts_file(tmp)
    icl_runs = linear_icl_runs()
    km, sweep = knowledge_model_and_sweep()
    facts = load_facts(["country_capital"])[:3]
    cheap = {
        "saturation": lambda m: SaturationView(m, store=None, n_tokens=400, analysis_options=dict(
            n_permutations=100, n_pairs=1, sample_positions=200, min_sat_layer=0)),
        "conflicts": lambda m: ConflictsView(m, facts=facts, closed_book=False, n_new=2),
        "icl-heads": lambda m: ICLHeadsView(m, n_prompts=3, n_shots=2),
        "itda": lambda m: ITDAView(m, layer=1),
        "features": lambda m: FeaturesView(m, layer=1, corpus_tokens=128),
        "neuron-eval": lambda m: NeuronEvalView(m, layer=1, n_seeds=3),
        "linear-icl": lambda m: LinearICLView(m, runs=icl_runs),
        "circuits": lambda m: CircuitsView(m, n_prompts=4),
        "shattering": shattering(km, sweep),
        "unlearning": lambda m: UnlearningView(m, facts_file=facts_file, known_only=False,
                                               n_forget=4, n_retain=2, n_layers=1, steps=2,
                                               relearn_steps=1),
    }
    return [(title, slug, cheap.get(slug, factory)) for title, slug, factory in VIEWS]


def ablate_then_remove_l0h1(g: Any, page: Any, edited: str, check: Callable[[], None]) -> None:
    """The gallery ablates head L0.H1 from its workspace: ``page`` reruns under the edit and
    ``check()`` compares what it shows with a hooked run; removing the edit clears the page's
    ``edited`` result."""
    from explorer.interventions import Ablate

    g.workspace.select("L0.H1")
    g.ablate_selected()
    page.wait()
    assert page.edits == [Ablate(0, 1)]
    check()
    g.workspace.remove_edit(0)
    page.wait()
    assert page.edits == [] and getattr(page, edited) is None
