"""A page's "Copy as code" as records, and the one function that writes them as Python.

A page describes what it computed as a `Recipe`: the model, an optional transform of it (a
random-init twin), the workspace's edits (`explorer.interventions` records), named inputs (the
prompt, texts, settings) and ordered steps: `Call` (a library function by its dotted path, or a
method of an earlier result, on Python values and `Ref` s to earlier names), `Expr` (a name
bound to an expression over earlier names: a selection, a slice), `Let` (a name bound to a
value) and `Note` (a comment line). `render` writes the Python: the imports the steps use
(grouped, with the aliases the recipe names), ``model = explorer.load_model(...)``, the edits
(`explorer.edits_to_json`, read back with `explorer.edits_from_json`), the inputs, then the
steps.

Every value is written with `repr` (non-finite floats as ``float('nan')``, ``float('inf')``), so
text a user typed is only ever a string literal. The code a page writes itself (a `Call`'s
function, an `Expr`, a `Ref`) is parsed, never run: a name it reads that the snippet has not
defined or imported by then is a `ValueError` at render time. `recipe_to_json` and
`recipe_from_json` write the records as JSON and read them back.
"""
from __future__ import annotations

import ast
import builtins
import importlib.util
import json
import keyword
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Union

import numpy as np

from explorer.interventions import Edit, edits_from_json, edits_to_json

__all__ = ["Recipe", "Call", "Expr", "Let", "Note", "Ref", "Step", "MODEL", "EDITS", "render",
           "recipe_to_json", "recipe_from_json"]

_FIRST_PARTY = ("explorer", "apps")


@dataclass(frozen=True)
class Ref:
    """A reference to what the snippet defined before, written as is: a name (``"task"``) or
    an expression over such names (``"scores['fv_score'].values"``, ``"len(task)"``)."""

    expr: str


@dataclass(frozen=True)
class Call:
    """``name = func(*args, **kwargs)  # comment``.

    Parameters
    ----------
    name : str or None
        The assignment target (``"scores"``, ``"forget, retain"``); None writes the bare call
        (as a statement, or inline where the call is another call's argument).
    func : str
        The function's dotted path (``"explorer.analyses.saturation.saturation_analysis"``,
        ``"sorted"``), or a method or attribute of an earlier result (``"patterns.sel"``).
    args, kwargs
        The arguments: Python values (written with `repr`), `Ref` s, inline `Call` s.
    comment : str
        A trailing comment.
    """

    name: str | None
    func: str
    args: Sequence[Any] = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    comment: str = ""


@dataclass(frozen=True)
class Expr:
    """``name = expr  # comment``: an expression over earlier names and imported aliases
    (``"int(result.mask.isel(prompt=0).sum())"``); code the page writes, not a value."""

    name: str
    expr: str
    comment: str = ""


@dataclass(frozen=True)
class Let:
    """``name = value  # comment``: a value (written with `repr`; `Ref` s and inline `Call` s
    inside lists, tuples and dicts are written as code)."""

    name: str
    value: Any
    comment: str = ""


@dataclass(frozen=True)
class Note:
    """A comment line (each line of ``text`` prefixed by ``#``); ``""`` is a blank line."""

    text: str = ""


Step = Union[Call, Expr, Let, Note]

MODEL = Ref("model")
"""The recipe's model."""

EDITS = Ref("edits")
"""The recipe's workspace edits (defined when the recipe has any)."""


@dataclass(frozen=True)
class Recipe:
    """What a page computed, as records `render` writes as Python.

    Parameters
    ----------
    model : str or None
        The model's name (``model = explorer.load_model(name)``); None for pages that load none.
    transform : Call or None
        A call that replaces the model (its name ``"model"``), e.g. a random-init twin.
    edits : sequence of Edit
        The workspace's edits, bound to ``edits`` when there are any.
    inputs : mapping
        Named values (the prompt, texts, settings), written ``name = repr(value)``.
    steps : sequence of Step
        The calls, expressions, values and comments, in order.
    aliases : mapping
        Dotted path -> the name the snippet binds it to: ``{"numpy": "np",
        "explorer.analyses.saturation": "sat"}``; calls under an aliased path are written
        through the alias, and the alias's import is written when the code uses it.
    imports : sequence of str
        Dotted paths imported even where no step calls them (``from parent import leaf``, or
        ``import path`` for a top-level package; through `aliases` when one is named).
    """

    model: str | None = None
    transform: Call | None = None
    edits: Sequence[Edit] = ()
    inputs: Mapping[str, Any] = field(default_factory=dict)
    steps: Sequence[Step] = ()
    aliases: Mapping[str, str] = field(default_factory=dict)
    imports: Sequence[str] = ()


def render(recipe: Recipe) -> str:
    """The Python that ``recipe`` describes: imports, the model, its edits, the inputs, the
    steps (one statement a line), ending in a newline.

    Raises
    ------
    ValueError
        A step reads a name not defined (or imported) before it, a target or expression does
        not parse, two imports bind one name, or a keyword argument's name is no identifier.
    TypeError
        A value has no Python literal (only None, bools, numbers, strings, and lists, tuples
        and dicts of them, `Ref` s and inline `Call` s are written).
    """
    return _Writer(recipe).write()


class _Writer:
    """The state of one `render`: the names defined so far and the imports the code uses."""

    def __init__(self, recipe: Recipe) -> None:
        self.recipe = recipe
        self.defined: set[str] = set()
        self.aliases: dict[str, str] = {}          # dotted path -> the name it is bound to
        self.used: set[str] = set()                # the paths whose import is written
        for path, alias in recipe.aliases.items():
            self._bind(path, alias)
        for path in recipe.imports:
            self._bind(path, recipe.aliases.get(path, path.rpartition(".")[2]))
            self.used.add(path)

    # -- imports ---------------------------------------------------------------------------
    def _bind(self, path: str, alias: str) -> None:
        if not alias.isidentifier() or not all(p.isidentifier() for p in path.split(".")):
            raise ValueError(f"cannot import {path!r} as {alias!r}.")
        other = next((p for p, a in self.aliases.items() if a == alias and p != path), None)
        if other is not None:
            raise ValueError(f"{path!r} and {other!r} would both be imported as {alias!r}.")
        if alias in self.defined:
            raise ValueError(f"importing {path!r} would hide the snippet's {alias!r}.")
        self.aliases[path] = alias

    def _spell(self, path: str) -> str:
        """How the code names the object at dotted ``path``; its import is written."""
        parts = path.split(".")
        for n in range(len(parts), 0, -1):
            head = ".".join(parts[:n])
            if head in self.aliases and (n > 1 or len(parts) < 3 or head in self.recipe.aliases):
                self.used.add(head)
                return ".".join([self.aliases[head], *parts[n:]])
        if hasattr(builtins, parts[0]):                 # sorted, str.join
            return path
        if len(parts) == 1:
            raise ValueError(f"{path!r} is neither a builtin nor a dotted path to import.")
        if importlib.util.find_spec(parts[0]) is None:
            raise ValueError(f"the function {path!r} reads {parts[0]!r} before the snippet "
                             "defines it.")
        if len(parts) == 2:                        # a top-level package's function: pkg.f
            self._bind(parts[0], parts[0])
            self.used.add(parts[0])
            return path
        self._bind(path, parts[-1])
        self.used.add(path)
        return parts[-1]

    def _import_lines(self) -> list[str]:
        sections: dict[bool, list[tuple[int, str, str]]] = {False: [], True: []}
        plain: dict[str, list[str]] = {}
        for path in sorted(self.used):
            alias = self.aliases[path]
            parent, _, leaf = path.rpartition(".")
            first = path.split(".")[0] in _FIRST_PARTY
            if not parent:
                line = f"import {path}" + (f" as {alias}" if alias != path else "")
                sections[first].append((0, path, line))
            elif alias == leaf:
                plain.setdefault(parent, []).append(leaf)
            else:
                sections[first].append((1, parent, f"from {parent} import {leaf} as {alias}"))
        for parent, leaves in plain.items():
            first = parent.split(".")[0] in _FIRST_PARTY
            sections[first].append(
                (1, parent, f"from {parent} import {', '.join(sorted(set(leaves)))}"))
        blocks = [[line for *_, line in sorted(sections[k])] for k in (False, True)]
        return [*blocks[0], *([""] if all(blocks) else []), *blocks[1]]

    # -- names -----------------------------------------------------------------------------
    def _check(self, code: str, what: str) -> str:
        """``code`` (an expression) after checking every name it reads is defined, imported,
        a builtin or bound inside it (a comprehension's variables)."""
        try:
            tree = ast.parse(code, mode="eval")
        except SyntaxError as e:
            raise ValueError(f"{what} {code!r} is not a Python expression: {e.msg}.") from None
        bound = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)
                 and isinstance(n.ctx, ast.Store)}
        bound |= {a.arg for n in ast.walk(tree) if isinstance(n, ast.Lambda)
                  for a in ast.walk(n.args) if isinstance(a, ast.arg)}
        for node in ast.walk(tree):
            if not isinstance(node, ast.Name) or node.id in bound | self.defined:
                continue
            path = next((p for p, a in self.aliases.items() if a == node.id), None)
            if path is not None:
                self.used.add(path)
            elif node.id == "explorer":
                self._bind("explorer", "explorer")
                self.used.add("explorer")
            elif not hasattr(builtins, node.id):
                raise ValueError(f"{what} {code!r} reads {node.id!r} before the snippet "
                                 "defines it.")
        return code

    def _target(self, name: str) -> str:
        """Check the assignment target ``name`` and define the names it binds."""
        try:
            tree = ast.parse(f"{name} = None")
        except SyntaxError:
            tree = None
        if (tree is None or len(tree.body) != 1 or not isinstance(tree.body[0], ast.Assign)
                or len(tree.body[0].targets) != 1):
            raise ValueError(f"{name!r} is not an assignment target.")
        target = tree.body[0].targets[0]
        stored = {n.id for n in ast.walk(target) if isinstance(n, ast.Name)
                  and isinstance(n.ctx, ast.Store)}
        for n in ast.walk(target):
            if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) \
                    and n.id not in self.defined:
                raise ValueError(f"the target {name!r} reads {n.id!r} before the snippet "
                                 "defines it.")
        clash = stored & set(self.aliases.values())
        if clash:
            raise ValueError(f"the target {name!r} would hide the import {sorted(clash)[0]!r}.")
        self.defined |= stored
        return name

    # -- values and statements -------------------------------------------------------------
    def value(self, v: Any) -> str:
        """``v`` as Python source."""
        if isinstance(v, Ref):
            return self._check(v.expr, "the reference")
        if isinstance(v, Call):
            if v.name is not None:
                raise ValueError(f"a call inside a value has no name of its own ({v.name!r}).")
            return self._call(v)
        if isinstance(v, np.generic):
            v = v.item()
        if v is None or isinstance(v, (bool, int, str)):
            return repr(v)
        if isinstance(v, float):
            if math.isfinite(v):
                return repr(v)
            return "float('nan')" if math.isnan(v) else ("-" if v < 0 else "") + "float('inf')"
        if isinstance(v, list):
            return "[" + ", ".join(self.value(x) for x in v) + "]"
        if isinstance(v, tuple):
            items = [self.value(x) for x in v]
            return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"
        if isinstance(v, dict):
            return "{" + ", ".join(f"{self.value(k)}: {self.value(x)}"
                                   for k, x in v.items()) + "}"
        raise TypeError(f"a {type(v).__name__} has no Python literal for the snippet: {v!r:.80}")

    def _call(self, call: Call) -> str:
        func = self._func(call.func)
        args = [self.value(a) for a in call.args]
        for key, v in call.kwargs.items():
            if not (isinstance(key, str) and key.isidentifier()) or key in _KEYWORDS:
                raise ValueError(f"{key!r} is not a keyword argument's name.")
            args.append(f"{key}={self.value(v)}")
        return f"{func}({', '.join(args)})"

    def _func(self, func: str) -> str:
        root = _parse_dotted(func)
        packages = {path.split(".")[0] for path in self.aliases}
        if root is None or root in self.defined or (root in self.aliases.values()
                                                    and root not in packages):
            return self._check(func, "the function")   # an earlier result's method
        return self._spell(func)                        # a path to import (or a builtin)

    def statement(self, step: Step) -> str:
        """One step as one line (its target defined after its value is written)."""
        if isinstance(step, Note):
            return "\n".join(f"# {line}" if line else "" for line in
                             (step.text.splitlines() or [""]))
        if isinstance(step, Call):
            text = self._call(step)
        elif isinstance(step, Expr):
            text = self._check(step.expr, "the expression")
        elif isinstance(step, Let):
            text = self.value(step.value)
        else:
            raise TypeError(f"a step is a Call, Expr, Let or Note, not {type(step).__name__}.")
        if step.name is not None:
            text = f"{self._target(step.name)} = {text}"
        if step.comment:
            text += "  # " + " ".join(str(step.comment).splitlines())
        return text

    def write(self) -> str:
        r = self.recipe
        body = []
        if r.model is not None:
            body.append(f"{self._target('model')} = {self._spell('explorer.load_model')}"
                        f"({r.model!r})")
        if r.transform is not None:
            if r.transform.name != "model":
                raise ValueError("the model's transform is a call named 'model'.")
            body.append(self.statement(r.transform))
        if r.edits:
            read = self._spell("explorer.edits_from_json")
            body.append(f"{self._target('edits')} = {read}({edits_to_json(r.edits)!r})")
        for name, v in r.inputs.items():
            text = self.value(v)
            body.append(f"{self._target(name)} = {text}")
        body += [self.statement(step) for step in r.steps]
        imports = self._import_lines()
        return "\n".join([*imports, *([""] if imports and body else []), *body]) + "\n"


_KEYWORDS = frozenset(keyword.kwlist)


def _parse_dotted(text: str) -> str | None:
    """The first name of ``text`` when it is a dotted name (``a.b.c``), else None."""
    parts = text.split(".")
    return parts[0] if all(p.isidentifier() and p not in _KEYWORDS for p in parts) else None


# -- the records as JSON ---------------------------------------------------------------------

_STEPS: dict[str, type] = {"call": Call, "expr": Expr, "let": Let, "note": Note}


def recipe_to_json(recipe: Recipe) -> str:
    """``recipe`` as JSON (`recipe_from_json` reads it back): the edits as
    `explorer.edits_to_json` writes them; a `Ref`, a step, a tuple, a dict and a non-finite
    float as an object with one tag key (``ref``, ``step``, ``tuple``, ``dict``, ``float``)."""
    return json.dumps({
        "model": recipe.model, "transform": _encode(recipe.transform),
        "edits": json.loads(edits_to_json(recipe.edits)), "inputs": _encode(dict(recipe.inputs)),
        "steps": [_encode(s) for s in recipe.steps], "aliases": dict(recipe.aliases),
        "imports": list(recipe.imports)})


def recipe_from_json(text: str) -> Recipe:
    """The `Recipe` that `recipe_to_json` wrote as ``text``."""
    d = json.loads(text)
    return Recipe(model=d["model"], transform=_decode(d["transform"]),
                  edits=edits_from_json(json.dumps(d["edits"])), inputs=_decode(d["inputs"]),
                  steps=[_decode(s) for s in d["steps"]], aliases=d["aliases"],
                  imports=d["imports"])


def _encode(v: Any) -> Any:
    if isinstance(v, Ref):
        return {"ref": v.expr}
    if isinstance(v, (Call, Expr, Let, Note)):
        kind = next(k for k, t in _STEPS.items() if isinstance(v, t))
        return {"step": kind, **{f.name: _encode(getattr(v, f.name)) for f in fields(v)}}
    if isinstance(v, np.generic):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return {"float": repr(v)}
    if isinstance(v, tuple):
        return {"tuple": [_encode(x) for x in v]}
    if isinstance(v, list):
        return [_encode(x) for x in v]
    if isinstance(v, Mapping):
        return {"dict": [[_encode(k), _encode(x)] for k, x in v.items()]}
    return v


def _decode(v: Any) -> Any:
    if isinstance(v, list):
        return [_decode(x) for x in v]
    if not isinstance(v, dict):
        return v
    if "step" in v:
        return _STEPS[v["step"]](**{k: _decode(x) for k, x in v.items() if k != "step"})
    (tag, body), = v.items()
    if tag == "ref":
        return Ref(body)
    if tag == "float":
        return float(body)
    if tag == "tuple":
        return tuple(_decode(x) for x in body)
    if tag == "dict":
        return {_decode(k): _decode(x) for k, x in body}
    raise ValueError(f"not a recipe's JSON value: {v!r:.80}")
