"""The participant app of a user study: consent, instructions, items, done.

Every browser session is one participant: it gets its own `StudySession` (and its own
connection to the run's response database), is enrolled only after consenting, and sees
only its own trials, in its own randomised order and under its own conditions. Nothing
on the page names the condition. Each answer is stored the moment it is submitted, so a
closed tab loses nothing; the participant resumes with their code (typed in, or in the
link as ``?code=XXXX-XXXX``).

Serve with ``explorer study run STUDY --dir FOLDER`` or
``panel serve apps/study.py --args FOLDER``.
"""
from __future__ import annotations

import html
import sys
import time
from pathlib import Path
from typing import Any

import panel as pn
import param

from apps import theme
from apps._server import served_origins, with_sign_in_pages
from apps._view import Scope, View
from explorer._checks import ExplorerError
from explorer.studies.randomise import Trial
from explorer.studies.run import StudyRun

__all__ = ["StudySession", "explanation_html", "serve"]

STAGES = ("consent", "instructions", "item", "done", "declined")


# -- explanation displays (pure: explanation dict -> HTML) --------------------------------

def _cell(text: str, value: float, cmap: list[str], low: float, high: float,
          extra_style: str = "") -> str:
    n = len(cmap)
    span = (high - low) or 1.0
    color = cmap[min(n - 1, max(0, int((value - low) / span * (n - 1))))]
    fg = theme.text_colors([value], cmap, low, high)[0]
    return (f'<td style="background:{color};color:{fg};padding:4px 8px;text-align:center;'
            f'{extra_style}">{text}</td>')


def _lens_html(e: dict[str, Any]) -> str:
    k = len(e["tokens"][0]) if e["tokens"] else 0
    head = "".join(f"<th>#{r + 1}</th>" for r in range(k))
    rows = []
    for layer, tokens, probs in zip(e["layers"], e["tokens"], e["probs"]):
        cells = "".join(_cell(f"<code>{html.escape(theme.show_token(t))}</code><br>"
                              f"<small>{p:.2f}</small>", p, theme.PROBABILITY_CMAP, 0.0, 1.0)
                        for t, p in zip(tokens, probs))
        rows.append(f"<tr><th style='padding:4px 8px'>layer {layer}</th>{cells}</tr>")
    return ("<div class='study-explanation'><b>What the model's layers lean towards "
            "(logit lens)</b><br><small>Each row: the tokens the model would predict if it "
            "stopped after that layer, with their probabilities.</small>"
            f"<table style='border-collapse:collapse;margin-top:6px'><tr><th></th>{head}</tr>"
            f"{''.join(rows)}</table></div>")


def _heads_html(e: dict[str, Any]) -> str:
    scores = e["scores"]
    flat = [abs(v) for row in scores for v in row]
    bound = max(flat) if flat and max(flat) > 0 else 1.0
    order = sorted(range(len(flat)), key=lambda i: -flat[i])[: int(e["top"])]
    n_heads = int(e["n_heads"])
    top = {(i // n_heads, i % n_heads) for i in order}
    head = "".join(f"<th>H{h}</th>" for h in range(n_heads))
    rows = []
    for layer, row in enumerate(scores):
        cells = "".join(_cell(f"{v:+.2f}", v, theme.SIGNED_CMAP, -bound, bound,
                              "outline:3px solid black;" if (layer, h) in top else "")
                        for h, v in enumerate(row))
        rows.append(f"<tr><th style='padding:4px 8px'>L{layer}</th>{cells}</tr>")
    token = html.escape(theme.show_token(e.get("token", "")))
    return ("<div class='study-explanation'><b>Direct effect of each head on the prediction</b>"
            f"<br><small>How much each head (H) in each layer (L) raises (+) or lowers (−) the "
            f"logit of <code>{token}</code>; the {int(e['top'])} largest are outlined.</small>"
            f"<table style='border-collapse:collapse;margin-top:6px'><tr><th></th>{head}</tr>"
            f"{''.join(rows)}</table></div>")


_EXPLANATION_HTML = {"logit_lens": _lens_html, "head_attribution": _heads_html}


def explanation_html(explanation: dict[str, Any] | None) -> str:
    """The HTML of an explanation as participants see it ('' for none); placebos are
    rendered exactly like real explanations."""
    if explanation is None:
        return ""
    return _EXPLANATION_HTML[explanation["kind"]](explanation)


# -- the session ---------------------------------------------------------------------------

class StudySession(View):
    """One participant's pass through a study: consent -> instructions -> items -> done.

    Parameters
    ----------
    run : str, Path or StudyRun
        The prepared run folder (opened for this session only) or an open run.
    code : str, optional
        A participant code to offer for resuming (e.g. from ``?code=`` in the link).
    """

    notify_title = None

    def scope(self) -> Scope:
        """The study's own items, as its run folder prepared them."""
        return Scope(on="the study's own items (each participant's in their own order)",
                     edits="not applicable: participants see the prepared items, no workspace")

    stage = param.Selector(objects=list(STAGES), default="consent", doc="Page shown")
    code = param.String(default="", doc="This participant's code ('' before consent)")
    n_answered = param.Integer(default=0, doc="Trials answered so far")

    def __init__(self, run: str | Path | StudyRun, *, code: str = "", **params: Any):
        super().__init__(**params)
        self._run = run if isinstance(run, StudyRun) else StudyRun.open(run)
        study = self._run.study
        self._trials: list[Trial] = []
        self._trial: Trial | None = None
        self._shown_at = 0.0
        self._choice: int | None = None
        self._confidence: int | None = None
        self._agree = pn.widgets.Checkbox(label="I have read the information above and agree to take part")
        self._start = pn.widgets.Button(label="Start the study", color="primary", disabled=True,
                                        width=200)
        self._decline = pn.widgets.Button(label="I do not want to take part", color="light",
                                          width=240)
        self._resume_code = pn.widgets.TextInput(label="Participant code", value=code,
                                                 placeholder="e.g. K7QX-M2PA", width=220)
        self._resume = pn.widgets.Button(label="Resume", color="default", width=120,
                                         align="end")
        self._begin = pn.widgets.Button(label="Begin", color="primary", width=200)
        self._submit = pn.widgets.Button(label="Submit answer", color="primary", disabled=True,
                                         width=200)
        self._choice_buttons: list[pn.widgets.Button] = []
        self._confidence_buttons = [
            pn.widgets.Button(label=self._confidence_label(i, study.task.confidence_levels),
                              color="primary", variant="outline", width=110)
            for i in range(1, study.task.confidence_levels + 1)]
        for i, b in enumerate(self._confidence_buttons, start=1):
            b.on_click(lambda _event, level=i: self._set_confidence(level))
        self._agree.param.watch(lambda e: setattr(self._start, "disabled", not e.new), "value")
        self._start.on_click(self._on_start)
        self._decline.on_click(lambda _e: setattr(self, "stage", "declined"))
        self._resume.on_click(self._on_resume)
        self._begin.on_click(lambda _e: self._show_next())
        self._submit.on_click(self._on_submit)
        self._body = pn.Column(sizing_mode="stretch_width")
        self.param.watch(lambda _e: self._render(), "stage")
        self._render()

    @staticmethod
    def _confidence_label(level: int, levels: int) -> str:
        if level == 1:
            return "1 (a guess)"
        if level == levels:
            return f"{level} (certain)"
        return str(level)

    # -- actions ----------------------------------------------------------------------------
    def _on_start(self, _event: Any = None) -> None:
        if not self._agree.value:
            return
        try:
            participant = self._run.store.enrol()
        except ExplorerError as err:
            self.show_error(err)
            return
        self.code = participant.code
        self._trials = self._run.store.trials(self.code)
        self.stage = "instructions"

    def _on_resume(self, _event: Any = None) -> None:
        try:
            participant = self._run.store.participant(self._resume_code.value)
            self._trials = self._run.store.trials(participant.code)
            self.code = participant.code
        except (ExplorerError, TypeError) as err:
            self.show_error(err)
            return
        theme.notify("info", f"Welcome back: continuing as {self.code}.")
        self._show_next()

    def _show_next(self) -> None:
        self._trial = self._run.store.next_trial(self.code)
        self.n_answered = len(self._run.store.answered(self.code))
        if self._trial is None:
            self.stage = "done"
            return
        self._choice = self._confidence = None
        self._shown_at = time.time()
        if self.stage == "item":
            self._render()
        else:
            self.stage = "item"

    def _set_choice(self, index: int) -> None:
        self._choice = index
        for i, b in enumerate(self._choice_buttons):
            b.variant = "solid" if i == index else "outline"
        self._submit.disabled = self._confidence is None

    def _set_confidence(self, level: int) -> None:
        self._confidence = level
        for i, b in enumerate(self._confidence_buttons, start=1):
            b.variant = "solid" if i == level else "outline"
        self._submit.disabled = self._choice is None

    def _on_submit(self, _event: Any = None) -> None:
        if self._trial is None or self._choice is None or self._confidence is None:
            return
        self._submit.disabled = True  # no double submission while this one is stored
        try:
            self._run.store.record_response(
                self.code, self._trial.index, choice=self._choice, confidence=self._confidence,
                shown_at=self._shown_at, confidence_levels=self._run.study.task.confidence_levels)
        except ExplorerError as err:
            theme.notify("error", f"Your answer could not be saved: {err}")
            self._submit.disabled = False
            return
        self._show_next()

    # -- pages ---------------------------------------------------------------------------------
    def _render(self) -> None:
        self._body.objects = {"consent": self._consent_page, "instructions": self._instructions_page,
                              "item": self._item_page, "done": self._done_page,
                              "declined": self._declined_page}[self.stage]()

    def _consent_page(self) -> list[Any]:
        study = self._run.study
        return [
            pn.pane.Markdown(f"## {study.title}\n\n{study.consent}"),
            self._agree, pn.Row(self._start, self._decline),
            pn.pane.Markdown("---\n**Started before?** Enter your participant code to continue "
                             "where you left off."),
            pn.Row(self._resume_code, self._resume),
        ]

    def _instructions_page(self) -> list[Any]:
        study = self._run.study
        n = len(self._trials)
        return [
            pn.pane.Markdown(f"## Instructions\n\n{study.instructions}\n\nThere are {n} questions."),
            pn.pane.Alert(f"Your participant code is **{self.code}**. Please note it: with it you "
                          "can continue later if you are interrupted. Your answers are saved as "
                          "you go.", alert_type="info"),
            self._begin,
        ]

    def _item_page(self) -> list[Any]:
        display = self._run.trial_display(self._trial)
        n = len(self._trials)
        self._choice_buttons = [pn.widgets.Button(label=theme.show_token(c), color="primary",
                                                  variant="outline", width=160)
                                for c in display["choices"]]
        for i, b in enumerate(self._choice_buttons):
            b.on_click(lambda _event, index=i: self._set_choice(index))
        for b in self._confidence_buttons:
            b.variant = "outline"
        self._submit.disabled = True
        parts: list[Any] = [
            pn.pane.Markdown(f"**Question {self.n_answered + 1} of {n}**"),
            pn.indicators.Progress(value=self.n_answered, max=n, bar_color="primary", height=8),
        ]
        if display["prompt"]:
            parts.append(pn.pane.HTML(
                "<div class='study-prompt'><small>Prompt given to the model:</small><br>"
                f"<span style='font-size:1.3em;font-family:monospace'>{html.escape(display['prompt'])}"
                "<span style='background:#ddd'>&nbsp;?&nbsp;</span></span></div>"))
        if display["context"]:
            parts.append(pn.pane.Markdown(display["context"]))
        if display["explanation"] is not None:
            parts.append(pn.pane.HTML(explanation_html(display["explanation"])))
        parts += [
            pn.pane.Markdown(f"### {display['question']}"),
            pn.FlexBox(*self._choice_buttons),
            pn.pane.Markdown("**How confident are you?**"),
            pn.FlexBox(*self._confidence_buttons),
            self._submit,
        ]
        return parts

    def _done_page(self) -> list[Any]:
        return [pn.pane.Markdown(
            f"## Thank you!\n\nAll {len(self._trials)} answers are saved. You can close this "
            f"page now.\n\nYour participant code: **{self.code}**")]

    def _declined_page(self) -> list[Any]:
        return [pn.pane.Markdown("## No problem\n\nNothing has been recorded. You can close "
                                 "this page now.")]

    def close(self) -> None:
        """Stop this session's jobs and close its connection to the response database."""
        super().close()
        self._run.close()

    def __panel__(self) -> pn.Column:
        return self._body

    def page(self) -> pn.template.FastListTemplate:
        """This session in the shared page template (no sidebar: nothing but the study)."""
        return theme.page([self], title=self._run.study.title)


def session_page(folder: str | Path) -> pn.template.FastListTemplate:
    """A new participant session on the run in ``folder``: one call per browser session."""
    code = ""
    if pn.state.location is not None:
        code = str(pn.state.location.query_params.get("code", "") or "")
    session = StudySession(folder, code=code)
    if pn.state.curdoc is not None:
        pn.state.on_session_destroyed(lambda _ctx: session.close())
    return session.page()


def serve(folder: str | Path, *, port: int = 5007, address: str = "127.0.0.1",
          show: bool = False, allow_websocket_origin: list[str] | None = None,
          **kwargs: Any) -> None:
    """Serve the study in ``folder`` at ``http://ADDRESS:PORT/study`` until interrupted.
    ``kwargs`` (the sign-in: ``basic_auth``, ``cookie_secret``, ...) go to `panel.serve`."""
    StudyRun.open(folder).close()   # fail now, not in the first participant's browser
    theme.enable_extension()
    origins = allow_websocket_origin or served_origins(address, port)
    pn.serve({"study": lambda: session_page(folder)}, port=port, address=address, show=show,
             websocket_origin=origins, title="Study", threaded=False,
             **with_sign_in_pages(kwargs))


if __name__ == "__main__":   # python -m apps.study FOLDER [PORT]
    serve(sys.argv[1], port=int(sys.argv[2]) if len(sys.argv) > 2 else 5007)
elif pn.state.served:        # panel serve apps/study.py --args FOLDER
    theme.enable_extension()
    session_page(sys.argv[1]).servable()
