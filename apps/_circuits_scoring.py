"""The Circuits page's tasks and scoring: the task's pairs (generated, the user's own, or
the sidebar prompt against its counterfactual), the edge-scoring job (EAP / EAP-IG, then the
measured faithfulness curve), the node curve's job, and showing a result (a method or task
switch shows a computed one at once)."""
from __future__ import annotations

import dataclasses
import re
from typing import Any

import numpy as np
import xarray as xr

import explorer
from apps import _circuit_graph as cg
from apps import theme
from apps._session import CancelToken
from apps._circuits_curve import page_curve_sizes
from apps._circuits_text import METHOD_LABELS, OWN_TASK, PROMPT_TASK
from apps._provenance import Counterfactual, Provenance, computed_at_now
from explorer._checks import InputError
from explorer.analyses import circuit_select as cs
from explorer.analyses import circuits as ca
from explorer.analyses import user_items
from explorer.analyses.circuit_tasks import TokenReplacement, token_replacement
from explorer.interventions import Edit

__all__ = ["METHOD_LABELS", "OWN_TASK", "PROMPT_TASK", "task_logit_diff", "default_task",
           "parse_counterfactual", "counterfactual_spec", "CircuitScoring"]



_SPEC = re.compile(r"^(?P<word>.*?)(?:@(?P<pos>\d+))?=(?P<by>.*)$", re.DOTALL)


def parse_counterfactual(text: str) -> tuple[str, int | None, str]:
    """``word=replacement`` or ``word@position=replacement`` (what a click on the token strip
    writes) as ``(word, position or None, replacement)``. Raises on text without ``=``."""
    m = _SPEC.match(text)
    if m is None:
        raise InputError("the task 'your prompt' needs a counterfactual: a word of the prompt "
                         "and its replacement, e.g. 'John=Paul' or 'John@9=Paul' (the token at "
                         f"position 9), or none, for mean ablation; got {text!r}.")
    pos = m.group("pos")
    return m.group("word").strip(), None if pos is None else int(pos), m.group("by")


def counterfactual_spec(word: str, position: int | None, by: str) -> str:
    """The text `parse_counterfactual` reads back: ``John@9=Mary``."""
    return f"{word.strip()}{'' if position is None else f'@{int(position)}'}={by.strip()}"


def task_logit_diff(model: explorer.Model, task: ca.CircuitTask, *,
                    edits: list[Edit] | tuple = ()) -> dict[str, np.ndarray]:
    """The task's metric in the full model, with ``edits`` applied (`explorer.run_with`): per
    pair, the logit of the answer's first token minus the wrong answer's at the last
    position (the tokens `explorer.analyses.circuits` reads), on the clean and on the
    corrupted prompts. Returns ``{"clean": [prompt], "corrupt": [prompt]}``."""
    ids = np.array([[user_items.continuation_token(model.tokenizer, p, t) for t in (a, w)]
                    for p, a, w in zip(task.clean, task.answer, task.wrong)])   # [prompt, 2]
    rows = np.arange(len(ids))
    out = {}
    for which in ("clean", "corrupt"):
        logits = explorer.run_with(model, getattr(task, which), list(edits), positions=[-1])
        last = logits["logits"].values[:, 0].astype(np.float64)   # [prompt, vocab]
        out[which] = last[rows, ids[:, 0]] - last[rows, ids[:, 1]]
    return out


def default_task(model: explorer.Model, n_prompts: int = 8) -> str:
    """The page's first task: ``ioi`` (SmolLM2 answers 62 of 64 pairs right), unless the
    model's tokenizer splits one of its first ``n_prompts`` clean / corrupted pairs into
    different lengths (a small test tokenizer): then ``add``."""
    task = ca.make_task("ioi", max(1, int(n_prompts)), seed=0)
    clean, corrupt = model.tokenize(list(task.clean)), model.tokenize(list(task.corrupt))
    return "ioi" if list(clean.lengths) == list(corrupt.lengths) else "add"


class CircuitScoring:
    """The scoring part of `apps.circuits.CircuitsView` (a mixin): which pairs, which
    result, the jobs that compute them and what a result sets on the page."""

    def _key(self, method: str | None = None) -> tuple:
        if self.task == OWN_TASK:   # every paste is its own task
            n = len(self._own_task) if self._own_task is not None else 0
            return ((OWN_TASK, self._own_version), n, method or self.method)
        if self.task == PROMPT_TASK:
            return ((PROMPT_TASK, self.prompt, self.counterfactual, self.explain), 1,
                    method or self.method)
        return (self.task, self.n_prompts, method or self.method)

    def _task_data(self, name: str, n: int, *, seed: int = 0) -> ca.CircuitTask:
        """The pairs of the task ``name``: the user's (`use_own`), or ``n`` generated ones."""
        if name == PROMPT_TASK:
            if not self.counterfactual.strip():   # no counterfactual: the mean baseline
                return ca.prompt_task(self._model, self.prompt, "", "", answer=self.explain,
                                      name=PROMPT_TASK)
            word, pos, by = parse_counterfactual(self.counterfactual)
            return ca.prompt_task(self._model, self.prompt, word, by, answer=self.explain,
                                  name=PROMPT_TASK, position=pos)
        if name == OWN_TASK:
            if self._own_task is None:
                raise InputError(f"the task {OWN_TASK!r} has no pairs yet: paste them in "
                                 "'Your own prompt pairs' and press Use.")
            return self._own_task
        return ca.make_task(name, n, seed=seed)

    def use_own(self, text: str) -> ca.CircuitTask | None:
        """Parse the user's prompt pairs (`user_items.parse_circuit_pairs`, checked against the
        model's tokenizer), make them the task and compute their circuit; bad text shows the
        parser's one-line message and keeps the current result."""
        def use(task: ca.CircuitTask) -> None:
            self._own_task = task
            self._keep_own_pairs(text)
            self._own_version += 1
            if OWN_TASK not in self.param.task.objects:
                self.param.task.objects = [*self.param.task.objects, OWN_TASK]
            self.task = OWN_TASK     # computed by `_task_changed` when the page has scored before
            if not self.scoring and self._key() not in self._results:
                self._request_scores()
        return self.adopt_own(text, lambda t: user_items.parse_circuit_pairs(
            t, self._model, name=OWN_TASK), use)

    def _own_pairs_set(self, event: Any) -> None:
        """Pairs set from outside (a link): shown in the box and taken in as Use does; pairs
        refused leave the ones taken in before."""
        if self._taking_own or not event.new:
            return
        if self._own.area.value != event.new:
            self._own.area.value = event.new
        if self.use_own(event.new) is None:
            self._keep_own_pairs(event.old)

    def _keep_own_pairs(self, text: str) -> None:
        """Set `own_pairs` to the pairs taken in (not taking them in again)."""
        self._taking_own = True
        try:
            self.own_pairs = text
        finally:
            self._taking_own = False

    def use_name_variants(self, n: int = 8) -> ca.CircuitTask | None:
        """The prompt's pair and ``n - 1`` more of the same sentence with other names
        (`circuit_tasks.name_variants`), written into 'Your own prompt pairs' and used
        (`use_own`), so the recovery gets its bootstrap interval over the pairs. A prompt
        without a counterfactual, or without a name to vary, shows why and keeps the page."""
        try:
            if not self.counterfactual.strip():
                raise InputError("set a counterfactual first (click a word and type its "
                                 "replacement): the pairs vary its names.")
            task = ca.name_variants(self._model, self._task_data(PROMPT_TASK, 1), n)
        except InputError as exc:
            self.show_error(exc)
            return None
        text = "\n".join(" | ".join(f'"{f}"' for f in row) for row in
                         zip(task.clean, task.corrupt, task.answer, task.wrong))
        self._own.area.value = text
        return self.use_own(text)

    def replacement_of(self, prompt: str, counterfactual: str) -> TokenReplacement | None:
        """Where ``counterfactual`` changes ``prompt`` (`circuit_tasks.token_replacement`);
        None without one. Raises `InputError` on one that does not fit the prompt (a word
        that occurs more than once, without its position, included)."""
        if not counterfactual.strip():
            return None
        word, pos, by = parse_counterfactual(counterfactual)
        return token_replacement(self._model.tokenizer, prompt, word, by, position=pos)

    def request_provenance(self, method: str | None = None) -> Provenance:
        """The inputs Compute would run on now (what the shown result is compared with)."""
        method = method or self.method
        request: dict[str, Any] = {}
        prompts: tuple[str, ...] = ()
        if self.task == PROMPT_TASK:
            prompts = (self.prompt,)
            request = {"counterfactual": self.counterfactual.strip(),
                       "explain": self.explain}
            n = 1
        elif self.task == OWN_TASK:
            request = {"own": self._own_version}
            n = len(self._own_task) if self._own_task is not None else 0
        else:
            n = int(self.n_prompts)
        return Provenance(page="circuits", model=self._model.spec.name, method=method,
                          task=self.task, prompts=prompts, n_pairs=n,
                          request=tuple(sorted(request.items())))

    def _result_provenance(self, wanted: Provenance, task: ca.CircuitTask,
                           scores: xr.Dataset) -> Provenance:
        """``wanted`` completed by what the computation found: the pairs, the counterfactual
        by position, the targets, the metrics, the time."""
        cf = None
        if wanted.task == PROMPT_TASK and task.baseline == "counterfactual":
            r = self.replacement_of(task.clean[0], dict(wanted.request)["counterfactual"])
            cf = Counterfactual(r.position, r.old, r.new)
        metrics = tuple((k, float(scores.attrs[k])) for k in ("clean_metric", "corrupt_metric")
                        if k in scores.attrs)
        prompts = wanted.prompts if wanted.task == PROMPT_TASK else tuple(task.clean)
        return dataclasses.replace(wanted, prompts=prompts, corrupt=tuple(task.corrupt),
                                   counterfactual=cf, baseline=task.baseline,
                                   answer=task.answer[0], wrong=task.wrong[0],
                                   n_pairs=len(task), computed_at=computed_at_now(),
                                   metrics=metrics)

    def shown_provenance(self) -> Provenance | None:
        """The shown scores' record (`View.shown_provenance`)."""
        return self.shown

    def requested_provenance(self) -> Provenance:
        return self.request_provenance()

    @property
    def _shown_method(self) -> str:
        """The attribution method of the shown scores (its provenance's), else the chosen one."""
        return self.shown.method if self.shown is not None else self.method

    def prompt_tokens(self) -> list[str]:
        """The prompt's tokens as the model sees them (spaces shown), for the token strip."""
        ids = self._model.tokenizer(self.prompt, add_special_tokens=False)["input_ids"]
        return [theme.show_token(self._model.tokenizer.decode([i])) for i in ids]

    def click_token(self, pos: int) -> None:
        """Pick token ``pos`` of the prompt as the one the counterfactual replaces (what a
        click on the token strip does); the counterfactual becomes ``word@pos=replacement``:
        that position, not the first place the word occurs."""
        ids = self._model.tokenizer(self.prompt, add_special_tokens=False)["input_ids"]
        pos = int(pos)
        if not 0 <= pos < len(ids):
            raise InputError(f"`pos` must be a token position of the prompt in "
                             f"[0, {len(ids) - 1}]; got {pos}.")
        word = self._model.tokenizer.decode([ids[pos]]).strip()
        if not word:
            raise InputError(f"token {pos} of the prompt is whitespace; click a word.")
        self.clicked = pos
        if list(self._strip.selected) != [pos]:
            self._strip.selected = [pos]
        self._set_counterfactual()

    def _token_clicked(self, event: Any) -> None:
        new = [p for p in event.new if p not in event.old]
        if new and new[-1] == self.clicked:   # the strip following the counterfactual's text
            return
        if not new:            # a click on the picked token again: keep it picked
            if not event.new and self.clicked is not None:
                self._strip.selected = list(event.old)
            return
        try:
            self.click_token(new[-1])
        except InputError as e:
            self.show_error(e)
            self._strip.selected = list(event.old)

    def _set_counterfactual(self) -> None:
        """The clicked token and the typed replacement as the counterfactual's text."""
        pos = self.clicked
        if pos is None:
            return
        ids = self._model.tokenizer(self.prompt, add_special_tokens=False)["input_ids"]
        if pos < len(ids):
            word = self._model.tokenizer.decode([ids[pos]]).strip()
            self.counterfactual = counterfactual_spec(word, pos, self.replacement)

    def _counterfactual_typed(self, *_: Any) -> None:
        """A counterfactual typed (or from a link) that names a position picks that token in
        the strip; one without a position unpicks it."""
        try:
            _, pos, _ = parse_counterfactual(self.counterfactual) \
                if self.counterfactual.strip() else ("", None, "")
        except InputError:
            pos = None
        n = len(self._strip.tokens)
        pos = pos if pos is not None and pos < n else None
        if pos != self.clicked:
            self.clicked = pos
        want = [] if pos is None else [pos]
        if list(self._strip.selected) != want:
            self._strip.selected = want

    def _prompt_changed(self) -> None:
        """New tokens in the strip; the counterfactual's position (if any) picked in them."""
        self.clicked = None
        self._strip.param.update(tokens=self.prompt_tokens(), selected=[])
        self._counterfactual_typed()

    def _other_method(self) -> str:
        return next(m for m in ca.METHODS if m != self.method)

    def _request_node_curve(self) -> None:
        """Measure the node-level faithfulness curve of the shown scores
        (`circuit_select.measured_node_curve`) in a worker."""
        key, task, scores = self._key(self._shown_method), self._task, self.scores
        if scores is None or task is None:
            return
        m, fraction = self._model, self.fraction

        def job(token: CancelToken):
            curve = cs.measured_node_curve(m, task, scores, fraction=fraction,
                                           batch_size=len(task),
                                           progress=self.progress_fn(token), check=token.check)
            return key, curve

        self.status = f"patching node circuits ({len(task)} pairs)…"
        self.submit("nodes", job)

    def _got_node_curve(self, result: tuple) -> None:
        key, curve = result
        self._node_curves[key] = curve
        if key == self._key() and self.scores is not None:
            self.node_curve = curve
            self._set_node_default()
            self._sync_slider()
            d = self._node_default
            self.status = (f"node curve measured: {d.n_edges} nodes recover {d.recovered:.0%}"
                           if d is not None else "node curve measured")

    def _request_scores(self, method: str | None = None) -> None:
        m, task_name = self._model, self.task
        method = method or self.method
        key = self._key(method)
        try:
            task = self._task_data(task_name, self.n_prompts)
        except InputError as e:
            self.show_error(e)
            return
        n = len(task)
        wanted = self.request_provenance(method)

        fraction, cap = self.fraction, self.max_default_edges

        def job(token: CancelToken):
            scores = ca.edge_scores(m, task, method=method, batch_size=n,
                                    progress=self.progress_fn(token))
            token.check()
            curve = cs.measured_default_curve(m, task, scores, fraction=fraction,
                                              sizes=page_curve_sizes(scores, cap),
                                              batch_size=n, progress=self.progress_fn(token),
                                              check=token.check)
            return key, task, scores, curve, wanted

        self.status = f"scoring edges ({METHOD_LABELS[method]}, {n} {task_name} pairs)…"
        self.scoring = True
        self.submit("scores", job)

    def _got_scores(self, result: tuple) -> None:
        key, task, scores, curve, *rest = result
        self.param.update(error="")
        self.scoring = False
        # the first result of a task and prompt count opens on the default circuit; the
        # other method's, arriving after a toggle, keeps the size shown (a fair comparison)
        first = not any(k[:2] == key[:2] for k in self._results if k != key)
        wanted = rest[0] if rest else self.request_provenance(key[2])
        prov = self._result_provenance(wanted, task, scores)
        scores.attrs["page_provenance"] = prov.to_json()
        self._results[key] = (task, scores, curve, prov)
        if key == self._key():
            self._show(key, default=first)
        elif key == self._key(self._other_method()):
            self.other_scores = scores
            self.status = f"{METHOD_LABELS[key[2]]} scores ready for the diff"

    def _show(self, key: tuple, *, default: bool) -> None:
        """Make the result ``key`` the page's: scores, curve, order; the first result also
        fixes the layout (heads by score mass), which no later result changes."""
        task, scores, curve, prov = self._results[key]
        self._task = task
        self._circuit_cache.clear()
        self._influence_cache.clear()
        self._order = np.argsort(-np.abs(scores["score"].values), kind="stable")
        if not self.layout_from:
            self._set_layout(scores, f"{METHOD_LABELS[key[2]]} scores of the base model")
        other = self._results.get((key[0], key[1], self._other_method()))
        self.param.n_edges.bounds = (0, scores.sizes["edge"])
        node_curve = self._node_curves.get(key)
        # the default of these scores before they are shown: the caption re-renders when they
        # are set, and must not describe the previous result's default
        self._default = cs.smallest_faithful_circuit(curve, self.fraction,
                                                     max_edges=self.max_default_edges)
        self._node_default = None if node_curve is None else cs.smallest_faithful_nodes(
            node_curve, self.fraction)
        with self._sizing_by_page():
            self.param.update(n_edges=min(self.n_edges, scores.sizes["edge"]), scores=scores,
                              shown=prov, curve=curve, ablation=None, node_curve=node_curve,
                              other_scores=None if other is None else other[1])
        if node_curve is None and self.nodes_mode():
            self._request_node_curve()
        if default:
            self._set_default_size()
        else:
            self._sync_slider()
        self.status = (f"{scores.sizes['edge']:,} edges scored ({METHOD_LABELS[key[2]]}); "
                       f"clean metric {scores.attrs['clean_metric']:.3f}, corrupted "
                       f"{scores.attrs['corrupt_metric']:.3f}")
        self._request_edited()

    def _set_layout(self, scores: xr.Dataset, label: str) -> None:
        L, H = self._model.n_layers, self._model.spec.n_heads
        self._pos = cg.node_positions(L, H, cg.head_mass_order(scores, L, H))
        self._pos_version += 1
        self._frame_key = None
        self.layout_from = label
        self._refresh_nodes(force=True)

    def _method_changed(self, *_: Any) -> None:
        """EAP <-> EAP-IG: a result already computed is shown at once (same size, same
        layout); else it is computed when any result has been (else on the button)."""
        if self._key() in self._results:
            self._show(self._key(), default=False)
        elif self._results or self.scoring:
            self._request_scores()
        else:
            self.status = f"Press **Compute circuit** to score the edges ({METHOD_LABELS[self.method]})."

    def _task_changed(self, *_: Any) -> None:
        """Another task or prompt count: a result already computed is shown at once; else,
        once the page has scored (or is scoring) anything, the new one is computed (a link or
        a state file that names the task opens on its graph); else on the button."""
        if self._key() in self._results:
            self._show(self._key(), default=False)
        elif (self._results or self.scoring) and not (
                self.task == OWN_TASK and self._own_task is None):
            self._request_scores()

    def _diff_changed(self, *_: Any) -> None:
        """The diff against the other method needs its scores: computed if missing."""
        if self.diff and self.diff_against == "other attribution" and self.scores is not None:
            other = self._key(self._other_method())
            if other in self._results:
                self.other_scores = self._results[other][1]
            else:
                self._request_scores(self._other_method())
