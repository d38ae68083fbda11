"""The words a page writes about a shown result, from its provenance record alone
(apps/_provenance.py, apps/_circuits_text.py): a hand-built record in, hand-written text out."""
from __future__ import annotations

import pytest

from apps._circuits_text import ShownCircuit, circuit_text, graph_title, pairs_text, scope_on
from apps._provenance import (Counterfactual, Provenance, changed_inputs, counterfactual_text,
                              one_line, outdated_text, stale_text)

PROMPT = "When Mary and John went to the store, John gave a drink to"
CORRUPT = "When Mary and John went to the store, Mary gave a drink to"


def shown(**changes) -> Provenance:
    """A circuit of the one-pair task, second John replaced, by hand."""
    base = dict(page="circuits", model="smollm2-135m", method="eap-ig", task="your prompt",
                prompts=(PROMPT,), corrupt=(CORRUPT,),
                counterfactual=Counterfactual(9, " John", " Mary"), baseline="counterfactual",
                answer=" Mary", wrong=" the", n_pairs=1,
                request=(("counterfactual", "John@9= Mary"), ("explain", "")),
                computed_at="2026-12-07T02:13:45Z",
                metrics=(("clean_metric", 2.5), ("corrupt_metric", 1.24)))
    base.update(changes)
    return Provenance(**base)


def test_one_line_keeps_short_text_and_cuts_a_long_prompt_to_one_line():
    assert one_line("The capital of France is") == "'The capital of France is'"
    assert one_line("a\nb") == "'a⏎b'"
    long = "word " * 1200   # 6,000 characters
    text = one_line(long)
    assert text == f"{('word ' * 12)!r} … {('word ' * 6)!r} (6,000 characters)"
    assert len(text) < 120 and "\n" not in text


def test_counterfactual_and_scope_say_the_position():
    assert counterfactual_text(Counterfactual(9, " John", " Mary")) == \
        "position 9: ' John' -> ' Mary'"
    assert scope_on(shown()) == (
        "your prompt 'When Mary and John went to the store, John gave a drink to' vs its "
        "counterfactual 'When Mary and John went to the store, Mary gave a drink to' "
        "(position 9: ' John' -> ' Mary'), explaining ' Mary' against ' the'")
    mean = shown(counterfactual=None, baseline="mean", corrupt=(PROMPT,),
                 request=(("counterfactual", ""), ("explain", "")))
    assert scope_on(mean).startswith(f"your prompt {PROMPT!r} vs mean ablation (no "
                                     "counterfactual")
    assert scope_on(shown(task="ioi", n_pairs=8, prompts=())) == \
        "task pairs: ioi, 8 pairs (not the sidebar prompt)"
    assert scope_on(shown(task="your pairs", n_pairs=3)) == \
        "your own prompt pairs (3 pairs), not the sidebar prompt"


def test_a_request_scope_says_what_will_be_computed():
    wanted = Provenance(page="circuits", model="m", method="eap", task="your prompt",
                        prompts=(PROMPT,), n_pairs=1,
                        request=(("counterfactual", "John=Mary"), ("explain", "")))
    assert scope_on(wanted, "the counterfactual 'John=Mary', which does not fit: x") == (
        f"your prompt {PROMPT!r} vs the counterfactual 'John=Mary', which does not fit: x")


def test_graph_title_names_the_shown_method_and_says_outdated():
    assert graph_title("eap-ig", 759, 131) == "Circuit: 759 edges (131 drawn), EAP-IG, base model"
    assert graph_title("eap", 40, 40, stale=True) == "Circuit: 40 edges, EAP, base model (outdated)"
    assert graph_title("eap", 40, 40, n_nodes=7, where="step 3") == "7 nodes, 40 edges, EAP, step 3"


def circuit(**changes) -> ShownCircuit:
    base = dict(n_kept=720, n_top=1000, n_total=44371, recovered=0.92, how="measured",
                default_kept=720, default_top=1000, default_recovered=0.92,
                default_reached=True, fraction=0.8)
    base.update(changes)
    return ShownCircuit(**base)


def test_circuit_text_of_the_default_and_of_a_moved_size():
    assert circuit_text(shown(), circuit()) == (
        "EAP-IG scores of 1 pair. Default: the smallest measured circuit recovering at least "
        "80% of the metric: 720 edges (top 1,000 by |score|, pruned), recovering **92%**.")
    moved = circuit(n_kept=759, n_top=1200, recovered=0.95, how="interpolated")
    assert circuit_text(shown(), moved) == (
        "EAP-IG scores of 1 pair. Shown: 759 edges (top 1,200 by |score|, pruned), recovering "
        "95% (interpolated on the curve). Not the default; for these scores: Default: the "
        "smallest measured circuit recovering at least 80% of the metric: 720 edges (top "
        "1,000 by |score|, pruned), recovering **92%**.")
    assert circuit_text(shown(n_pairs=8), circuit(interval=(0.85, 0.97))).endswith(
        "recovering **92%** [85%, 97%] (95 % bootstrap interval over the 8 pairs).")


def test_a_default_keeping_most_of_the_graph_is_named_for_what_it_is():
    big = circuit(n_kept=32378, default_kept=32378, n_top=40000, default_top=40000)
    assert circuit_text(shown(), big) == (
        "EAP-IG scores of 1 pair. No small circuit reaches 80% on this pair: the smallest "
        "measured circuit that does keeps 32,378 of the 44,371 edges (73% of the graph): "
        "32,378 edges (top 40,000 by |score|, pruned), recovering **92%**.")
    none = circuit(default_reached=False, default_recovered=0.6)
    assert circuit_text(shown(), none).startswith(
        "EAP-IG scores of 1 pair. No measured circuit recovers 80%. The most faithful one: ")


def test_one_pair_says_it_has_no_interval_and_gives_the_gap():
    assert pairs_text(shown(), interval=False) == (
        "One pair: the recovery has no interval (a bootstrap over pairs needs at least two; "
        "a task or your own pairs give one); its clean − corrupted gap 1.26 logits (clean "
        "2.50, corrupted 1.24).")
    assert pairs_text(shown(n_pairs=8), interval=True) == (
        "Mean clean − corrupted gap 1.26 logits (clean 2.50, corrupted 1.24) over the 8 pairs.")


def test_stale_text_names_what_changed_and_keeps_the_old_inputs():
    old = shown()
    assert stale_text(old, old) == "" and changed_inputs(old, old) == []
    new = shown(prompts=("A new prompt",), method="eap",
                request=(("counterfactual", "John@9= Mary"), ("explain", "")))
    assert changed_inputs(old, new) == ["prompts", "method"]
    assert stale_text(old, new, action="Compute circuit") == (
        f"Shown: computed on {PROMPT!r} vs position 9: ' John' -> ' Mary', EAP-IG at 02:13 "
        "UTC; the prompt, the attribution method changed since: press Compute circuit to "
        "update.")
    cf = shown(request=(("counterfactual", "Mary=Anna"), ("explain", "")))
    assert outdated_text(old, cf) == "the counterfactual changed since: press Compute to update."


def test_provenance_is_frozen_and_round_trips_through_json():
    p = shown(selection=("L3.H1",), edits=('{"kind": "ablate"}',), positions=(9,),
              settings=(("fraction", 0.8),))
    assert Provenance.from_json(p.to_json()) == p
    assert p.setting("fraction") == 0.8 and p.metric("clean_metric") == 2.5
    with pytest.raises(AttributeError):
        p.method = "eap"   # type: ignore[misc]
