"""The gallery sidebar's prompt box: the shared prompt, its length in tokens against the
limit (`MAX_PROMPT_TOKENS`, or the model's context when shorter), and a clear message for a
prompt that is empty or too long; under it the second prompt (`Workspace.second_prompt`, the
Two prompts page's B), in a card collapsed while it is empty."""
from __future__ import annotations

from typing import Any

import panel as pn

from apps import theme
from explorer._checks import InputError
from explorer.workspace import MAX_PROMPT_CHARS, MAX_PROMPT_TOKENS, prompt_token_limit

__all__ = ["MAX_PROMPT_TOKENS", "PromptBoxPart"]


# The card's expand arrow: the list template strokes it with a colour variable that its
# design leaves undefined in the sidebar, which drew no arrow at all.
_CARD_CSS = """
.card-header .card-button > svg { stroke: currentColor; }
"""


class PromptBoxPart:
    """The prompt box of `apps.gallery.Gallery`."""

    @property
    def prompt_limit(self) -> int:
        """The longest prompt the sidebar takes, in tokens: `MAX_PROMPT_TOKENS`, or the
        model's context when that is shorter."""
        return prompt_token_limit(self._model.spec)

    def count_tokens(self, text: str) -> int:
        """``text``'s length in tokens, as the pages tokenise it (no special tokens)."""
        return len(self._model.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _check_prompt(self, text: str) -> int:
        """The prompt's length in tokens; InputError saying the limit when it is over it."""
        limit = self.prompt_limit
        if not text.strip():
            raise InputError("the prompt is empty; type at least one non-space character.")
        if len(text) > MAX_PROMPT_CHARS:
            raise InputError(f"the prompt has {len(text):,} characters; the sidebar takes at "
                             f"most {limit:,} tokens ({MAX_PROMPT_CHARS:,} characters).")
        n = self.count_tokens(text)
        if n > limit:
            raise InputError(f"the prompt is {n:,} tokens; the sidebar takes at most {limit:,} "
                             f"tokens ({self._model.spec.name}). Shorten it; nothing was cut.")
        return n

    def _prompt_line(self, text: str) -> str:
        try:
            n = self._check_prompt(text)
        except InputError as exc:
            what = "Too long" if "at most" in str(exc) else "Not run"
            return f"<span style='color:#b00020'>{what}: {exc}</span>"
        return f"{n:,} / {self.prompt_limit:,} tokens · Enter runs it"

    def submit_prompt(self, text: str) -> bool:
        """The prompt typed in the sidebar: shared with every page when it fits the limit;
        refused (one notification saying the limit, the text kept in the box) when not."""
        try:
            self._check_prompt(text)
        except InputError as exc:
            theme.notify("warning", f"Prompt not run: {exc}", duration=8000)
            self.prompt_info = self._prompt_line(text)
            return False
        self.prompt = text
        return True

    def prompt_box(self) -> list[pn.viewable.Viewable]:
        """The sidebar's prompt box (nothing cut: a prompt over the limit is refused with a
        message) and the line under it: its length in tokens and the limit, as you type."""
        box = pn.widgets.TextInput(label="Prompt", value=self.prompt, max_length=MAX_PROMPT_CHARS,
                                   sizing_mode="stretch_width", css_classes=["prompt-box"],
                                   placeholder="Enter a prompt and press Enter",
                                   description=self.param.prompt.doc)
        self.prompt_info = self._prompt_line(self.prompt)
        info = pn.pane.HTML(self.param.prompt_info, css_classes=["prompt-info"], margin=(0, 10),
                            styles={"color": "#555", "font-size": "0.85em"},
                            sizing_mode="stretch_width")

        def typed(event: Any) -> None:
            self.prompt_info = self._prompt_line(event.new or "")

        def entered(event: Any) -> None:
            if event.new != self.prompt:
                self.submit_prompt(event.new)

        def follow(event: Any) -> None:  # a loaded state or link: the box shows its prompt
            if box.value != event.new:
                box.value = event.new
            self.prompt_info = self._prompt_line(event.new)

        box.param.watch(typed, "value_input")
        box.param.watch(entered, "value")
        self.param.watch(follow, "prompt")
        return [box, info]

    def _check_second_prompt(self, text: str) -> int:
        """The second prompt's length in tokens (0 when blank: no second prompt); InputError
        saying the limit when it is over it (the workspace's check: the same limit as the
        prompt's, `Workspace.checked_second_prompt`)."""
        if not text.strip():
            return 0
        self.workspace.checked_second_prompt(text)
        return self.count_tokens(text)

    def _second_prompt_line(self, text: str) -> str:
        if not text.strip():
            return ("Empty: the Two prompts page shows your prompt alone. Type the prompt to "
                    "compare with (e.g. two names swapped) and press Enter.")
        try:
            n = self._check_second_prompt(text)
        except InputError as exc:
            return f"<span style='color:#b00020'>Not set: {exc}</span>"
        return f"{n:,} / {self.prompt_limit:,} tokens · Enter sets it"

    def submit_second_prompt(self, text: str) -> bool:
        """The second prompt typed in the sidebar: kept in the workspace when it fits the
        limit ('' clears it); refused with one notification when not (the text stays)."""
        try:
            self._check_second_prompt(text)
        except InputError as exc:
            theme.notify("warning", f"Second prompt not set: {exc}", duration=8000)
            return False
        self.workspace.second_prompt = text if text.strip() else ""
        return True

    def second_prompt_box(self) -> pn.Card:
        """The sidebar's second prompt (`Workspace.second_prompt`), collapsed while empty: the
        prompt the Two prompts page sets beside the first one."""
        ws = self.workspace
        box = pn.widgets.TextInput(
            label="Prompt B", value=ws.second_prompt, max_length=MAX_PROMPT_CHARS,
            sizing_mode="stretch_width", css_classes=["second-prompt-box"],
            placeholder="Prompt B; Enter sets it",
            description="A second prompt (B) that the Two prompts page shows beside your "
                        "prompt (A), with their difference. Empty for none.")
        info = pn.pane.HTML(self._second_prompt_line(ws.second_prompt),
                            css_classes=["second-prompt-info"], margin=(0, 10),
                            styles={"color": "#555", "font-size": "0.85em"},
                            sizing_mode="stretch_width")
        copy = pn.widgets.Button(label="Start from the prompt", color="light",
                                 sizing_mode="stretch_width", css_classes=["second-from-first"],
                                 description="Set the second prompt to the first one, to "
                                             "change a word of it (then press Enter).")
        card = pn.Card(box, info, copy, title="Second prompt (compare)",
                       collapsed=not ws.second_prompt, sizing_mode="stretch_width",
                       css_classes=["second-prompt"], margin=(5, 10), stylesheets=[_CARD_CSS])

        def typed(event: Any) -> None:
            info.object = self._second_prompt_line(event.new or "")

        def entered(event: Any) -> None:
            if (event.new or "") != ws.second_prompt:
                self.submit_second_prompt(event.new or "")

        def follow(event: Any) -> None:  # a loaded state or link: the box shows its prompt
            if box.value != event.new:
                box.value = event.new
            info.object = self._second_prompt_line(event.new)
            if event.new:
                card.collapsed = False

        box.param.watch(typed, "value_input")
        box.param.watch(entered, "value")
        copy.on_click(lambda _e: setattr(box, "value", self.prompt))  # then edit a word
        ws.param.watch(follow, "second_prompt")
        return card
