"""Two prompts side by side: one view of prompt A and of prompt B, aligned, and B - A.

A researcher changes one word ("John" becomes "Mary") and asks what moves inside the model.
`compare_prompts` runs each prompt alone through one of four library readouts and lays the
two results on the same grid:

- ``"lens"``: the logit lens (`explorer.lens.logit_lens`): the top-1 token and its
  probability per layer and position, and the probability at each layer of the token the
  model finally predicts there (its answer at that position);
- ``"attention"``: one head's attention pattern (`explorer.trace` at ``attn_pattern``),
  query x key;
- ``"saturation"``: the layer at which each of the final top-k tokens is fixed
  (`explorer.analyses.saturation.saturation_layers`), rank x position;
- ``"dla"``: each head's and MLP's direct contribution to logit(answer) - logit(alternative)
  at the last position (`explorer.analyses.answer_dla.answer_logit_attribution`), with the
  same answer and alternative for both prompts (default: prompt A's top two tokens).

Positions are aligned from the start of each prompt; the shorter prompt's missing cells are
NaN. The difference B - A is given only where the two grids mean the same cells: for the
per-position views, when the prompts have the same number of tokens (``difference_note``
says why otherwise); for DLA (one grid of components at each prompt's last position),
always. An empty prompt B gives A alone, and the note says so.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import xarray as xr

from explorer import components
from explorer._checks import InputError, check_choice, check_int, check_prompts
from explorer.interventions import Edit
from explorer.models import Model
from explorer.trace import check_edits, provenance

__all__ = ["COMPARE_VIEWS", "VIEW_AXES", "NO_SECOND_PROMPT", "compare_prompts",
           "difference_note"]

COMPARE_VIEWS = ("lens", "attention", "saturation", "dla")
"""The readouts `compare_prompts` sets side by side."""

VIEW_AXES: dict[str, tuple[str, str]] = {
    "lens": ("layer", "pos"),
    "attention": ("dst_pos", "src_pos"),
    "saturation": ("rank", "pos"),
    "dla": ("layer", "column"),
}
"""Each view's grid, (rows, columns): the dims of ``value`` after ``prompt``."""

PROMPTS = ("A", "B")

NO_SECOND_PROMPT = "No second prompt: prompt A is shown alone, with no B − A."
"""The ``difference_note`` of a result computed without prompt B."""


def difference_note(view: str, n_a: int, n_b: int) -> str:
    """Why no difference is given ('' when it is): per-position grids of prompts of
    different lengths do not mean the same cells."""
    if view == "dla" or n_a == n_b:
        return ""
    return (f"No difference drawn: prompt A has {n_a} tokens and prompt B {n_b}, so their "
            f"positions are not the same cells. Make both prompts the same length in tokens "
            f"(e.g. swap one name for another one-token name) to see B − A.")


def compare_prompts(model: Model, prompt_a: str, prompt_b: str, *, view: str = "lens",
                    layer: int = 0, head: int = 0, k: int = 5, answer: Any = None,
                    alternative: Any = None, edits: Sequence[Edit] = ()) -> xr.Dataset:
    """One view of two prompts, each run alone, aligned by position, and their difference.

    Parameters
    ----------
    model : Model
    prompt_a, prompt_b : str
        The two prompts (A: the workspace prompt, B: the second prompt). A blank
        ``prompt_b`` gives prompt A alone (``prompt`` holds "A" only, and
        ``difference_note`` is `NO_SECOND_PROMPT`).
    view : {"lens", "attention", "saturation", "dla"}, default="lens"
    layer, head : int, default=0
        The head whose attention pattern the ``"attention"`` view shows.
    k : int, default=5
        Ranks of the ``"saturation"`` view (the final top-k tokens).
    answer, alternative : int or str, optional
        The ``"dla"`` view's tokens (ids or one-token texts), the same for both prompts;
        default prompt A's top-1 and top-2 next tokens.
    edits : sequence of Edit, default=()
        Interventions applied to both runs.

    Returns
    -------
    xarray.Dataset
        ``value`` (prompt, *VIEW_AXES[view]): the view's number per cell for A and B (lens:
        top-1 probability; attention: weight; saturation: saturation layer, NaN = never
        fixed; dla: contribution in logits); ``difference`` (*VIEW_AXES[view]) = B - A, only
        when the grids match (``attrs["difference_note"]`` says why not otherwise);
        ``mask`` (prompt, pos), ``n_tokens`` (prompt). View extras: lens ``top_token``
        and ``answer_prob`` (prompt, layer, pos), ``top_changed`` (layer, pos); saturation
        ``final_token`` (prompt, rank, pos); dla ``logit_diff`` (prompt) and the
        ``component`` coord (layer, column). Coords ``text`` (prompt) and ``token``
        (prompt, pos; '' past a prompt's end). attrs: provenance, ``view``, ``prompts``,
        ``difference_note`` and the view's settings.

    References
    ----------
    nostalgebraist, "interpreting GPT: the logit lens" (2020); Lioubashevski et al.,
    ICML 2025 (saturation layers); Elhage et al., "A Mathematical Framework for Transformer
    Circuits" (2021), direct logit attribution.
    """
    view = check_choice("view", view, COMPARE_VIEWS)
    if not isinstance(prompt_a, str) or not prompt_a.strip():
        raise InputError(f"`prompt_a` must be a non-empty prompt; got {prompt_a!r}.")
    if not isinstance(prompt_b, str):
        raise InputError(f"`prompt_b` must be a prompt (str; '' for none); got "
                         f"{type(prompt_b).__name__}.")
    texts = [check_prompts(prompt_a)[0]]
    if prompt_b.strip():
        texts.append(check_prompts(prompt_b)[0])
    edits = check_edits(edits)
    spec = model.spec
    settings: dict[str, Any] = {}
    if view == "attention":
        settings = {"layer": check_int("layer", layer, low=0, high=spec.n_layers - 1),
                    "head": check_int("head", head, low=0, high=spec.n_heads - 1)}
    elif view == "saturation":
        settings = {"k": check_int("k", k, low=1, high=min(20, model.vocab_size))}
    tokens = [model.tokenize(t).tokens[0] for t in texts]
    lengths = [len(t) for t in tokens]
    n_pos = max(lengths)
    runner = {"lens": _lens, "attention": _attention, "saturation": _saturation,
              "dla": _dla}[view]
    data, coords, extra = runner(model, texts, lengths, n_pos, edits=edits, answer=answer,
                                 alternative=alternative, **settings)
    note = difference_note(view, *lengths) if len(texts) == 2 else NO_SECOND_PROMPT
    rows, cols = VIEW_AXES[view]
    values = data["value"][1]
    if not note:
        data["difference"] = ((rows, cols), values[1] - values[0])
        if view == "lens":
            top = data["top_token_id"][1]
            data["top_changed"] = ((rows, cols), top[1] != top[0])
    data.pop("top_token_id", None)
    token = np.full((len(texts), n_pos), "", dtype=object)
    mask = np.zeros((len(texts), n_pos), dtype=bool)
    for i, toks in enumerate(tokens):
        token[i, :len(toks)] = toks
        mask[i, :len(toks)] = True
    coords.update({"prompt": list(PROMPTS[:len(texts)]), "text": ("prompt", texts),
                   "pos": np.arange(n_pos), "token": (("prompt", "pos"), token.astype(str))})
    data.update({"mask": (("prompt", "pos"), mask),
                 "n_tokens": (("prompt",), np.array(lengths))})
    attrs = provenance(model, method="compare_prompts", edits=edits, view=view,
                       prompts=texts, **settings, **extra)
    attrs.update(view=view, prompts=texts, difference_note=note, **settings, **extra)
    return xr.Dataset(data, coords=coords, attrs=attrs)


def _padded(arrays: list[np.ndarray], shape: tuple[int, ...], fill: Any = np.nan,
            dtype: Any = float) -> np.ndarray:
    """[prompt, *shape] of the prompts' arrays, each in its top-left corner, ``fill`` around."""
    out = np.full((len(arrays), *shape), fill, dtype=dtype)
    for i, a in enumerate(arrays):
        out[(i, *tuple(slice(0, n) for n in a.shape))] = a
    return out


def _lens(model: Model, texts: list[str], lengths: list[int], n_pos: int, *,
          edits: list[Edit], **_: Any) -> tuple[dict, dict, dict]:
    """Top-1 token and probability per layer and position, and the answer's probability."""
    from explorer.lens import logit_lens

    L = model.spec.n_layers
    prob, answer, ids, strs = [], [], [], []
    for text in texts:
        one = logit_lens(model, [text], k=1, edits=edits).isel(prompt=0, rank=0)
        prob.append(one.top_prob.transpose("layer", "pos").values)        # [layer, pos]
        answer.append(one.final_prob.transpose("layer", "pos").values)
        ids.append(one.top_token_id.transpose("layer", "pos").values)
        strs.append(one.top_token.transpose("layer", "pos").values.astype(object))
    shape = (L, n_pos)
    data = {"value": (("prompt", "layer", "pos"), _padded(prob, shape)),
            "answer_prob": (("prompt", "layer", "pos"), _padded(answer, shape)),
            "top_token_id": (("prompt", "layer", "pos"), _padded(ids, shape, -1, np.int64)),
            "top_token": (("prompt", "layer", "pos"),
                          _padded(strs, shape, "", object).astype(str))}
    return data, {"layer": np.arange(L)}, {}


def _attention(model: Model, texts: list[str], lengths: list[int], n_pos: int, *,
               edits: list[Edit], layer: int, head: int, **_: Any) -> tuple[dict, dict, dict]:
    """Head (layer, head)'s attention pattern, query x key."""
    from explorer.trace import trace

    patterns = []
    for text in texts:
        ds = trace(model, [text], sites=("attn_pattern",), layers=[layer], edits=edits,
                   progress=False)
        patterns.append(ds.attn_pattern.isel(prompt=0).sel(layer=layer, head=head)
                        .transpose("dst_pos", "src_pos").values.astype(float))
    data = {"value": (("prompt", "dst_pos", "src_pos"), _padded(patterns, (n_pos, n_pos)))}
    coords = {"dst_pos": np.arange(n_pos), "src_pos": np.arange(n_pos)}
    return data, coords, {"component": str(components.head(layer, head))}


def _saturation(model: Model, texts: list[str], lengths: list[int], n_pos: int, *,
                edits: list[Edit], k: int, **_: Any) -> tuple[dict, dict, dict]:
    """The saturation layer of each final top-k token, rank x position (NaN: never)."""
    from explorer.analyses.saturation import saturation_layers

    layers, finals = [], []
    for text in texts:
        one = saturation_layers(model, [text], k=k, rank_cap=min(model.vocab_size, max(50, k)),
                                sample_positions=0, edits=edits, progress=False).isel(prompt=0)
        n = int(one.mask.values.sum())
        s = one.sat_layer.values[:n].T.astype(float)                   # [rank, pos]
        layers.append(np.where(s < 0, np.nan, s))
        ids = one.final_token_id.values[:n].T                          # [rank, pos]
        finals.append(np.array(model.token_strings(ids.ravel().tolist()),
                               dtype=object).reshape(ids.shape))
    shape = (k, n_pos)
    data = {"value": (("prompt", "rank", "pos"), _padded(layers, shape)),
            "final_token": (("prompt", "rank", "pos"),
                            _padded(finals, shape, "", object).astype(str))}
    return data, {"rank": np.arange(1, k + 1)}, {}


def _dla(model: Model, texts: list[str], lengths: list[int], n_pos: int, *,
         edits: list[Edit], answer: Any, alternative: Any, **_: Any) -> tuple[dict, dict, dict]:
    """Each head's and MLP's contribution to logit(answer) - logit(alternative) at the last
    position, the same two tokens for both prompts."""
    from explorer.analyses.answer_dla import answer_logit_attribution, answer_token_id, top_tokens

    picked = "given"
    if answer is None or alternative is None:
        top = top_tokens(model, texts[0], 3)
        picked = "prompt A's top-1 and top-2" if answer is None and alternative is None \
            else "partly given; the rest from prompt A's top tokens"
    a_id = answer_token_id(model, answer) if answer is not None else top[0]
    b_id = (answer_token_id(model, alternative, name="alternative") if alternative is not None
            else next(t for t in top if t != a_id))
    run = "edited" if edits else "clean"
    grids, diffs = [], []
    for text in texts:
        one = answer_logit_attribution(model, text, answer=a_id, alternative=b_id,
                                       edits=edits).sel(run=run).isel(pos=-1)
        grids.append(np.concatenate([one.heads.transpose("layer", "head").values,
                                     one.mlp.values[:, None]], axis=1))
        diffs.append(float(one.logit_diff))
    L, H = model.spec.n_layers, model.spec.n_heads
    names = [[str(components.head(la, h)) for h in range(H)] + [str(components.mlp(la))]
             for la in range(L)]
    data = {"value": (("prompt", "layer", "column"), np.stack(grids)),
            "logit_diff": (("prompt",), np.array(diffs))}
    coords = {"layer": np.arange(L), "column": [f"H{h}" for h in range(H)] + ["MLP"],
              "component": (("layer", "column"), np.array(names, dtype=str))}
    a_text, b_text = model.token_strings([a_id, b_id])
    extra = {"answer": a_text, "alternative": b_text, "answer_id": int(a_id),
             "alternative_id": int(b_id), "picked": picked}
    return data, coords, extra
