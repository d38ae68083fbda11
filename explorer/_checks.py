"""Shared validators: every user-facing check raises one clear message.

Message template: "`layer` must be an int in [0, 29]; got 31." Names get a
"Did you mean ...?" suggestion from difflib.
"""
from __future__ import annotations

import difflib
import json
from collections.abc import Callable, Iterable, Sequence
from typing import Any

__all__ = [
    "ExplorerError",
    "ModelNotFoundError",
    "StoreError",
    "RemoteError",
    "InputError",
    "check_choice",
    "check_site",
    "absolute_position",
    "transformer_lens_hint",
    "check_int",
    "check_token_ids",
    "check_float",
    "check_prompts",
    "parse_layer_list",
    "record_from_dict",
    "records_from_json",
    "check_local_weights",
    "safetensors_problem",
    "suggest",
]


class ExplorerError(Exception):
    """An error the user caused or can fix; the CLI prints it as one line."""


class ModelNotFoundError(ExplorerError, ValueError):
    """The model name or path is not known, not local, and not reachable."""


class StoreError(ExplorerError):
    """The activation store cannot be used (unwritable folder, corrupt entry)."""


class RemoteError(ExplorerError):
    """A remote (NDIF) run failed: missing configuration, server error, timeout."""


class InputError(ExplorerError, ValueError):
    """A bad argument value: out of range, unknown choice, empty input."""


def suggest(value: str, allowed: Iterable[str]) -> str:
    """' Did you mean 'x'?' for the closest allowed name, or ''."""
    close = difflib.get_close_matches(str(value), [str(a) for a in allowed], n=1)
    return f" Did you mean {close[0]!r}?" if close else ""


def check_choice(name: str, value: Any, allowed: Iterable[Any]) -> Any:
    """Raise InputError unless ``value`` is one of ``allowed``."""
    allowed = list(allowed)
    if value not in allowed:
        listed = ", ".join(repr(a) for a in allowed)
        raise InputError(
            f"`{name}` must be one of {listed}; got {value!r}.{suggest(value, allowed)}"
        )
    return value


# TransformerLens hook names (the part after ``blocks.{layer}.``) -> (site, note). None: no
# site reads that value; the note says what does.
_TL_LAYER_HOOKS: dict[str, tuple[str | None, str]] = {
    "hook_resid_pre": ("resid_pre", ""),
    "hook_resid_post": ("resid_post", ""),
    "hook_resid_mid": (None, "no site holds the residual between attention and MLP: it is "
                             "`resid_pre` plus the layer's `head_out` summed over heads"),
    "attn.hook_z": ("attn_z", ""),
    "attn.hook_result": ("head_out", ""),
    "hook_attn_out": ("head_out", "`head_out` is per head: its sum over `head` plus the "
                                  "output bias is TransformerLens' hook_attn_out."),
    "attn.hook_pattern": ("attn_pattern", ""),
    "attn.hook_attn_scores": (None, "no site holds the scores before the softmax; "
                                    "`attn_pattern` holds the pattern after it"),
    "attn.hook_q": ("attn_q", "`attn_q` is after rotary, as TransformerLens' hook_rot_q."),
    "attn.hook_k": ("attn_k", "`attn_k` is after rotary, as TransformerLens' hook_rot_k."),
    "attn.hook_rot_q": ("attn_q", ""),
    "attn.hook_rot_k": ("attn_k", ""),
    "attn.hook_v": ("attn_v", ""),
    "hook_mlp_out": ("mlp_out", ""),
    "mlp.hook_post": ("mlp_hidden", ""),
    "mlp.hook_pre": (None, "no site holds the MLP's pre-activation; `mlp_hidden` holds the "
                           "input of the down projection"),
}
_TL_ROOT_HOOKS: dict[str, str] = {
    "hook_embed": "`resid_pre` at layer 0 (the embedding, plus GPT-2's position embedding: "
                  "TransformerLens' hook_embed + hook_pos_embed)",
    "hook_pos_embed": "`resid_pre` at layer 0 (the embedding, plus GPT-2's position "
                      "embedding: TransformerLens' hook_embed + hook_pos_embed)",
    "ln_final.hook_normalized": "`final_norm`",
    "unembed": "`unembed` (the logits)",
}


def transformer_lens_hint(value: Any, allowed: Iterable[Any] | None = None) -> str:
    """' That is a TransformerLens hook name: did you mean ...?' for a TransformerLens hook
    name (``blocks.10.hook_resid_post``, ``hook_embed``), or ''. A site outside ``allowed``
    (when given) is named with a word that this argument does not take it."""
    if not isinstance(value, str):
        return ""
    text = value.strip()
    lead = " That is a TransformerLens hook name"
    if text in _TL_ROOT_HOOKS:
        return f"{lead}: did you mean {_TL_ROOT_HOOKS[text]}?"
    parts = text.split(".", 2)
    if len(parts) == 3 and parts[0] == "blocks" and parts[1].isdigit():
        layer, hook = int(parts[1]), parts[2]
        site, note = _TL_LAYER_HOOKS.get(hook, (None, ""))
        if site is not None:
            hint = f"{lead}: did you mean `{site}` at layer {layer} (site={site!r}, layer={layer})?"
            if allowed is not None and site not in list(allowed):
                hint += f" (`{site}` is not among the sites this argument takes.)"
            return hint + (f" {note}" if note else "")
        if note:
            return f"{lead}: {note}."
        return f"{lead}; explorer's sites are named without `blocks.{layer}.` and `hook_`."
    return ""


def check_site(value: Any, allowed: Iterable[Any], name: str = "site") -> Any:
    """`check_choice` for a site name; a TransformerLens hook name gets the site it means."""
    allowed = list(allowed)
    if value not in allowed:
        hint = transformer_lens_hint(value, allowed)
        if hint:
            listed = ", ".join(repr(a) for a in allowed)
            raise InputError(f"`{name}` must be one of {listed}; got {value!r}.{hint}")
    return check_choice(name, value, allowed)


def check_token_ids(name: str, ids: Any, vocab_size: int) -> None:
    """Raise InputError unless every id of ``ids`` (ints, an array or a tensor) is a token id
    of a vocabulary of ``vocab_size``: "`name` must be token ids in [0, 49151]; got 49152."."""
    flat = ids.reshape(-1).tolist() if hasattr(ids, "reshape") else list(ids)
    bad = next((t for t in flat if not 0 <= int(t) < vocab_size), None)
    if bad is not None:
        raise InputError(f"`{name}` must be token ids in [0, {vocab_size - 1}]; got {int(bad)}.")


def check_int(name: str, value: Any, *, low: int | None = None, high: int | None = None) -> int:
    """Return ``value`` as int; TypeError if not an int, InputError if outside [low, high]."""
    if isinstance(value, bool) or not isinstance(value, int):
        try:
            import numpy as np

            if isinstance(value, np.integer):
                value = int(value)
            else:
                raise TypeError
        except TypeError:
            raise TypeError(f"`{name}` must be an int; got {type(value).__name__} {value!r}.") from None
    if (low is not None and value < low) or (high is not None and value > high):
        lo = "-inf" if low is None else low
        hi = "inf" if high is None else high
        raise InputError(f"`{name}` must be an int in [{lo}, {hi}]; got {value}.")
    return value


def absolute_position(position: int, n: int, where: str = "the prompt") -> int:
    """``position`` of a sequence of ``n`` tokens as an index in [0, n): negative ones count
    from the end (-1 is the last token). InputError naming ``where`` and the allowed range
    otherwise."""
    index = position + n if position < 0 else position
    if not 0 <= index < n:
        raise InputError(f"position {position} is out of range for {where} with {n} tokens "
                         f"(allowed: -{n} to {n - 1}).")
    return index


def check_float(name: str, value: Any, *, low: float | None = None, high: float | None = None) -> float:
    """Return ``value`` as float; TypeError if not a real number, InputError if outside [low, high]."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        try:
            value = float(value)  # numpy scalars
        except (TypeError, ValueError):
            raise TypeError(f"`{name}` must be a number; got {type(value).__name__} {value!r}.") from None
    value = float(value)
    if value != value or (low is not None and value < low) or (high is not None and value > high):
        lo = "-inf" if low is None else low
        hi = "inf" if high is None else high
        raise InputError(f"`{name}` must be a number in [{lo}, {hi}]; got {value}.")
    return value


def check_local_weights(model: Any, method: str) -> None:
    """Refuse a remote (NDIF) model for methods that train or read the weights here."""
    if getattr(model, "remote", False):
        raise InputError(f"{method} trains or reads a copy of the weights on this machine, and "
                         "a remote (NDIF) model has none here; load the model without "
                         "remote=True.")


def parse_layer_list(text: Any, n_layers: int, what: str) -> list[int]:
    """Layers from a comma-separated text (``"0, 8, 18-22"``; ranges inclusive), checked
    against ``n_layers``, sorted and without repeats. A bad entry, or none, raises an
    InputError that names ``what`` (the field or option the text came from)."""
    allowed = f"layer numbers in [0, {n_layers - 1}] separated by commas (ranges like 18-22)"
    out: set[int] = set()
    for part in str(text).split(","):
        part = part.strip()
        if not part:
            continue
        lo, dash, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi) if dash else int(lo)
        except ValueError:
            raise InputError(f"{what} must be {allowed}; got {part!r}.") from None
        if not 0 <= first <= last < n_layers:
            raise InputError(f"{what} must be {allowed}; got {part!r}.")
        out.update(range(first, last + 1))
    if not out:
        raise InputError(f"{what} must be {allowed}; got none.")
    return sorted(out)


def record_from_dict(d: Any, kinds: dict[str, type], what: str,
                     fields: Callable[[type, dict[str, Any]], None] | None = None) -> Any:
    """The record (an edit, a readout) a ``to_dict`` wrote: ``kinds[d["kind"]](**rest)``,
    after ``fields(cls, rest)`` adjusts the fields in place; InputError naming ``what`` for
    a missing or unknown kind and for fields the record does not take."""
    article = "an" if what[:1] in "aeiou" else "a"
    if not isinstance(d, dict) or "kind" not in d:
        raise InputError(f"{article} {what} must be a dict with a 'kind' key; got {d!r:.80}.")
    d = dict(d)
    kind = d.pop("kind")
    cls = kinds.get(kind) if isinstance(kind, str) else None
    if cls is None:
        check_choice("kind", kind, kinds)  # raises with the allowed list
    if fields is not None:
        fields(cls, d)
    try:
        return cls(**d)
    except TypeError as e:
        raise InputError(f"bad fields for a {kind!r} {what}: {e}.") from None


def records_from_json(text: str, what: str, from_dict: Callable[[Any], Any]) -> list[Any]:
    """The records (edits, readouts) of a JSON list written by their ``to_dict``, each read
    by ``from_dict``; InputError naming ``what`` ("edit", "readout") on bad JSON."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise InputError(f"{what}s JSON does not parse: {e.msg} at line {e.lineno}, "
                         f"column {e.colno}.") from None
    if not isinstance(data, list):
        raise InputError(f"{what}s JSON must be a list of {what} objects.")
    return [from_dict(d) for d in data]


def check_prompts(prompts: Any) -> list[str]:
    """Return prompts as a list of non-empty strings; a single string becomes a list of one."""
    if isinstance(prompts, str):
        prompts = [prompts]
    if not isinstance(prompts, Sequence) or isinstance(prompts, (bytes, bytearray)):
        raise TypeError(f"`prompts` must be a string or a list of strings; got {type(prompts).__name__}.")
    prompts = list(prompts)
    if not prompts:
        raise InputError("`prompts` must hold at least one prompt; got an empty list.")
    for i, p in enumerate(prompts):
        if not isinstance(p, str):
            raise TypeError(f"`prompts[{i}]` must be a string; got {type(p).__name__}.")
        if not p.strip():
            raise InputError(f"`prompts[{i}]` is empty; every prompt needs at least one non-space character.")
    return prompts


def safetensors_problem(path: Any) -> str | None:
    """Why ``path`` is not a whole safetensors file (None when it is): its header must parse
    and the file must be exactly as long as the header says (a truncated copy is not)."""
    import json
    from pathlib import Path

    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return f"{path.name} is {size} bytes, too short for a safetensors header"
            n = int.from_bytes(head, "little")
            if n <= 0 or 8 + n > size:
                return f"{path.name} has a header length of {n} bytes in a {size}-byte file"
            header = json.loads(f.read(n))
    except (OSError, ValueError) as e:
        return f"{path.name} cannot be read as safetensors ({e})"
    if not isinstance(header, dict):
        return f"{path.name} has no safetensors header"
    ends = [v["data_offsets"][1] for k, v in header.items()
            if k != "__metadata__" and isinstance(v, dict) and "data_offsets" in v]
    expected = 8 + n + max(ends, default=0)
    if size != expected:
        return f"{path.name} is {size} bytes; its header says {expected}"
    return None
