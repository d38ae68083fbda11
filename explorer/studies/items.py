"""Study items computed once from the model: prompt, choices, correct answer, explanations.

Everything a participant can be shown is computed here, once per study run, and stored
with it (``items.json``), so the app never runs the model and every participant in a
condition sees exactly the same explanation of an item.

- ``predict_next_token`` / ``logit_lens``: the choices are the model's top next tokens
  (the correct one is its top-1); the explanation is the logit lens at the last position
  (nostalgebraist, 2020): the top ``k`` tokens after each shown layer. By default the last
  layer is not shown, since its lens *is* the model's output and would give the answer away.
- ``pick_head`` / ``head_attribution``: the choices are ``n_choices`` heads drawn at
  random; the correct one is the head whose zero-ablation lowers the log-probability of
  the model's top token the most. The explanation is each head's direct effect on that
  token's logit (the logit minus the logit with the head's write removed from the final
  residual stream): a cheap, imperfect proxy for the causal effect the task asks about.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from explorer._checks import InputError

from .placebo import placebo_explanations
from .randomise import attention_item_id, task_item_id
from .schema import Study

__all__ = ["build_items", "attention_check_items", "ATTENTION_WORDS"]

# Stream tags of the study seed used here (randomise.py uses 1-3).
_CHOICE_ORDER, _PLACEBO, _CANDIDATES, _CHECK_WORDS = 4, 5, 6, 7

ATTENTION_WORDS = ("red", "blue", "green", "yellow", "orange", "purple", "black", "white",
                   "brown", "grey")


def _rng(seed: int, *stream: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([int(seed), *stream]))


def build_items(study: Study, model: Any, *,
                progress: Callable[[int, int], None] | None = None) -> list[dict[str, Any]]:
    """Compute every item of ``study`` on ``model`` (task items, then attention checks).

    Parameters
    ----------
    study : Study
    model : explorer.Model
    progress : callable(done, total), optional
        Called after each prompt.

    Returns
    -------
    list of dict
        Per item: ``id``, ``prompt``, ``prompt_tokens``, ``question``, ``choices`` (strings
        shown), ``answer`` (index of the correct choice), ``explanations`` (condition name ->
        explanation dict, or None for a baseline) and ``details`` (what the answer rests on;
        never shown).
    """
    if study.task.kind == "predict_next_token":
        items, real = _next_token_items(study, model, progress)
    else:
        items, real = _pick_head_items(study, model, progress)
    for c in study.conditions:
        if c.kind == "real":
            shown = real
        elif c.kind == "baseline":
            shown = [None] * len(items)
        else:
            stream = study.condition_names.index(c.name)
            shown = placebo_explanations(c.placebo, real, rng=_rng(study.seed, _PLACEBO, stream))
        for item, e in zip(items, shown):
            item["explanations"][c.name] = e
    return items + attention_check_items(study)


def attention_check_items(study: Study) -> list[dict[str, Any]]:
    """The study's attention-check items: 'choose the word X' among ``n_choices`` words."""
    out = []
    n = study.task.n_choices
    for j in range(study.task.attention_checks):
        rng = _rng(study.seed, _CHECK_WORDS, j)
        words = [ATTENTION_WORDS[i] for i in rng.choice(len(ATTENTION_WORDS), size=n, replace=False)]
        answer = int(rng.integers(n))
        out.append({
            "id": attention_item_id(j), "attention_check": True, "prompt": "", "prompt_tokens": [],
            "context": "",
            "question": f"Attention check: to show that you are reading carefully, choose "
                        f"the option '{words[answer]}'.",
            "choices": words, "answer": answer, "explanations": {}, "details": {},
        })
    return out


def _shuffled_choices(study: Study, j: int, choices: list[str], correct: int) -> tuple[list[str], int]:
    order = _rng(study.seed, _CHOICE_ORDER, j).permutation(len(choices))
    return [choices[i] for i in order], int(np.flatnonzero(order == correct)[0])


def _task_item(study: Study, j: int, prompt: str, tokens: list[str], choices: list[str],
               correct: int, details: dict[str, Any], context: str = "") -> dict[str, Any]:
    shown, answer = _shuffled_choices(study, j, choices, correct)
    return {"id": task_item_id(j), "attention_check": False, "prompt": prompt,
            "prompt_tokens": tokens, "context": context, "question": study.task.question,
            "choices": shown, "answer": answer, "explanations": {}, "details": details}


def _lens_layers(study: Study, model: Any) -> list[int]:
    n_layers = model.n_layers
    if study.explanation.layers is None:
        return list(range(max(1, n_layers - 1)))
    bad = [layer for layer in study.explanation.layers if layer >= n_layers]
    if bad:
        raise InputError(f"`explanation.layers` must be layers of {model.spec.name} "
                         f"(0 to {n_layers - 1}); got {bad[0]}.")
    return list(study.explanation.layers)


def _next_token_items(study: Study, model: Any, progress: Any) -> tuple[list[dict], list[dict]]:
    from explorer.lens import logit_lens

    n_choices, k_shown = study.task.n_choices, study.explanation.k
    layers = _lens_layers(study, model)
    # extra ranks so that n_choices distinct strings exist even if two ids decode alike
    k = min(model.vocab_size, max(k_shown, n_choices + 8))
    # one batched run for every prompt; ranks of the output tokens are not needed (rank_cap)
    ds = logit_lens(model, list(study.prompts), k=k, positions=[-1], layers=layers, rank_cap=k)
    token_ids = model.tokenize(list(study.prompts)).token_ids
    items, real = [], []
    for j, prompt in enumerate(study.prompts):
        sel = ds.isel(prompt=j, pos=0)
        final_tokens = [str(t) for t in sel["final_token"].values]
        final_ids = [int(i) for i in sel["final_token_id"].values]
        choices, ids = [], []
        for tok, tid in zip(final_tokens, final_ids):
            if tok not in choices:
                choices.append(tok)
                ids.append(tid)
            if len(choices) == n_choices:
                break
        if len(choices) < n_choices:
            raise InputError(f"prompt {j} ({prompt!r}): the model's top {k} tokens give only "
                             f"{len(choices)} distinct strings; lower `task.n_choices`.")
        tokens = model.token_strings(token_ids[j])
        explanation = {
            "kind": "logit_lens", "layers": [int(x) for x in sel["layer"].values],
            "tokens": [[str(t) for t in row[:k_shown]] for row in sel["top_token"].values],
            "probs": [[round(float(p), 4) for p in row[:k_shown]] for row in sel["top_prob"].values],
        }
        details = {"answer_token": choices[0], "answer_token_id": ids[0],
                   "choice_token_ids": ids, "n_layers": model.n_layers,
                   "shows_final_layer": layers[-1] == model.n_layers - 1}
        items.append(_task_item(study, j, prompt, tokens, choices, 0, details))
        real.append(explanation)
        if progress is not None:
            progress(j + 1, len(study.prompts))
    return items, real


def _pick_head_items(study: Study, model: Any, progress: Any) -> tuple[list[dict], list[dict]]:
    import torch

    from explorer.interventions import Ablate
    from explorer.trace import clean_run, run_with, trace

    spec = model.spec
    n_layers, n_heads = spec.n_layers, spec.n_heads
    n_choices = study.task.n_choices
    if n_choices > n_layers * n_heads:
        raise InputError(f"`task.n_choices` must be at most the number of heads of "
                         f"{spec.name} ({n_layers * n_heads}); got {n_choices}.")
    items, real = [], []
    for j, prompt in enumerate(study.prompts):
        ds = trace(model, [prompt], sites=("head_out", "resid_post"), positions=[-1],
                   progress=False)
        resid = torch.as_tensor(ds["resid_post"].values[0, 0, -1], dtype=torch.float32)  # [d_model]
        heads = torch.as_tensor(ds["head_out"].values[0, 0], dtype=torch.float32)  # [layer, head, d_model]
        dtype = next(model.hf.parameters()).dtype
        with torch.no_grad():
            clean_logits = model.lens_logits(resid.to(dtype)).float()                     # [vocab]
            answer_id = int(clean_logits.argmax())
            # direct effect: answer logit minus the logit with each head's write removed
            removed = model.lens_logits((resid - heads).to(dtype)).float()[..., answer_id]  # [layer, head]
            direct = (clean_logits[answer_id] - removed).numpy()
        rng = _rng(study.seed, _CANDIDATES, j)
        cells = rng.choice(n_layers * n_heads, size=n_choices, replace=False)
        candidates = [(int(c) // n_heads, int(c) % n_heads) for c in cells]
        resume = clean_run(model, [prompt])
        clean_logp = torch.log_softmax(resume.logits[0, -1].float(), -1)[answer_id].item()
        effects = []
        for layer, head in candidates:
            out = run_with(model, [prompt], [Ablate(layer=layer, head=head)], positions=[-1],
                           resume=resume)
            logp = torch.log_softmax(torch.as_tensor(out["logits"].values[0, -1]), -1)[answer_id]
            effects.append(clean_logp - float(logp))
        correct = int(np.argmax(effects))
        choices = [f"L{layer} H{head}" for layer, head in candidates]
        tokens = model.token_strings(model.tokenize([prompt]).token_ids[0])
        details = {"answer_token": model.tokenizer.decode([answer_id]), "answer_token_id": answer_id,
                   "candidates": [list(c) for c in candidates],
                   "ablation_effects": [round(e, 6) for e in effects]}
        items.append(_task_item(study, j, prompt, tokens, choices, correct, details,
                                context=f"The model's next token here is {details['answer_token']!r}."))
        real.append({"kind": "head_attribution", "n_layers": n_layers, "n_heads": n_heads,
                     "scores": np.round(direct, 4).tolist(), "top": study.explanation.top,
                     "token": details["answer_token"], "unit": "logit"})
        if progress is not None:
            progress(j + 1, len(study.prompts))
    return items, real
