"""The session workspace: one model, the user's prompts, the selected components, the edits.

Every page of the app reads and writes one `Workspace`; a notebook can hold one too. It keeps
components in their one spelling (`explorer.components`: ``L17.H3``, ``L17.MLP``, ``L17``,
``input``, ``logits``), checked against the model's shape, the selected circuit edges
(``L3.H1->L5.MLP``) and token positions of the prompt (``P5``, checked against its length in
tokens when the workspace knows the model's tokenizer), and the active edits as the
intervention records of `explorer.interventions`. It also keeps the user's own items pasted
on pages with task data (`Workspace.items`: page slug -> the pasted text), so they travel
with the state. `Workspace.to_json` writes the whole state
(with the explorer and torch versions) and `Workspace.from_json` reads it back, refusing
anything malformed with an `InputError` (plain JSON only: nothing is evaluated or unpickled).
`Workspace.copy_as_code` gives a short Python snippet that reproduces the state with the
library API.
"""
from __future__ import annotations

import base64
import json
import platform
import re
import zlib
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import param
import torch

from . import components as comp
from ._checks import InputError
from .defaults import DEFAULT_MODEL
from .interventions import Ablate, AddHead, Edit, Patch, Scale, Set, Steer, edit_from_dict

__all__ = ["Workspace", "STATE_FORMAT", "STATE_VERSION", "edit_label", "MAX_STATE_BYTES",
           "MAX_ITEM_CHARS", "MAX_ITEMS", "LINK_VERSION", "MAX_LINK_CHARS", "MAX_PROMPT_CHARS",
           "MAX_PROMPT_TOKENS", "Link", "check_second_prompt", "check_settings",
           "prompt_token_limit", "read_link", "workspace_link"]

STATE_FORMAT = "explorer-workspace"
"""The ``format`` field of an exported state."""

STATE_VERSION = 1
"""The version of the exported state's layout (bumped when a field changes meaning)."""

MAX_STATE_BYTES = 32 * 2**20
"""The largest state `Workspace.from_json` reads (edits with d_model vectors stay far below)."""

MAX_ITEM_CHARS = 100_000
"""The longest pasted item `Workspace.items` keeps (64 ICL pairs of 400-character inputs fit)."""

MAX_ITEMS = 32
"""The most pages with a pasted item in one workspace."""

MAX_PROMPT_CHARS = 100_000
"""The longest prompt a workspace keeps (pages refuse what their method cannot run sooner)."""

MAX_PROMPT_TOKENS = 2048
"""The longest prompt the gallery's sidebar takes, in tokens (less when the model's context is
shorter: `prompt_token_limit`); each page may refuse a shorter one its method cannot draw."""


def prompt_token_limit(spec: Any) -> int:
    """The longest prompt the sidebar takes (and a workspace keeps as its second prompt) for a
    model of ``spec``, in tokens: `MAX_PROMPT_TOKENS`, or the model's context when shorter."""
    return min(MAX_PROMPT_TOKENS, int(getattr(spec, "context_length", 0) or MAX_PROMPT_TOKENS))


class _SecondPrompt(param.String):
    """`Workspace.second_prompt`: every value set is checked by the workspace
    (`Workspace.checked_second_prompt`); a refused one leaves the value as it was."""

    def __set__(self, obj: Any, val: Any) -> None:
        if isinstance(obj, Workspace):
            val = obj.checked_second_prompt(val)
        super().__set__(obj, val)

LINK_VERSION = 1
"""The version of a shareable link's state (`workspace_link`); a link of another is refused."""

MAX_LINK_CHARS = 16_000
"""The longest link state `read_link` reads (browsers keep addresses far longer)."""

_LINK_JSON_BYTES = 2 * 2**20  # a link's state, decompressed, is never larger than this

_KEYS = {"format", "version", "model", "n_layers", "n_heads", "prompts", "second_prompt", "selected",
         "selected_edges", "selected_positions", "selected_features", "edits", "items", "settings",
         "versions"}
_ITEM_KEY = re.compile(r"[a-z0-9][a-z0-9_-]{0,63}")  # a page slug: 'conflicts', 'icl-heads'

_SNIPPET_FLOATS = 16  # edits holding more numbers than this are read from the state file


def edit_label(edit: Edit) -> str:
    """One line naming an edit with the component spelling: ``ablate L3.H1 (zero)``."""
    if isinstance(edit, Ablate):
        where = str(comp.head(edit.layer, edit.head))
        how = edit.mode if edit.value is None else "mean (given)"
        text = f"ablate {where} ({how})"
    elif isinstance(edit, Scale):
        text = f"scale {comp.head(edit.layer, edit.head)} × {edit.alpha:g}"
    elif isinstance(edit, AddHead):
        text = f"add to {comp.head(edit.layer, edit.head)} × {edit.alpha:g}"
    elif isinstance(edit, Steer):
        at = "" if edit.site == "resid_post" else f"{edit.site} "
        text = f"steer {at}L{edit.layer} × {edit.alpha:g}"
    elif isinstance(edit, Patch):
        where = (str(comp.head(edit.layer, edit.head)) if edit.head is not None
                 else f"{edit.site} L{edit.layer}")
        source = (repr(edit.source[:24]) if isinstance(edit.source, str)
                  else f"{len(edit.source)} token ids")
        text = f"patch {where} from {source}"
    elif isinstance(edit, Set):
        where = (str(comp.head(edit.layer, edit.head)) if edit.head is not None
                 else f"{edit.site} L{edit.layer}")
        text = f"{'add to' if edit.add else 'set'} {where} (given values)"
    else:  # pragma: no cover - every record kind is named above
        text = edit.kind
    positions = getattr(edit, "positions", None)
    if positions is not None:
        text += f" at pos {', '.join(str(p) for p in positions[:4])}" + ("…" if len(positions) > 4 else "")
    if edit.prompts is not None:
        text += f" in prompt {', '.join(str(p) for p in edit.prompts)}"
    return text


class _Shape:
    """The parts of a model an edit's ``validate`` reads, from the workspace's numbers."""

    def __init__(self, n_layers: int, n_heads: int, d_head: int | None, d_model: int | None):
        self.n_layers, self.n_heads = n_layers, n_heads
        self.spec = self  # edits read ``model.spec.d_head`` / ``model.spec.d_model``
        self.d_head, self.d_model = d_head, d_model

    def check_layer(self, layer: Any, name: str = "layer") -> int:
        from ._checks import check_int

        return check_int(name, layer, low=0, high=self.n_layers - 1)

    def check_head(self, head: Any, name: str = "head") -> int:
        from ._checks import check_int

        return check_int(name, head, low=0, high=self.n_heads - 1)


class Workspace(param.Parameterized):
    """A session's shared state: model, prompts, selected components, the stack of edits.

    Parameters
    ----------
    model_name : str
        The model the state belongs to (a name `explorer.load_model` reads).
    n_layers, n_heads : int, optional
        The model's shape; selections and edits are checked against it when given.
    prompts : list of str
        The user's prompts; the first is the one single-prompt pages show (`prompt`).
    second_prompt : str
        A second prompt to set beside the first (the *Two prompts* page shows both and
        their difference); '' (the default) when there is none. Every value set is checked
        (`checked_second_prompt`): with the model's tokenizer (`from_model`), one over the
        sidebar's limit for a prompt (`prompt_limit`) is refused with an `InputError` naming
        its length and the limit, and the workspace keeps the one it had.
    selected : list of str
        Selected components (heads, MLPs, layers, input, logits) in their one spelling, in
        the order they were selected.
    selected_edges : list of str
        Selected circuit edges, ``"L3.H1->L5.MLP"`` (`explorer.components.Edge`), in order.
    selected_positions : list of int
        Selected token positions of the first prompt (0-based; spelled ``P5``), in order.
        Checked against the prompt's length in tokens when the workspace has the model's
        tokenizer (`from_model`); a prompt change drops the positions past its end.
    selected_features : list of str
        Selected dictionary features, ``"L5.F123"`` (`explorer.components.Feature`: feature
        123 of the Feature dashboards page's dictionary at layer 5), in order; the layer is
        checked against the model's depth.
    edits : list of Edit
        Active interventions, applied in order by pages that run the model with edits.
    items : dict of str to str
        The user's own items pasted on pages with task data: page slug (``"conflicts"``)
        -> the pasted text, kept as typed (each page parses it). Plain strings only, at
        most `MAX_ITEM_CHARS` characters each and `MAX_ITEMS` pages.

    `select`, `deselect`, `toggle` and `set_selection` take any of the three kinds (in any
    spelling `explorer.components.parse_any` reads) and file each under its list.
    Lists are replaced, never changed in place, so watchers of a parameter see every change.
    `Workspace.from_model` fills the model fields from a loaded `explorer.Model`.
    """

    model_name = param.String(default=DEFAULT_MODEL, doc="Model the state belongs to.")
    n_layers = param.Integer(default=None, allow_None=True, bounds=(1, None),
                             doc="Layers of the model (selections are checked against it).")
    n_heads = param.Integer(default=None, allow_None=True, bounds=(1, None),
                            doc="Heads per layer of the model.")
    prompts = param.List(default=["The capital of France is"], item_type=str,
                         doc="The user's prompts; the first is the one pages show.")
    second_prompt = _SecondPrompt(default="", doc="A second prompt shown beside the first "
                                                  "(the Two prompts page); '' for none.")
    selected = param.List(default=[], item_type=str,
                          doc="Selected components, canonical spelling, in selection order.")
    selected_edges = param.List(default=[], item_type=str,
                                doc="Selected circuit edges, canonical spelling, in order.")
    selected_positions = param.List(default=[], item_type=int,
                                    doc="Selected token positions of the first prompt, in order.")
    selected_features = param.List(default=[], item_type=str,
                                   doc="Selected dictionary features (``L5.F123``: feature 123 "
                                       "of the Feature dashboards page's dictionary at layer "
                                       "5), in order.")
    edits = param.List(default=[], item_type=Edit, doc="Active edits, applied in order.")
    items = param.Dict(default={}, doc="The user's pasted items: page slug -> text.")
    settings = param.Dict(default={}, doc="Pages' main settings: page slug -> {parameter: "
                                          "value} (their ``link_params``).")

    def __init__(self, **params: Any):
        d_head = params.pop("d_head", None)
        d_model = params.pop("d_model", None)
        selected = list(_as_list(params.pop("selected", [])))
        selected += _as_list(params.pop("selected_edges", []))
        selected += _as_list(params.pop("selected_positions", []))
        selected += _as_list(params.pop("selected_features", []))
        self._count_tokens = params.pop("count_tokens", None)
        self._prompt_tokens = params.pop("prompt_tokens", None)
        self._prompt_limit = params.pop("prompt_limit", None)
        self._parallel = bool(params.pop("parallel", False))
        self._token_counts: dict[str, int] = {}
        edits = params.pop("edits", [])
        if "prompts" in params:
            params["prompts"] = _check_prompt_list(params["prompts"])
        if "items" in params:
            params["items"] = check_items(params["items"])
        if "settings" in params:
            params["settings"] = check_settings(params["settings"])
        super().__init__(**params)
        self._d_head, self._d_model = d_head, d_model
        self.param.update(**self._sorted_names(selected))
        self.edits = [self._checked_edit(e) for e in edits]
        self.param.watch(self._positions_follow_prompt, "prompts")  # before any page's watcher

    @classmethod
    def from_model(cls, model: Any, **params: Any) -> Workspace:
        """A workspace for a loaded `explorer.Model` (its name and shape)."""
        spec = model.spec
        return cls(model_name=spec.name, n_layers=spec.n_layers, n_heads=spec.n_heads,
                   d_head=spec.d_head, d_model=spec.d_model, count_tokens=_token_counter(model),
                   prompt_tokens=_prompt_token_counter(model),
                   prompt_limit=prompt_token_limit(spec), parallel=_parallel(model), **params)

    def set_model(self, model: Any) -> tuple[list[str], list[Edit], str]:
        """Move the workspace to another loaded model: its name and shape; the selections and
        edits that do not fit it are dropped, and the second prompt when it is over the new
        model's limit (`prompt_token_limit`). Returns (dropped selections, dropped edits, the
        dropped second prompt or '')."""
        spec = model.spec
        self._d_head, self._d_model = spec.d_head, spec.d_model
        self._count_tokens, self._parallel = _token_counter(model), _parallel(model)
        self._prompt_tokens, self._prompt_limit = (_prompt_token_counter(model),
                                                   prompt_token_limit(spec))
        self._token_counts = {}
        kept, dropped = [], []
        with param.parameterized.batch_call_watchers(self):
            self.param.update(model_name=spec.name, n_layers=spec.n_layers, n_heads=spec.n_heads)
            for name in self.selection:
                try:
                    kept.append(self._checked(name))
                except InputError:
                    dropped.append(name)
            edits, gone = [], []
            for e in self.edits:
                try:
                    edits.append(self._checked_edit(e))
                except (InputError, ValueError, TypeError):
                    gone.append(e)
            second = self.second_prompt
            try:
                self.checked_second_prompt(second)
                second_gone = ""
            except InputError:
                second_gone = second
            self.param.update(edits=edits, **self._sorted_names(kept),
                              **({"second_prompt": ""} if second_gone else {}))
        return dropped, gone, second_gone

    # -- prompts ---------------------------------------------------------------------------
    @property
    def prompt(self) -> str:
        """The first prompt ('' when there is none)."""
        return self.prompts[0] if self.prompts else ""

    @prompt.setter
    def prompt(self, text: str) -> None:
        if not isinstance(text, str):
            raise TypeError(f"a prompt is a str; got {type(text).__name__}.")
        _check_prompt_list([text])
        if text != self.prompt:
            self.prompts = [text, *self.prompts[1:]]

    @property
    def prompt_limit(self) -> int | None:
        """The longest second prompt the workspace keeps, in tokens: the sidebar's limit for a
        prompt (`prompt_token_limit` of its model); None without the model's tokenizer."""
        return self._prompt_limit

    def checked_second_prompt(self, text: Any) -> str:
        """``text`` as the second prompt is kept (`check_second_prompt`), within the sidebar's
        limit for a prompt once the workspace has the model's tokenizer: InputError (one line:
        its length and the limit) for one over it. Blank text is no prompt and passes."""
        text = check_second_prompt(text)
        limit, count = self._prompt_limit, self._prompt_tokens
        if text.strip() and limit is not None and count is not None:
            n = count(text)
            if n > limit:
                raise InputError(f"the second prompt is {n:,} tokens; a prompt takes at most "
                                 f"{limit:,} tokens on {self.model_name} (the sidebar's limit). "
                                 "Shorten it; nothing was cut.")
        return text

    # -- selection -------------------------------------------------------------------------
    @property
    def n_tokens(self) -> int | None:
        """The first prompt's length in tokens (None when the workspace has no tokenizer)."""
        if self._count_tokens is None:
            return None
        text = self.prompt
        if text not in self._token_counts:
            self._token_counts = {text: int(self._count_tokens(text))}  # the latest prompt only
        return self._token_counts[text]

    def component(self, name: str | comp.Component) -> str:
        """``name`` in the one spelling, checked against the model's shape (InputError if bad)."""
        try:
            if self.n_layers is not None and self.n_heads is not None:
                return str(comp.check_in_model(name, self.n_layers, self.n_heads))
            return comp.canonical(name)
        except comp.ComponentError as exc:
            raise InputError(f"{exc}.") from None

    def _checked(self, name: Any) -> comp.Component | comp.Edge | comp.Position | comp.Feature:
        """A component, edge, position or feature, checked against the model and the prompt."""
        try:
            x = comp.parse_any(name)
            if isinstance(x, comp.Position):
                return comp.check_position(x, self.n_tokens)
            return comp.check_any(x, self.n_layers, self.n_heads, parallel=self._parallel)
        except comp.ComponentError as exc:
            raise InputError(f"{exc}.") from None

    def _sorted_names(self, names: Iterable[Any]) -> dict[str, list]:
        """``names`` checked, once each, filed as {selected, selected_edges, selected_positions}."""
        out: dict[str, list] = {"selected": [], "selected_edges": [], "selected_positions": [],
                                "selected_features": []}
        for name in _as_list(names):
            x = self._checked(name)
            key, value = _filed(x)
            if value not in out[key]:
                out[key].append(value)
        return out

    def _checked_names(self, names: Iterable[str | comp.Component]) -> list[str]:
        """Components only (what ``selected`` holds), checked, once each."""
        out: list[str] = []
        for name in _as_list(names):
            c = self.component(name)
            if c not in out:
                out.append(c)
        return out

    @property
    def selection(self) -> list[str]:
        """Everything selected, in one spelling: components, then edges, then positions, then
        dictionary features."""
        return ([*self.selected, *self.selected_edges]
                + [str(comp.Position(p)) for p in self.selected_positions]
                + list(self.selected_features))

    def select(self, *names: Any) -> list[str]:
        """Add components, edges or positions to the selection (each once, the newest last);
        returns their spelling."""
        new = self._sorted_names(names)
        update = {key: [v for v in getattr(self, key) if v not in values] + values
                  for key, values in new.items() if values}
        self.param.update(**update)
        return [_spelled(key, v) for key, values in new.items() for v in values]

    def deselect(self, *names: Any) -> None:
        """Remove components, edges or positions from the selection (those not selected are
        ignored)."""
        gone = self._sorted_names(names)
        update = {key: [v for v in getattr(self, key) if v not in values]
                  for key, values in gone.items() if set(values) & set(getattr(self, key))}
        if update:
            self.param.update(**update)

    def toggle(self, name: Any) -> bool:
        """Select ``name`` if it is not selected, else deselect it; True if now selected."""
        key, value = _filed(self._checked(name))
        if value in getattr(self, key):
            self.deselect(name)
            return False
        self.select(name)
        return True

    def set_selection(self, names: Iterable[Any]) -> None:
        """Replace the whole selection (components, edges and positions; e.g. from a
        multi-choice widget)."""
        new = self._sorted_names(names)
        update = {key: values for key, values in new.items() if values != getattr(self, key)}
        if update:
            self.param.update(**update)

    def clear_selection(self) -> None:
        """Drop every selected component, edge and position."""
        update = {key: [] for key in ("selected", "selected_edges", "selected_positions",
                                      "selected_features") if getattr(self, key)}
        if update:
            self.param.update(**update)

    @property
    def selected_heads(self) -> list[tuple[int, int]]:
        """(layer, head) of every selected head, in selection order."""
        return [(c.layer, c.head) for c in map(comp.parse, self.selected) if c.is_head]

    @property
    def edge_pairs(self) -> list[tuple[str, str]]:
        """(source, target) of every selected edge, each in the component spelling."""
        return [(str(e.src), str(e.dst)) for e in map(comp.parse_edge, self.selected_edges)]

    def _positions_follow_prompt(self, event: Any) -> None:
        try:
            n = self.n_tokens
        except InputError:
            return  # a prompt with no tokens (blank): the pages report it, nothing is dropped
        if n is not None and any(p >= n for p in self.selected_positions):
            self.selected_positions = [p for p in self.selected_positions if p < n]

    # -- edits -----------------------------------------------------------------------------
    def _checked_edit(self, edit: Edit | dict) -> Edit:
        if isinstance(edit, dict):
            edit = edit_from_dict(edit)
        if not isinstance(edit, Edit):
            raise TypeError(f"an edit is an explorer intervention record (Ablate, Scale, Patch, "
                            f"Steer, AddHead, Set); got {type(edit).__name__}.")
        if self.n_layers is not None and self.n_heads is not None:
            shape = _Shape(self.n_layers, self.n_heads, self._d_head, self._d_model)
            if self._d_head is None or self._d_model is None:
                shape.check_layer(edit.layer)
                if getattr(edit, "head", None) is not None:
                    shape.check_head(edit.head)
            else:
                edit.validate(shape)
        return edit

    def push_edit(self, edit: Edit | dict) -> Edit:
        """Put an edit on top of the stack (checked against the model's shape)."""
        edit = self._checked_edit(edit)
        self.edits = [*self.edits, edit]
        return edit

    def remove_edit(self, which: int | Edit) -> Edit:
        """Take one edit off the stack, by its index or the record itself."""
        if isinstance(which, Edit):
            if which not in self.edits:
                raise InputError(f"{edit_label(which)!r} is not on the edit stack.")
            index = self.edits.index(which)
        else:
            n = len(self.edits)
            if isinstance(which, bool) or not isinstance(which, int) or not -n <= which < n:
                raise InputError(f"`which` must be an edit's index in [0, {n - 1}] or the edit "
                                 f"itself; got {which!r}." if n else "the edit stack is empty.")
            index = which % n
        edits = list(self.edits)
        gone = edits.pop(index)
        self.edits = edits
        return gone

    def clear_edits(self) -> None:
        if self.edits:
            self.edits = []

    @property
    def edit_labels(self) -> list[str]:
        return [edit_label(e) for e in self.edits]

    # -- the user's own items ---------------------------------------------------------------
    def set_item(self, page: str, text: str) -> None:
        """Keep ``text`` as the item pasted on ``page`` (a page slug); '' forgets it."""
        if not isinstance(text, str):
            raise InputError(f"a pasted item must be text; got {type(text).__name__}.")
        items = dict(self.items)
        if text:
            items[page] = text
        else:
            items.pop(page, None)
        items = check_items(items)
        if items != self.items:
            self.items = items

    def item(self, page: str) -> str:
        """The text pasted on ``page`` ('' when there is none)."""
        return self.items.get(page, "")

    # -- state -----------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """The state as plain JSON-able data (what `to_json` writes)."""
        from ._version import __version__

        return {
            "format": STATE_FORMAT,
            "version": STATE_VERSION,
            "model": self.model_name,
            "n_layers": self.n_layers,
            "n_heads": self.n_heads,
            "prompts": list(self.prompts),
            "second_prompt": self.second_prompt,
            "selected": list(self.selected),
            "selected_edges": list(self.selected_edges),
            "selected_positions": [str(comp.Position(p)) for p in self.selected_positions],
            "selected_features": list(self.selected_features),
            "edits": [e.to_dict() for e in self.edits],
            "items": dict(self.items),
            "settings": {k: dict(v) for k, v in self.settings.items()},
            "versions": {"explorer": __version__, "torch": torch.__version__,
                         "python": platform.python_version()},
        }

    def to_json(self, *, indent: int | None = 1) -> str:
        """The state as JSON text (`from_json` reads it back)."""
        return json.dumps(self.state(), indent=indent)

    @classmethod
    def from_json(cls, text: str | bytes, *, model: Any = None) -> Workspace:
        """Read a state written by `to_json`; InputError naming the problem for anything else.

        With ``model`` (a loaded `explorer.Model`), the state must belong to it and its
        selections and edits are checked against its shape (vector lengths included).
        """
        if isinstance(text, (bytes, bytearray)):
            if len(text) > MAX_STATE_BYTES:
                raise InputError(f"the state file is {len(text)} bytes; at most "
                                 f"{MAX_STATE_BYTES} are read.")
            try:
                text = bytes(text).decode("utf-8")
            except UnicodeDecodeError:
                raise InputError("the state file is not UTF-8 text (an explorer state is "
                                 "JSON).") from None
        if not isinstance(text, str):
            raise TypeError(f"a state is JSON text; got {type(text).__name__}.")
        if len(text) > MAX_STATE_BYTES:
            raise InputError(f"the state is {len(text)} characters; at most {MAX_STATE_BYTES} "
                             "are read.")
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise InputError(f"the state is not valid JSON: {e.msg} at line {e.lineno}, "
                             f"column {e.colno}.") from None
        return cls.from_state(data, model=model)

    @classmethod
    def from_state(cls, data: Any, *, model: Any = None) -> Workspace:
        """A workspace from `state` data (see `from_json`)."""
        if not isinstance(data, dict):
            raise InputError(f"a state is a JSON object; got a JSON {_json_kind(data)}.")
        if data.get("format") != STATE_FORMAT:
            raise InputError(f"not an explorer state: its 'format' is {data.get('format')!r}, "
                             f"not {STATE_FORMAT!r}.")
        version = data.get("version")
        if version != STATE_VERSION:
            raise InputError(f"this explorer reads state version {STATE_VERSION}; the file has "
                             f"version {version!r}.")
        unknown = sorted(set(data) - _KEYS)
        if unknown:
            raise InputError(f"unknown field(s) in the state: {', '.join(map(repr, unknown))}; "
                             f"a state has {', '.join(sorted(_KEYS))}.")
        name = data.get("model")
        if not isinstance(name, str) or not name:
            raise InputError(f"the state's 'model' must be a model name; got {name!r}.")
        shape = {}
        for key in ("n_layers", "n_heads"):
            value = data.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                raise InputError(f"the state's {key!r} must be a positive int or null; "
                                 f"got {value!r}.")
            shape[key] = value
        prompts = data.get("prompts", [])
        if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
            raise InputError("the state's 'prompts' must be a list of strings.")
        try:  # states written before the second prompt travelled have none
            second = check_second_prompt(data.get("second_prompt", ""))
        except InputError as exc:
            raise InputError(f"the state's 'second_prompt': {exc}") from None
        selected = data.get("selected", [])
        if not isinstance(selected, list) or not all(isinstance(s, str) for s in selected):
            raise InputError("the state's 'selected' must be a list of component names "
                             "(strings such as 'L3.H1').")
        edges = data.get("selected_edges", [])  # states written before edges travelled: none
        if not isinstance(edges, list) or not all(isinstance(s, str) for s in edges):
            raise InputError("the state's 'selected_edges' must be a list of edge names "
                             "(strings such as 'L3.H1->L5.MLP').")
        features = data.get("selected_features", [])   # states written before features: none
        if not isinstance(features, list) or not all(isinstance(s, str) for s in features):
            raise InputError("the state's 'selected_features' must be a list of feature names "
                             "(strings such as 'L5.F123').")
        positions = data.get("selected_positions", [])
        if not isinstance(positions, list) or not all(
                isinstance(p, str) or (isinstance(p, int) and not isinstance(p, bool))
                for p in positions):
            raise InputError("the state's 'selected_positions' must be a list of token "
                             "positions (strings such as 'P5').")
        edits = data.get("edits", [])
        if not isinstance(edits, list):
            raise InputError("the state's 'edits' must be a list of edit objects.")
        try:  # states written before pasted items travelled have none
            items = check_items(data.get("items", {}))
        except InputError as exc:
            raise InputError(f"the state's 'items': {exc}") from None
        try:  # nor pages' settings
            settings = check_settings(data.get("settings", {}))
        except InputError as exc:
            raise InputError(f"the state's 'settings': {exc}") from None
        try:
            prompts = _check_prompt_list(prompts)
        except InputError as exc:
            raise InputError(f"the state's 'prompts': {exc}") from None
        if model is not None:
            spec = model.spec
            if name != spec.name:
                raise InputError(f"the state is for model {name!r}; the session runs "
                                 f"{spec.name!r}.")
            for key, value in shape.items():
                if value is not None and value != getattr(spec, key):
                    raise InputError(f"the state's model has {key}={value}; {spec.name} has "
                                     f"{getattr(spec, key)}.")
            ws = cls.from_model(model, prompts=prompts, items=items, settings=settings)
            ws.second_prompt = second     # within the model's limit (the error names it)
        else:
            ws = cls(model_name=name, prompts=prompts, second_prompt=second, items=items,
                     settings=settings, **shape)
        records = []
        for i, d in enumerate(edits):
            try:
                records.append(ws._checked_edit(d))
            except (InputError, TypeError, ValueError) as exc:
                raise InputError(f"edit {i} of the state: {exc}") from None
        try:
            ws.selected = ws._checked_names(selected)
        except InputError as exc:
            raise InputError(f"the state's selection: {exc}") from None
        for key, names, what in (("selected_edges", edges, "edges"),
                                 ("selected_positions", positions, "positions"),
                                 ("selected_features", features, "features")):
            try:
                filed = ws._sorted_names([_as_kind(key, n) for n in names])
            except InputError as exc:
                raise InputError(f"the state's selected {what}: {exc}") from None
            setattr(ws, key, filed[key])
        ws.edits = records
        return ws

    def update_from(self, other: Workspace) -> None:
        """Take ``other``'s prompts (the second one too), selection, edits and items (a loaded
        state), in one update."""
        if other.model_name != self.model_name:
            raise InputError(f"the state is for model {other.model_name!r}; this workspace "
                             f"holds {self.model_name!r}.")
        second = self.checked_second_prompt(other.second_prompt)  # refused: nothing changes
        self.param.update(prompts=list(other.prompts), second_prompt=second,
                          selected=list(other.selected),
                          selected_edges=list(other.selected_edges),
                          selected_positions=list(other.selected_positions),
                          selected_features=list(other.selected_features),
                          edits=list(other.edits), items=dict(other.items),
                          settings={k: dict(v) for k, v in other.settings.items()})

    # -- code ------------------------------------------------------------------------------
    def copy_as_code(self, *, state_file: str = "explorer-state.json") -> str:
        """A short Python snippet that rebuilds this state with the library API and runs the
        prompts clean and with the edits (edits with long vectors are read from the exported
        state, ``state_file``)."""
        lines = ["import explorer", "", f"model = explorer.load_model({self.model_name!r})",
                 f"prompts = {list(self.prompts)!r}"]
        if self.second_prompt:
            lines.append(f"second_prompt = {self.second_prompt!r}  # the Two prompts page's B")
        if self.selected:
            lines.append(f"selected = {list(self.selected)!r}  # explorer.components spelling")
        if self.selected_edges:
            lines.append(f"selected_edges = {list(self.selected_edges)!r}  # circuit edges")
        if self.selected_positions:
            lines.append(f"selected_positions = {list(self.selected_positions)!r}"
                         "  # token positions of prompts[0]")
        if self.selected_features:
            lines.append(f"selected_features = {list(self.selected_features)!r}"
                         "  # dictionary features: layer, feature index")
        if any(_n_floats(e) > _SNIPPET_FLOATS for e in self.edits):
            lines += ["from pathlib import Path",
                      "from explorer.workspace import Workspace",
                      f"edits = Workspace.from_json(Path({state_file!r}).read_text()).edits"]
        elif self.edits:
            names = sorted({type(e).__name__ for e in self.edits})
            lines[0] = f"import explorer\nfrom explorer import {', '.join(names)}"
            lines.append("edits = [" + ",\n         ".join(_edit_code(e) for e in self.edits) + "]")
        else:
            lines.append("edits = []")
        lines += ["", "patterns = explorer.trace(model, prompts, sites=('attn_pattern',))"
                      "  # every head's attention",
                  "lens = explorer.logit_lens(model, prompts)",
                  "edited = explorer.run_with(model, prompts, edits)  # logits with the edits"]
        return "\n".join(lines) + "\n"

    def __repr__(self) -> str:
        return (f"Workspace(model_name={self.model_name!r}, prompts={list(self.prompts)!r}, "
                f"selected={self.selection!r}, edits={self.edit_labels!r}"
                + (f", second_prompt={self.second_prompt!r}" if self.second_prompt else "")
                + (f", items={sorted(self.items)!r}" if self.items else "") + ")")

    __str__ = __repr__


_FILED = {comp.Component: "selected", comp.Edge: "selected_edges",
          comp.Position: "selected_positions", comp.Feature: "selected_features"}


def _filed(x: comp.Component | comp.Edge | comp.Position | comp.Feature
           ) -> tuple[str, str | int]:
    """(the parameter ``x`` is kept in, the value kept there)."""
    key = _FILED[type(x)]
    return key, (x.index if isinstance(x, comp.Position) else str(x))


def _spelled(key: str, value: str | int) -> str:
    return str(comp.Position(value)) if key == "selected_positions" else value


def _as_list(names: Any) -> list:
    if isinstance(names, (str, int, comp.Component, comp.Edge, comp.Position, comp.Feature)):
        return [names]
    return list(names)


def _as_kind(key: str, name: Any) -> Any:
    """A state's edge, position or feature name, read as that kind (a component name in the
    edge list is refused as not an edge)."""
    read = {"selected_edges": comp.parse_edge, "selected_features": comp.parse_feature}
    try:
        return read.get(key, comp.parse_position)(name)
    except comp.ComponentError as exc:
        raise InputError(f"{exc}.") from None


def _token_counter(model: Any) -> Any:
    """A function giving a prompt's length in tokens, as the pages count them."""
    def count(text: str) -> int:
        return len(model.tokenize(text).token_ids[0])
    return count


def _prompt_token_counter(model: Any) -> Any:
    """A function giving a prompt's length in tokens as the sidebar counts it against its
    limit (no special tokens)."""
    def count(text: str) -> int:
        return len(model.tokenizer(text, add_special_tokens=False)["input_ids"])
    return count


def _parallel(model: Any) -> bool:
    """Whether the model's MLPs read what their layer's heads read (no head -> own MLP edge)."""
    from .heads import parallel_attn_mlp

    try:
        return bool(parallel_attn_mlp(model))
    except Exception:  # noqa: BLE001 - a family the edge table does not know: sequential
        return False


def _edit_code(edit: Edit) -> str:
    d = edit.to_dict()
    d.pop("kind")
    args = ", ".join(f"{k}={tuple(v) if isinstance(v, list) else v!r}" for k, v in d.items()
                     if not (v is None and k in ("value", "positions", "prompts", "head")))
    return f"{type(edit).__name__}({args})"


def _n_floats(edit: Edit) -> int:
    return sum(len(getattr(edit, k, None) or ()) for k in ("value", "vector"))


def check_items(items: Any) -> dict[str, str]:
    """``items`` as a page slug -> pasted text dict; InputError (one line) for anything else."""
    if not isinstance(items, dict):
        raise InputError(f"pasted items must be an object of page name -> text; got a JSON "
                         f"{_json_kind(items)}.")
    if len(items) > MAX_ITEMS:
        raise InputError(f"at most {MAX_ITEMS} pages keep a pasted item; got {len(items)}.")
    out: dict[str, str] = {}
    for key, text in items.items():
        if not isinstance(key, str) or not _ITEM_KEY.fullmatch(key):
            raise InputError(f"a pasted item's page must be a page name such as 'conflicts' "
                             f"(lower-case letters, digits, '-', '_'); got {str(key)[:40]!r}.")
        if not isinstance(text, str):
            raise InputError(f"the item pasted on {key!r} must be text; got a JSON "
                             f"{_json_kind(text)}.")
        if len(text) > MAX_ITEM_CHARS:
            raise InputError(f"the item pasted on {key!r} has {len(text)} characters; at most "
                             f"{MAX_ITEM_CHARS} are kept.")
        if text:
            out[key] = text
    return out


def check_second_prompt(text: Any) -> str:
    """The second prompt as kept: a str of at most `MAX_PROMPT_CHARS` characters ('' for none);
    InputError (one line) for anything else."""
    if not isinstance(text, str):
        raise InputError(f"the second prompt must be text; got a JSON {_json_kind(text)}.")
    if len(text) > MAX_PROMPT_CHARS:
        raise InputError(f"the second prompt has {len(text):,} characters; at most "
                         f"{MAX_PROMPT_CHARS:,} are kept.")
    return text


def _check_prompt_list(prompts: Any) -> list[str]:
    if isinstance(prompts, str):
        prompts = [prompts]
    if not isinstance(prompts, Sequence) or not all(isinstance(p, str) for p in prompts):
        raise InputError("`prompts` must be a list of strings.")
    for p in prompts:
        if len(p) > MAX_PROMPT_CHARS:
            raise InputError(f"a prompt has {len(p):,} characters; at most {MAX_PROMPT_CHARS:,} "
                             "are kept.")
    return list(prompts)


_SETTING_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
_SCALARS = (str, int, float, bool)


def check_settings(settings: Any) -> dict[str, dict[str, Any]]:
    """``settings`` as page slug -> {parameter name: JSON value}: strings, numbers, booleans,
    null, or lists of those (a page's ``link_params``); InputError (one line) for anything else."""
    if not isinstance(settings, dict):
        raise InputError(f"page settings must be an object of page name -> settings; got a "
                         f"JSON {_json_kind(settings)}.")
    if len(settings) > MAX_ITEMS:
        raise InputError(f"at most {MAX_ITEMS} pages keep settings; got {len(settings)}.")
    out: dict[str, dict[str, Any]] = {}
    for page, values in settings.items():
        if not isinstance(page, str) or not _ITEM_KEY.fullmatch(page):
            raise InputError(f"a page name is lower-case letters, digits, '-' and '_' (such as "
                             f"'lens'); got {str(page)[:40]!r}.")
        out[page] = _check_page_settings(page, values)
    return out


def _check_page_settings(page: str, values: Any) -> dict[str, Any]:
    if not isinstance(values, dict):
        raise InputError(f"the settings of {page!r} must be an object of parameter -> value; "
                         f"got a JSON {_json_kind(values)}.")
    out = {}
    for name, value in values.items():
        if not isinstance(name, str) or not _SETTING_NAME.fullmatch(name):
            raise InputError(f"a setting of {page!r} must be named by a parameter name; got "
                             f"{str(name)[:40]!r}.")
        ok = value is None or isinstance(value, _SCALARS) or (
            isinstance(value, list) and len(value) <= 256
            and all(v is None or isinstance(v, _SCALARS) for v in value))
        if not ok or (isinstance(value, str) and len(value) > MAX_ITEM_CHARS):
            raise InputError(f"the setting {page}.{name} must be a string, number, boolean or a "
                             f"list of those; got a JSON {_json_kind(value)}.")
        out[name] = list(value) if isinstance(value, list) else value
    return out


# -- shareable links --------------------------------------------------------------------------

class Link(NamedTuple):
    """What a link opens: the workspace, the page shown (a slug or None) and that page's
    settings ({parameter: value})."""

    workspace: Workspace
    view: str | None
    settings: dict[str, Any]


def workspace_link(ws: Workspace, *, view: str | None = None,
                   settings: dict[str, Any] | None = None) -> tuple[str, int]:
    """The compact, versioned text of a link (``"1.<base64url>"``: zlib-compressed JSON, whose
    checksum refuses a changed character) holding ``ws``'s model, prompts (and the second
    prompt, when there is one), selection and edits,
    the page ``view`` and its ``settings``. Returns (text, edits left out): edits holding long
    vectors (a steering direction) stay in the exported state file, not in a link."""
    edits = [e.to_dict() for e in ws.edits if _n_floats(e) <= _SNIPPET_FLOATS]
    data: dict[str, Any] = {"m": ws.model_name, "p": list(ws.prompts)}
    if ws.second_prompt:
        data["q"] = ws.second_prompt
    if ws.selection:
        data["s"] = ws.selection
    if edits:
        data["e"] = edits
    if view is not None:
        data["v"] = view
    if settings:
        data["o"] = _check_page_settings(view or "page", dict(settings))
    raw = zlib.compress(json.dumps(data, separators=(",", ":")).encode(), 9)
    text = f"{LINK_VERSION}." + base64.urlsafe_b64encode(raw).decode().rstrip("=")
    return text, len(ws.edits) - len(edits)


def read_link(text: Any, *, model: Any = None) -> Link:
    """Read a `workspace_link` text back, checked as a state file is (`Workspace.from_state`:
    against ``model``'s shape when given); InputError naming what is wrong for a link that
    was changed, cut, or written by another version."""
    if not isinstance(text, str) or not text:
        raise InputError("the link holds no state.")
    if len(text) > MAX_LINK_CHARS:
        raise InputError(f"the link's state is {len(text):,} characters; at most "
                         f"{MAX_LINK_CHARS:,} are read.")
    version, dot, body = text.partition(".")
    if not dot or not version.isdigit():
        raise InputError("the link's state does not start with its version ('1.'): it was "
                         "cut or changed.")
    if int(version) != LINK_VERSION:
        raise InputError(f"the link was written by another version of the explorer (link "
                         f"version {version}; this one reads {LINK_VERSION}).")
    try:
        raw = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))
        inflate = zlib.decompressobj()
        plain = inflate.decompress(raw, _LINK_JSON_BYTES)
        if inflate.unconsumed_tail or not inflate.eof:
            raise ValueError("cut or too large")
        data = json.loads(plain.decode("utf-8"))
    except (ValueError, zlib.error, UnicodeDecodeError):
        raise InputError("the link's state cannot be read (a character was changed or the "
                         "link was cut): open the link as it was copied.") from None
    if not isinstance(data, dict) or not isinstance(data.get("m"), str):
        raise InputError("the link's state is not an explorer view (it names no model).")
    unknown = sorted(set(data) - {"m", "p", "q", "s", "e", "v", "o"})
    if unknown:
        raise InputError(f"unknown field(s) in the link: {', '.join(map(repr, unknown))}.")
    view = data.get("v")
    if view is not None and (not isinstance(view, str) or not _ITEM_KEY.fullmatch(view)):
        raise InputError(f"the link's page must be a page name such as 'lens'; got "
                         f"{str(view)[:40]!r}.")
    selection = data.get("s", [])
    if not isinstance(selection, list) or not all(isinstance(n, (str, int)) for n in selection):
        raise InputError("the link's selection must be a list of names such as 'L3.H1'.")
    state = {"format": STATE_FORMAT, "version": STATE_VERSION, "model": data["m"],
             "prompts": data.get("p", []), "edits": data.get("e", [])}
    if "q" in data:  # links written before the second prompt travelled have none
        state["second_prompt"] = data["q"]
    ws = Workspace.from_state(state, model=model)
    try:
        ws.set_selection(selection)
    except InputError as exc:
        raise InputError(f"the link's selection: {exc}") from None
    settings = _check_page_settings(view or "page", data.get("o", {}))
    return Link(ws, view, settings)


def _json_kind(value: Any) -> str:
    return {dict: "object", list: "array", str: "string", int: "number", float: "number", bool: "boolean",
            type(None): "null"}.get(type(value), type(value).__name__)

