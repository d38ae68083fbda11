"""The causal intervention of the saturation analysis: residual injection between positions.

* `intervention_pairs`: pairs of positions in one text with the same prediction and far-apart
  top-1 saturation layers (thresholds scaled from the paper's GPT-2 settings).
* `inject_residual`: write the early-saturating position's residual into the late one after
  one block, re-run the rest, and read the target's new s_1 and prediction.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from explorer._checks import check_int
from explorer.analyses.saturation.stats import saturation_from_ranks

__all__ = ["intervention_pairs", "inject_residual"]

def intervention_pairs(sat_layer: Any, final_top1: Any, mask: Any, n_layers: int, *,
                       min_gap: int | None = None, min_sat_layer: int | None = None,
                       max_distance: int = 30, n_pairs: int = 8, seed: int = 0) -> np.ndarray:
    """Pairs of positions in one text with the same prediction and far-apart s_1.

    Candidates: positions i (early) and j (late) of the same prompt, both with a
    saturated top-1, the same final top-1 token, ``s_1(j) - s_1(i) >= min_gap``, both
    ``s_1 >= min_sat_layer`` and ``|i - j| <= max_distance``. The paper's GPT-2 settings
    were a gap of 10 of 48 layers, both saturation layers at least 10 (so the early token
    has a settled state to give, not one fixed from the embedding on, and the injection
    window below it exists) and a distance of 30; ``min_gap`` and ``min_sat_layer``
    default to that 10 scaled to the model, ``max(1, round(10 * L / 48))``.

    Returns
    -------
    numpy.ndarray of int64, shape [pair, 3]
        (prompt, early position, late position), seeded sample of at most ``n_pairs``,
        at most one pair per late position, the largest gaps first.
    """
    s1 = np.asarray(sat_layer)[..., 0]
    top1 = np.asarray(final_top1)
    min_gap, min_sat_layer = intervention_pair_defaults(n_layers, min_gap, min_sat_layer)
    ok = np.asarray(mask, bool) & (s1 >= 0) & (s1 >= min_sat_layer)
    max_distance = check_int("max_distance", max_distance, low=1)
    n_pairs = check_int("n_pairs", n_pairs, low=0)
    rng = np.random.default_rng(seed)
    found = []
    for p in range(s1.shape[0]):
        pos = np.flatnonzero(ok[p])
        for j in pos:
            near = pos[(np.abs(pos - j) <= max_distance) & (pos != j)]
            cand = near[(top1[p, near] == top1[p, j]) & (s1[p, j] - s1[p, near] >= min_gap)]
            if len(cand):
                i = cand[rng.integers(len(cand))]
                found.append((p, int(i), int(j), int(s1[p, j] - s1[p, i])))
    if not found:
        return np.zeros((0, 3), dtype=np.int64)
    found = np.array(found, dtype=np.int64)
    order = rng.permutation(len(found))
    found = found[order][np.argsort(-found[order, 3], kind="stable")]
    return found[:n_pairs, :3]


def inject_residual(model: Any, text: str, *, source_pos: int, target_pos: int, layer: int,
                    clean: Any = None, baseline: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write ``source_pos``'s residual into ``target_pos`` after block ``layer``; re-run.

    A dict of plain values: one intervention's outcome, which `saturation_analysis` and the
    Saturation page collect over pairs.

    The target's ``resid_post`` at ``layer`` becomes the source's (an `explorer.Steer`
    that adds their difference), the rest of the forward pass runs as usual, and the
    target's lens is read again. Layers before ``layer`` are not re-run when ``clean``
    (an `explorer.trace.clean_run` of ``text``) is given.

    Parameters
    ----------
    model : Model
    text : str
    source_pos, target_pos : int
        Positions in ``text``'s tokens: the early- and the late-saturating token.
    layer : int
        Block whose output is overwritten at ``target_pos`` (0..L-2).
    clean : CleanRun, optional
        Clean residuals of ``text``; computed if not given.
    baseline : dict, optional
        ``{"rank": [...], "top1": id}`` of the unedited target (saves one forward).

    Returns
    -------
    dict
        ``s1_before``, ``s1_after`` (top-1 saturation layer of the target, each against
        its own run's prediction), ``top1_before``, ``top1_after`` (token ids),
        ``prediction_changed``, ``rank_before``, ``rank_after`` (per layer, rank of each
        run's final top-1), ``layer``.

    References
    ----------
    Lioubashevski et al., ICML 2025, causal intervention.
    """
    from explorer.interventions import Steer
    from explorer.lens import logit_lens
    from explorer.trace import clean_run

    n_tok = model.tokenize([text]).lengths[0]
    for name, v in (("source_pos", source_pos), ("target_pos", target_pos)):
        check_int(name, v, low=0, high=n_tok - 1)
    layer = check_int("layer", layer, low=0, high=model.n_layers - 2)
    if model.remote:
        # no clean run to resume from: only the two residuals come back, every lens below
        # is reduced inside its own remote trace
        from explorer.trace import trace

        two = trace(model, [text], sites=("resid_post",), layers=[layer],
                    positions=[source_pos, target_pos], progress=False)
        src, tgt = two.resid_post.values[0, :, 0].astype(np.float32)  # [d_model] each
        clean = None
    else:
        if clean is None:
            clean = clean_run(model, [text])
        # resid_post of block `layer` is resid_pre of block `layer + 1`; one prompt: no padding
        h = clean.resid_pre[layer + 1][0].float().numpy()             # [pos, d_model]
        src, tgt = h[source_pos], h[target_pos]
    edit = Steer(layer=layer, vector=src - tgt, alpha=1.0, positions=(target_pos,))
    if baseline is None:
        before = logit_lens(model, [text], k=1, positions=[target_pos], resume=clean)
        baseline = {"rank": before.final_rank.values[0, 0, :, 0].astype(int).tolist(),
                    "top1": int(before.final_token_id.values[0, 0, 0])}
    after = logit_lens(model, [text], k=1, positions=[target_pos], edits=[edit], resume=clean)
    rb = np.asarray(baseline["rank"])
    ra = after.final_rank.values[0, 0, :, 0]                           # [layer]
    t_after = int(after.final_token_id.values[0, 0, 0])
    return {
        "layer": layer,
        "s1_before": int(saturation_from_ranks(rb[:, None])[0]),
        "s1_after": int(saturation_from_ranks(ra[:, None])[0]),
        "top1_before": int(baseline["top1"]),
        "top1_after": t_after,
        "prediction_changed": int(baseline["top1"]) != t_after,
        "rank_before": rb.astype(int).tolist(),
        "rank_after": ra.astype(int).tolist(),
    }


def intervention_pair_defaults(n_layers: int, min_gap: int | None,
                               min_sat_layer: int | None) -> tuple[int, int]:
    """Pair selection thresholds: the paper's 10 of GPT-2's 48 layers, scaled to the model."""
    scaled = max(1, round(10 * n_layers / 48))
    min_gap = scaled if min_gap is None else min_gap
    min_sat_layer = scaled if min_sat_layer is None else min_sat_layer
    min_gap = check_int("min_gap", min_gap, low=1, high=n_layers)
    min_sat_layer = check_int("min_sat_layer", min_sat_layer, low=0, high=n_layers - 1)
    return min_gap, min_sat_layer
