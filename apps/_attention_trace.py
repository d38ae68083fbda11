"""The one trace of a prompt's attention patterns that the Attention and Head atlas pages draw:
every layer's and head's pattern (`explorer.trace` at ``attn_pattern``) with the workspace's
edits applied, refused past the page's longest prompt; `check_prompt_tokens`, that refusal,
is also the Logit attribution and Activation patching pages'."""
from __future__ import annotations

from typing import Any

import xarray as xr

import explorer
from explorer._checks import InputError, check_prompts
from explorer.interventions import Edit
from explorer.trace import trace as trace_sites
from explorer.workspace import edit_label

__all__ = ["check_prompt_tokens", "trace_patterns"]


def check_prompt_tokens(model: explorer.Model, prompt: str, *, max_tokens: int, why: str = "",
                        limit: str = "this page draws") -> int:
    """``prompt``'s length in tokens (as tokenize counts them); InputError past
    ``max_tokens``, its message "The prompt is N tokens; {limit} at most {max_tokens}
    ({why}). Shorten it."."""
    n = len(model.tokenizer(prompt, add_special_tokens=False)["input_ids"])
    if n > max_tokens:
        raise InputError(f"The prompt is {n} tokens; {limit} at most {max_tokens}"
                         + (f" ({why})" if why else "") + ". Shorten it.")
    return n


def trace_patterns(model: explorer.Model, prompt: str, edits: list[Edit] = (), *,
                   max_tokens: int, why: str = "", check: Any = None,
                   limit: str = "this page draws") -> xr.Dataset:
    """`explorer.trace` of ``prompt`` at ``attn_pattern`` with ``edits`` applied (their
    one-line labels in the attrs' ``workspace_edits``); InputError past ``max_tokens``, its
    message "The prompt is N tokens; {limit} at most {max_tokens} ({why}). Shorten it.".
    ``check`` (e.g. a job's ``token.check``) is called before the trace."""
    check_prompts(prompt)
    check_prompt_tokens(model, prompt, max_tokens=max_tokens, why=why, limit=limit)
    if check is not None:
        check()
    ds = trace_sites(model, [prompt], sites=("attn_pattern",), edits=list(edits), progress=False)
    ds.attrs["workspace_edits"] = [edit_label(e) for e in edits]
    return ds
