"""The Unlearning page's records of what its shown results were computed on, the words
written from them, and its code (`apps.unlearning`'s part; no other page imports it).

Localize keeps a `Provenance` of its inputs (the fact set, how many facts to forget and to
retain, the user's own fact), Run unlearning one of its settings and of the localization it
trained on (its inputs and time); the scope line, the captions over the results, the stale
notes and the page's code are written from these records, never from the controls.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import param

from apps._lab_provenance import LabInput, inputs_text, lab_record, lab_stale_text, plural
from apps._provenance import Provenance
from apps._recipe import MODEL, Call, Expr, Let, Note, Recipe, Ref, Step

__all__ = ["LOCALIZE_INPUTS", "RUN_INPUTS", "localization_caption", "run_caption",
           "UnlearningRecords"]


LOCALIZE_INPUTS = {
    "facts": LabInput("the fact set", "{}"),
    "n_forget": LabInput("the facts to forget", lambda n: f"{n} facts to forget"),
    "n_retain": LabInput("the facts to retain", lambda n: f"{n} to retain"),
    "own": LabInput("your own fact", lambda own: "your own fact first" if own else "")}
"""How the stale note and the captions name what Localize ran on."""

RUN_INPUTS = {
    "methods": LabInput("the localization method", lambda ms: " and ".join(ms)),
    "n_layers": LabInput("the budget", lambda n: f"budget {plural(n, 'MLP layer')}"),
    "steps": LabInput("the training steps", lambda n: plural(n, "step")),
    "lr": LabInput("the learning rate", "learning rate {:g}"),
    "text_weight": LabInput("the general-text weight", "general-text weight {:g}"),
    "relearn_steps": LabInput("the relearning steps", lambda n: plural(n, "relearning step")),
    **LOCALIZE_INPUTS,
    "localized_at": LabInput("the localization (Localize ran since)", lambda at: "")}
"""How the stale note and the captions name what Run unlearning ran on (its localization's
inputs and time too)."""


def localization_caption(record: Provenance | None) -> str:
    """The line over the localization's plots, from its record."""
    if record is None:
        return ""
    return (f"Localized on {record.model}: {inputs_text(record, LOCALIZE_INPUTS)} "
            f"(computed {record.computed_at[11:16]} UTC).")


def run_caption(record: Provenance | None) -> str:
    """The line under the bars, from the run's record: what was trained, how, on which facts."""
    if record is None:
        return ""
    return (f"Unlearning run on {record.model}: {inputs_text(record, RUN_INPUTS)} "
            f"(computed {record.computed_at[11:16]} UTC).")


class UnlearningRecords(param.Parameterized):
    """The records of the Unlearning page's shown localization and run, what the page would
    compute from its controls now, the stale notes comparing the two, and its code."""

    localization_record = param.ClassSelector(
        class_=Provenance, default=None, allow_None=True, precedence=-1,
        doc="What the shown probe, tracing and attribution were computed on.")
    run_record = param.ClassSelector(class_=Provenance, default=None, allow_None=True,
                                     precedence=-1, doc="What the shown run was computed on.")

    def _methods(self) -> list[str]:
        """The localizations Run trains: the selected one, and fact lookup beside it."""
        method = self.method
        return ["fact_lookup", method] if self.compare and method != "fact_lookup" else [method]

    def localization_request(self) -> Provenance:
        """The record of what Localize would compute from the current controls."""
        facts = ("the shipped facts" if self._facts_file is None
                 else f"the facts of {Path(self._facts_file).name}")
        return lab_record("unlearning", self._model.spec.name, {
            "facts": facts + (" (those the model knows)" if self._known_only else ""),
            "n_forget": int(self.n_forget), "n_retain": int(self.n_retain),
            "own": self.own_fact if self._own_fact is not None else None})

    def run_request(self) -> Provenance | None:
        """The record of what Run unlearning would train now: the shown localization's facts
        (Run trains on them) and the current settings; None before Localize."""
        loc = self.localization_record
        if loc is None:
            return None
        return lab_record("unlearning", self._model.spec.name, {
            **dict(loc.request), "methods": self._methods(), "n_layers": int(self.n_layers),
            "steps": int(self.steps), "lr": float(self.lr),
            "relearn_steps": int(self.relearn_steps), "text_weight": float(self.text_weight),
            "localized_at": loc.computed_at})

    def shown_provenance(self) -> Provenance | None:
        """The shown run's record (it holds its localization's inputs), else the shown
        localization's."""
        return self.run_record or self.localization_record

    def requested_provenance(self) -> Provenance | None:
        return self.run_request() if self.run_record is not None else self.localization_request()

    def localization_stale_note(self, *_: Any) -> str:
        """'' while the shown localization is of the controls; else what it was computed on."""
        return lab_stale_text(self.localization_record, self.localization_request(),
                              LOCALIZE_INPUTS, action="Localize")

    def run_stale_note(self, *_: Any) -> str:
        """'' while the shown run is of the controls and the shown localization; else what it
        was computed on."""
        return lab_stale_text(self.run_record, self.run_request(), RUN_INPUTS,
                              action="Run unlearning")

    def stale_note(self) -> str:
        """The stale notes of the localization and of the run, one after the other."""
        return " ".join(n for n in (self.localization_stale_note(), self.run_stale_note()) if n)

    def code_recipe(self) -> Recipe:
        """What the page shows as records (read from the shown results' records): the forget / retain facts, the probe curve, causal
        tracing (the heatmap's fact by position, every fact by layer), attribution patching,
        the layers the method picks, and the unlearning run."""
        u = "explorer.analyses.unlearning"
        loc = None if self.localization_record is None else dict(self.localization_record.request)
        path = None if self._facts_file is None else str(self._facts_file)
        steps: list[Step] = [
            Call("everything", f"{u}.load_attribute_facts", (path,),
                 comment="the shipped facts" if path is None else ""),
            Call("facts", f"{u}.known_facts", (MODEL, Ref("everything")),
                 comment="those the model gets right") if self._known_only
            else Expr("facts", "everything")]
        aliases = {u: "U", "numpy": "np", "explorer.analyses.user_items": "user_items"}
        if loc is None:
            steps += [Call("forget, retain", f"{u}.split_facts",
                           (Ref("facts"), self.n_forget, self.n_retain)),
                      Note("Press Localize on the page for the probe, causal tracing and "
                           "attribution patching")]
            return Recipe(model=self._model.spec.name, steps=steps, aliases=aliases)
        n_forget, n_retain = loc["n_forget"], loc["n_retain"]
        if loc["own"] is not None:
            steps += [Call("own", "explorer.analyses.user_items.parse_unlearning_fact",
                           (loc["own"],), {"attributes": Ref("everything[0].attributes"),
                                           "mc": Ref("everything[0].mc")}, "your fact"),
                      Expr("facts", "[f for f in facts if f.subject != own.subject]"),
                      Call("forget, retain", f"{u}.split_facts",
                           (Ref("facts"), max(2, n_forget - 1), n_retain)),
                      Let("n_forget", n_forget),
                      Expr("forget", "[own, *forget][:n_forget]")]
        else:
            steps.append(Call("forget, retain", f"{u}.split_facts",
                              (Ref("facts"), n_forget, n_retain)))
        steps += [
            Expr("_, counts", "np.unique([f.attribute for f in everything], return_counts=True)"),
            Call("probe", f"{u}.attribute_probe_curve", (MODEL, Ref("everything")),
                 {"n_folds": Ref("int(min(4, counts.min()))")}),
            Note("the heatmap: the first forget fact, from its subject's first token to the end"),
            Expr("first", "U.subject_positions(model, forget[0])[0]"),
            Expr("n", "len(model.tokenizer(U.fact_prompt(forget[0]), "
                 "add_special_tokens=False)['input_ids'])"),
            Call("heat", f"{u}.causal_trace", (MODEL, Ref("forget[:1]")),
                 {"positions": Ref("list(range(first, n))"), "heads": False}),
            Call("trace", f"{u}.causal_trace", (MODEL, Ref("forget")),
                 {"positions": False, "heads": True}),
            Expr("trace['restore_resid']", "heat.restore_resid.reindex(fact=trace.fact)"),
            Expr("trace", "trace.assign_coords(token=heat.token.reindex(fact=trace.fact, "
                 "fill_value=''))"),
            Call("attribution", f"{u}.attribution_patching", (MODEL, Ref("forget"))),
            Call("components", f"{u}.localized_components", (MODEL, self.method, self.n_layers),
                 {"probe": Ref("probe"), "trace": Ref("trace"),
                  "attribution": Ref("attribution")}, "dots on the component map")]
        run = None if self.run_record is None else dict(self.run_record.request)
        if self.result is None or run is None or \
                run["localized_at"] != self.localization_record.computed_at:
            steps.append(Note("Press Run unlearning on the page for U.unlearning_comparison(...)"))
            return Recipe(model=self._model.spec.name, steps=steps, aliases=aliases)
        if run["text_weight"]:
            steps.append(Call("text", f"{u}.text_windows", (MODEL, "train"), {"window": 64}))
        steps += [
            Call("heldout", f"{u}.text_windows", (MODEL, "heldout"),
                 {"window": 64, "max_windows": 16}),
            Call("result", f"{u}.unlearning_comparison", (MODEL, Ref("forget"), Ref("retain")), {
                "methods": list(run["methods"]), "probe": Ref("probe"), "trace": Ref("trace"),
                "attribution": Ref("attribution"),
                "text": Ref("text") if run["text_weight"] else None,
                "heldout_text": Ref("heldout"),
                **{k: run[k] for k in ("n_layers", "steps", "lr", "relearn_steps",
                                       "text_weight")}}, "the bars")]
        return Recipe(model=self._model.spec.name, steps=steps, aliases=aliases)
