"""The Circuits page's words, written from the shown result's provenance (`Provenance`) and
its numbers, never from the current widgets: the scope line, the graph's title, the shown
circuit with its default and recovery, and, for one pair, why there is no interval and the
clean - corrupted gap the recovery is a share of. Pure functions: the tests call them on a
hand-built record."""
from __future__ import annotations

from dataclasses import dataclass

from apps._provenance import Provenance, counterfactual_text, one_line

__all__ = ["METHOD_LABELS", "OWN_TASK", "PROMPT_TASK", "ShownCircuit", "method_label",
           "scope_on", "graph_title", "circuit_text", "pairs_text"]

METHOD_LABELS = {"eap": "EAP", "eap-ig": "EAP-IG"}
OWN_TASK = "your pairs"  # the task of the user's own prompt pairs (the "Your own" box)
PROMPT_TASK = "your prompt"  # the sidebar prompt against its counterfactual
MEAN_ABLATION = ("mean ablation (no counterfactual: each node's output averaged over the "
                 "prompt's positions)")


def method_label(method: str) -> str:
    """``EAP`` / ``EAP-IG`` (an unknown method as it is spelled)."""
    return METHOD_LABELS.get(method, method)


def scope_on(prov: Provenance, request_counterfactual: str = "", *, own_n: int = 0) -> str:
    """What the circuit is computed on: the prompt (one line) against its counterfactual by
    position and the two targets, or the task's pairs. ``prov`` is a shown result's record,
    or a request's (no targets yet: ``request_counterfactual`` says what it will replace)."""
    if prov.task == PROMPT_TASK:
        prompt = one_line(prov.prompts[0]) if prov.prompts else "''"
        cf_requested = dict(prov.request).get("counterfactual", "")
        if prov.baseline == "mean" or (not prov.baseline and not cf_requested):
            against = MEAN_ABLATION
        elif prov.counterfactual is not None:
            against = (f"its counterfactual {one_line(prov.corrupt[0])} "
                       f"({counterfactual_text(prov.counterfactual)})")
        else:
            against = request_counterfactual or f"its counterfactual {cf_requested!r}"
            if request_counterfactual and not request_counterfactual.startswith("the "):
                against = "its counterfactual " + request_counterfactual
        on = f"your prompt {prompt} vs {against}"
        if prov.answer:
            on += f", explaining {prov.answer!r} against {prov.wrong!r}"
        return on
    if prov.task == OWN_TASK:
        n = prov.n_pairs or own_n
        return f"your own prompt pairs ({n} pairs), not the sidebar prompt"
    return f"task pairs: {prov.task}, {prov.n_pairs} pairs (not the sidebar prompt)"


def graph_title(method: str, n_members: int, n_drawn: int, *, where: str = "base model",
                n_nodes: int | None = None, stale: bool = False) -> str:
    """The graph's title: edges (and drawn edges), the shown scores' method, what model
    (``where``); for a node circuit its node count first. An outdated result says so."""
    what = f"{n_members:,} edges" + (f" ({n_drawn:,} drawn)" if n_members > n_drawn else "")
    label = method_label(method)
    if n_nodes is not None:   # short enough for the plot's width at 1280 px
        at = "" if where == "base model" else f", {where}"
        title = f"{n_nodes:,} nodes, {what}, {label}{at}"
    else:
        title = f"Circuit: {what}, {label}, {where}"
    return title + (" (outdated)" if stale else "")


@dataclass(frozen=True)
class ShownCircuit:
    """The numbers of the circuit on the graph and of the page's default for the same
    scores: sizes after pruning (``n_kept``) and before (``n_top``: top-n, or how many edges
    pass the threshold), recovered shares (``how``: "measured" or "interpolated")."""

    n_kept: int
    n_top: int
    n_total: int
    recovered: float
    how: str
    mode: str = "top-n"
    threshold: float = 0.0
    default_kept: int | None = None
    default_top: int | None = None
    default_recovered: float | None = None
    default_reached: bool = False
    fraction: float = 0.8
    cap: int | None = None
    interval: tuple[float, float] | None = None


def _recovery(value: float, interval: tuple[float, float] | None, n_pairs: int) -> str:
    rec = f"**{value:.0%}**"
    if interval is not None:
        rec += (f" [{interval[0]:.0%}, {interval[1]:.0%}] (95 % bootstrap interval over the "
                f"{n_pairs} pairs)")
    return rec


def circuit_text(prov: Provenance, c: ShownCircuit) -> str:
    """The shown circuit in words: which scores, its size and recovery; the default (the
    smallest measured circuit reaching the target share) when it is shown, or beside the
    shown one when the size was moved; a default keeping more than half of the graph is
    named for what it is (no small circuit reaches the share)."""
    label = method_label(prov.method)
    pairs = "1 pair" if prov.n_pairs == 1 else f"{prov.n_pairs} pairs"
    head = f"{label} scores of {pairs}."
    if c.default_kept is None:
        return (f"{head} Shown: {c.n_kept:,} edges ({_chosen(c)}), recovering "
                f"{c.recovered:.0%}{_how(c.how)}.")
    size = f"{c.default_kept:,} edges (top {c.default_top:,} by |score|, pruned)"
    rec = _recovery(c.default_recovered, c.interval, prov.n_pairs)
    shown_is_default = c.n_kept == c.default_kept and (c.mode != "top-n"
                                                       or c.n_top == c.default_top)
    on = "this pair" if prov.n_pairs == 1 else "these pairs"
    if c.cap is not None and c.default_kept > c.cap:
        default = (f"No measured circuit of at most {c.cap:,} edges has an input → logits "
                   f"path; the default is the smallest that does: {size}, recovering {rec}.")
    elif c.default_reached and 2 * c.default_kept > c.n_total:
        default = (f"No small circuit reaches {c.fraction:.0%} on {on}: the smallest measured "
                   f"circuit that does keeps {c.default_kept:,} of the {c.n_total:,} edges "
                   f"({c.default_kept / c.n_total:.0%} of the graph): {size}, recovering {rec}.")
    elif c.default_reached:
        within = "" if c.cap is None else f" within {c.cap:,} edges"
        default = (f"Default: the smallest measured circuit{within} recovering at least "
                   f"{c.fraction:.0%} of the metric: {size}, recovering {rec}.")
    else:
        within = "" if c.cap is None else f" of at most {c.cap:,} edges"
        default = (f"No measured circuit{within} recovers {c.fraction:.0%}. The most "
                   f"faithful one: {size}, recovering {rec}.")
    if shown_is_default:
        return f"{head} {default}"
    return (f"{head} Shown: {c.n_kept:,} edges ({_chosen(c)}), recovering "
            f"{c.recovered:.0%}{_how(c.how)}. Not the default; for these scores: {default}")


def _chosen(c: ShownCircuit) -> str:
    if c.mode == "top-n":
        return f"top {c.n_top:,} by |score|, pruned"
    return f"the {c.n_top:,} edges with |score| ≥ {c.threshold:.3g}, pruned"


def _how(how: str) -> str:
    return " (interpolated on the curve)" if how == "interpolated" else ""


def pairs_text(prov: Provenance, *, interval: bool) -> str:
    """The gap the recovered share is a share of (clean - corrupted metric, in logits); for
    one pair, that it has no interval and why."""
    clean, corrupt = prov.metric("clean_metric"), prov.metric("corrupt_metric")
    gap = ""
    if clean is not None and corrupt is not None:
        gap = (f"clean − corrupted gap {clean - corrupt:.2f} logits (clean {clean:.2f}, "
               f"{'mean-ablated' if prov.baseline == 'mean' else 'corrupted'} {corrupt:.2f})")
    if prov.n_pairs == 1:
        return ("One pair: the recovery has no interval (a bootstrap over pairs needs at "
                "least two; a task or your own pairs give one)" + (f"; its {gap}." if gap
                                                                   else "."))
    if not gap:
        return ""
    return f"Mean {gap} over the {prov.n_pairs} pairs" + ("." if interval else
                                                          "; no interval yet.")
