"""The logit lens page's analysis glue (xarray in, xarray or pandas out; no Panel): the
contrast prompts' steering vector, the prompt's length check, the lens as a table."""
from __future__ import annotations

import functools
from typing import Any

import holoviews as hv
import numpy as np
import pandas as pd
import xarray as xr

import explorer
from apps import theme
from explorer._checks import InputError, check_prompts
from explorer.trace import trace as trace_sites

__all__ = ["MAX_LENS_TOKENS", "contrast_prompts", "contrast_vector", "check_lens_prompt",
           "lens_grid_table", "lens_table", "steering_summary", "answer_probabilities"]

hv.extension("bokeh", logo=False)


MAX_LENS_TOKENS = 256
"""The longest prompt the lens page runs and draws: one column of every layer per token, so
wider prompts scroll sideways in the page up to this many columns; longer ones are refused
with this limit in the message (a prompt of 3,000 words is refused before any forward)."""


_LABEL_CHARS = 8


def contrast_prompts(text: str) -> list[str]:
    """Prompts from a text box, one a line (blank lines skipped, leading spaces kept)."""
    return [line for line in text.splitlines() if line.strip()]


def contrast_vector(model: explorer.Model, prompts_a: list[str], prompts_b: list[str],
                    layer: int) -> np.ndarray:
    """Mean ``resid_post`` at ``layer`` over the tokens of ``prompts_a`` minus that of ``prompts_b``.

    The first token of each prompt is left out where a prompt has more than one: it
    carries the attention-sink norm (tens of times the others'), which would swamp the
    difference. Returns a [d_model] float32 vector.
    """
    check_prompts(prompts_a)
    check_prompts(prompts_b)

    def mean(prompts):
        ds = trace_sites(model, prompts, sites=("resid_post",), layers=[layer], progress=False)
        x = ds.resid_post.sel(layer=layer)                          # [prompt, pos, d_model]
        keep = ds.mask & ((ds.pos > 0) | (ds.mask.sum("pos") == 1))  # [prompt, pos]
        return x.where(keep).mean(("prompt", "pos")).values

    return (mean(prompts_a) - mean(prompts_b)).astype(np.float32)


def check_lens_prompt(model: explorer.Model, prompt: str) -> int:
    """The prompt's token count; InputError naming the page's limit (`MAX_LENS_TOKENS`) when
    it is longer. Only the tokenizer runs (a long prompt is refused at once)."""
    check_prompts(prompt)
    n = len(model.tokenizer(prompt, add_special_tokens=False)["input_ids"])  # as tokenize counts
    if n > MAX_LENS_TOKENS:
        raise InputError(f"The prompt is {n} tokens; the logit lens draws at most "
                         f"{MAX_LENS_TOKENS} (one column per token). Shorten it.")
    return n


def _last_token_probs(model: explorer.Model, prompt: str, edits: list[Any],
                      resume: Any = None) -> tuple[int, np.ndarray]:
    """(position, [vocab] float64 probabilities) of the next token after ``prompt``'s last
    token, with ``edits`` applied."""
    ds = explorer.run_with(model, prompt, edits, positions=[-1], resume=resume)
    logits = ds.logits.values[0, -1].astype(np.float64)                 # [vocab]
    probs = np.exp(logits - logits.max())
    return model.tokenize(prompt).lengths[0] - 1, probs / probs.sum()


def answer_probabilities(model: explorer.Model, prompt: str, edits: list[Any],
                         extra: list[Any], *, resume: Any = None) -> dict[str, Any]:
    """The clean run's answer (its most probable next token after the prompt) and its
    probability without and with the workspace edits ``extra`` (``edits``, the page's
    steering, apply to both runs), with the edited run's own top-1 token.

    Returns a JSON-able dict: ``position``, ``answer_id``, ``answer``, ``clean_prob``,
    ``edited_prob``, ``edited_top_id``, ``edited_top``, ``edited_top_prob``.
    """
    position, clean = _last_token_probs(model, prompt, list(edits),
                                        resume if edits else None)
    _, edited = _last_token_probs(model, prompt, [*edits, *extra], resume)
    answer, top = int(clean.argmax()), int(edited.argmax())
    answer_text, top_text = model.token_strings([answer, top])
    return {"position": position, "answer_id": answer, "answer": answer_text,
            "clean_prob": float(clean[answer]), "edited_prob": float(edited[answer]),
            "edited_top_id": top, "edited_top": top_text, "edited_top_prob": float(edited[top])}


def lens_grid_table(ds: xr.Dataset, *, prompt: int = 0) -> pd.DataFrame:
    """The lens grid as a tidy table: one row per (position, layer, rank) with the input
    token, the rank's token, its id and probability (the page data export's CSV)."""
    one = ds.isel(prompt=prompt)
    real = one.mask.values                                               # [pos]
    pos = one.pos.values[real]
    layers = one.layer.values
    k = one.sizes["rank"]
    inputs = np.array(theme.show_tokens(one.token.values[real]), dtype=object)
    n_pos, n_layers = len(pos), len(layers)
    shape = (n_pos, n_layers, k)
    return pd.DataFrame({
        "pos": np.broadcast_to(pos[:, None, None], shape).reshape(-1),
        "input_token": np.broadcast_to(inputs[:, None, None], shape).reshape(-1),
        "layer": np.broadcast_to(layers[None, :, None], shape).reshape(-1),
        "rank": np.broadcast_to(np.arange(1, k + 1)[None, None, :], shape).reshape(-1),
        "token": np.array(theme.show_tokens(one.top_token.values[real].reshape(-1).tolist()),
                          dtype=object),
        "token_id": one.top_token_id.values[real].reshape(-1).astype(int),
        "probability": one.top_prob.values[real].reshape(-1).astype(float),
    })


def lens_table(ds: xr.Dataset, *, prompt: int = 0) -> pd.DataFrame:
    """One row per (position, layer) of a `explorer.logit_lens` result: the plot's input.

    Columns: ``pos``, ``layer``, ``top_prob`` (top-1 probability), ``label`` (top-1 token,
    visible whitespace, shortened), ``input`` (the input token at ``pos``), and per rank
    ``r``: ``tok{r}``, ``id{r}``, ``p{r}``; ``text_color`` for the label on its cell.
    """
    one = ds.isel(prompt=prompt)
    real = one.mask.values                                               # [pos]
    pos = one.pos.values[real]
    layers = one.layer.values
    n_pos, n_layers, k = len(pos), len(layers), one.sizes["rank"]
    probs = one.top_prob.values[real]                                    # [pos, layer, rank]
    ids = one.top_token_id.values[real]
    toks = one.top_token.values[real]
    inputs = theme.show_tokens(one.token.values[real])
    table: dict[str, Any] = {
        "pos": np.repeat(pos, n_layers),
        "layer": np.tile(layers, n_pos),
        "top_prob": probs[..., 0].reshape(-1).astype(float),
        "input": np.repeat(np.array(inputs, dtype=object), n_layers),
    }
    # each distinct token shown once (a slider's redraw builds this table every move)
    distinct, where = np.unique(toks.reshape(-1).astype(str), return_inverse=True)
    visible = np.array([theme.show_token(t) for t in distinct.tolist()], dtype=object)
    shown = visible[where].reshape(toks.shape)
    short = np.array([s if len(s) <= _LABEL_CHARS else s[:_LABEL_CHARS - 1] + "…"
                      for s in visible.tolist()], dtype=object)
    table["label"] = short[where.reshape(toks.shape)[..., 0].reshape(-1)]
    for r in range(k):
        table[f"tok{r}"] = shown[..., r].reshape(-1)
        table[f"id{r}"] = ids[..., r].reshape(-1)
        table[f"p{r}"] = probs[..., r].reshape(-1).astype(float)
    table["text_color"] = _text_colors(table["top_prob"])
    df = pd.DataFrame(table)
    # object, not pandas' arrow strings: HoloViews reshapes HeatMap value columns
    text = ["input", "label", "text_color"] + [f"tok{r}" for r in range(k)]
    return df.astype({c: object for c in text})


def steering_summary(edits: list[dict]) -> str:
    """'steered at layer 10, α = 4' for a lens result's ``edits`` attr, or 'unedited'."""
    steers = [e for e in edits if e.get("kind") == "steer"]
    if not steers:
        return "unedited"
    return "; ".join(f"steered at layer {e['layer']}, α = {e['alpha']:g}" for e in steers)


@functools.lru_cache(maxsize=1)
def _light_cells() -> np.ndarray:
    """Per colour of the probability map: whether black text reads on it (theme.text_colors)."""
    n = len(theme.PROBABILITY_CMAP)
    return np.array([c == "black" for c in theme.text_colors(
        np.minimum((np.arange(n) + 0.5) / (n - 1), 1.0), theme.PROBABILITY_CMAP)])


def _text_colors(values: np.ndarray) -> np.ndarray:
    """`theme.text_colors` of probabilities in [0, 1] on the probability map, vectorised."""
    v = np.asarray(values, dtype=float)
    n = len(theme.PROBABILITY_CMAP)
    i = np.clip(np.nan_to_num(v, nan=0.0) * (n - 1), 0, n - 1).astype(int)
    return np.where(np.isnan(v) | _light_cells()[i], "black", "white").astype(object)
