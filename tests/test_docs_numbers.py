"""The numbers the docs quote from the committed evidence JSON equal that JSON.

Convention: each entry of ``TIES`` names a doc, an exact snippet of it (a table row or a
phrase, unique enough to find), the JSON file under ``docs/figures/`` and one key path per
number in the snippet, in reading order (``None`` skips a number that is not a measurement,
e.g. the "40" of "L = 40"). A path is ``/``-separated; list indices are integers. ``scale``
multiplies the JSON value before the comparison (100 for a fraction quoted as a percent). A doc
number with n decimals matches when the JSON value rounds to it (within half a unit of the last
digit), so "0.479" ties to 0.479017.

A docs number that moves away from its JSON (or a JSON rerun that moves away from its doc)
fails here. The cards of ``explorer.paper_settings.PAPER_RESULTS`` are checked the same way in
tests/test_paper_settings.py.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FIGURES = ROOT / "docs" / "figures"

#: A number as the docs write it: optional sign (ASCII or Unicode minus), thousands commas,
#: optional decimals.
NUMBER = re.compile(r"[−-]?\d[\d,]*(?:\.\d+)?")


@dataclass(frozen=True)
class Tie:
    doc: str
    snippet: str
    json: str
    paths: tuple[str | None, ...]
    scale: float = 1.0


_ABL = "ablation_cross_fit/by_mean_source/cross-task"
_ABL_METRICS = ("mean_accuracy/{r}", "mean_accuracy_low/{r}", "mean_accuracy_high/{r}",
                "mean_answer_prob/{r}")


def _ablation_row(ranking: str) -> tuple[str, ...]:
    """Key paths of an ablation-table row: per percent, accuracy [low, high] / P(answer)."""
    out: list[str] = []
    for i in range(6):
        out += [f"{_ABL}/{m.format(r=ranking)}/{i}" for m in _ABL_METRICS]
    return tuple(out)


def _study_row(condition: str, *, pointer: bool) -> tuple[str, ...]:
    """Key paths of a row of the worked study's condition table: per study (lens, then
    attribution), the share of items the explanation points at the answer (when shown) and
    the readers' accuracy [low, high]."""
    out: list[str] = []
    for study in ("lens", "dla"):
        if pointer:
            out.append(f"studies/{study}/pointer_accuracy/{condition}")
        out += [f"studies/{study}/conditions/{condition}/{k}"
                for k in ("accuracy", "accuracy_low", "accuracy_high")]
    return tuple(out)


def _hypothesis_row(study: str, hypothesis: str) -> tuple[str | None, ...]:
    """Key paths of a row of the worked study's hypothesis table (the id's digit skipped)."""
    base = f"studies/{study}/hypotheses/{hypothesis}"
    return (None, *(f"{base}/{k}" for k in ("effect", "effect_low", "effect_high", "cohens_h",
                                             "p_value", "p_adjusted")),
            f"studies/{study}/power/{hypothesis}")


TIES: tuple[Tie, ...] = (
    # linear ICL (He et al.): the H = 1, 2, 4 table and the H = 2 head pairs
    Tie("dynamics.md", "| test loss, L = 40 (2,048 prompts) | 0.379 | 0.237 | 0.237 |",
        "dynamics_summary.json",
        (None, None, "icl/runs/1/final_test_loss", "icl/runs/2/final_test_loss",
         "icl/runs/4/final_test_loss")),
    Tie("dynamics.md", "| ω per head | −0.517 | −0.152, +0.153 | +0.038 (inactive), +0.148, −0.148, +0.143 |",
        "dynamics_summary.json",
        ("icl/runs/1/omega/0", "icl/runs/2/omega/0", "icl/runs/2/omega/1", "icl/runs/4/omega/0",
         "icl/runs/4/omega/1", "icl/runs/4/omega/2", "icl/runs/4/omega/3")),
    Tie("dynamics.md", "| μ per head | −1.48 | −2.88, +2.88 | +0.005, +2.17, −2.95, +0.78 |",
        "dynamics_summary.json",
        ("icl/runs/1/mu/0", "icl/runs/2/mu/0", "icl/runs/2/mu/1", "icl/runs/4/mu/0",
         "icl/runs/4/mu/1", "icl/runs/4/mu/2", "icl/runs/4/mu/3")),
    Tie("dynamics.md", "head 0 has ω = −0.152, μ = −2.88,\n  head 1 ω = +0.153, μ = +2.88",
        "dynamics_summary.json",
        (None, "icl/runs/2/omega/0", "icl/runs/2/mu/0", None, "icl/runs/2/omega/1",
         "icl/runs/2/mu/1")),
    Tie("dynamics.md", "| R² of the model vs debiased GD | 0.782 | 0.9975 | 0.9976 |",
        "dynamics_summary.json",
        ("icl/runs/1/dgd_r2", "icl/runs/2/dgd_r2", "icl/runs/4/dgd_r2")),
    Tie("dynamics.md", "| training time, 20,000 steps | 122 s | 133 s | 107 s |",
        "dynamics_summary.json",
        (None, "icl/runs/1/train_seconds", "icl/runs/2/train_seconds",
         "icl/runs/4/train_seconds")),
    # saturation (Lioubashevski et al.): the SmolLM2 trained / random-init table
    Tie("saturation.md", "| positions kept (s_1 + 1 <= 0.85 L) | 29.4 % | 19.9 % |",
        "saturation_summary.json",
        (None, None, None, "trained/kept_fraction", "random/kept_fraction"), scale=100),
    Tie("saturation.md", "| positions in the order test (>= 3 ranks) | 1,560 | 874 |",
        "saturation_summary.json",
        (None, "trained/n_order_positions", "random/n_order_positions")),
    Tie("saturation.md", "| mean strict tau, k = 5 | **0.479** | **0.521** |",
        "saturation_summary.json", (None, "trained/mean_tau", "random/mean_tau")),
    Tie("saturation.md", "| probe balanced accuracy (4 tasks) | **0.617** | **0.676** |",
        "saturation_summary.json",
        (None, "trained/probe/balanced_accuracy", "random/probe/balanced_accuracy")),
    Tie("saturation.md", "| random-feature control / chance | 0.244 / 0.25 | 0.254 / 0.25 |",
        "saturation_summary.json",
        ("trained/probe/control_balanced_accuracy", "trained/probe/chance",
         "random/probe/control_balanced_accuracy", "random/probe/chance")),
    # ICL heads (Yin & Steinhardt): FV scoring probabilities and the ablation table
    Tie("icl_heads.md", "| antonym | 0.56 / 0.15 | 0.071 (L14H1)", "icl_heads_summary.json",
        ("fv/antonym/clean_prob", "fv/antonym/corrupted_prob", None, None, None)),
    Tie("icl_heads.md", "| country-capital | 0.63 / 0.35 | 0.085 (L20H5)",
        "icl_heads_summary.json",
        ("fv/country-capital/clean_prob", "fv/country-capital/corrupted_prob", None, None, None)),
    Tie("icl_heads.md", "| FV | 0.81 [0.78, 0.85] / 0.62 | 0.64 [0.60, 0.68] / 0.47 | 0.19 [0.16, 0.22] / 0.15 | 0.11 [0.09, 0.13] / 0.10 | 0.09 [0.07, 0.11] / 0.09 | 0.11 [0.09, 0.12] / 0.09 |",
        "icl_heads_summary.json", _ablation_row("fv")),
    Tie("icl_heads.md", "| induction | 0.81 [0.78, 0.85] / 0.62 | 0.79 [0.75, 0.82] / 0.56 | 0.56 [0.51, 0.60] / 0.40 | 0.48 [0.44, 0.52] / 0.38 | 0.22 [0.19, 0.25] / 0.09 | 0.12 [0.09, 0.14] / 0.02 |",
        "icl_heads_summary.json", _ablation_row("induction")),
    Tie("icl_heads.md", "| random | 0.81 [0.78, 0.85] / 0.62 | 0.82 [0.78, 0.85] / 0.62 | 0.80 [0.76, 0.83] / 0.62 | 0.80 [0.76, 0.83] / 0.61 | 0.80 [0.76, 0.83] / 0.59 | 0.65 [0.61, 0.69] / 0.51 |",
        "icl_heads_summary.json", _ablation_row("random")),
    # ITDA (Leask et al.): the ITDA vs SAE comparison on SmolLM2
    Tie("representations.md", "| 0.20 | 1,852 | 0.164 | 6.47 | 0.620 |",
        "representations_summary.json",
        ("itda/comparison/tau", "itda/comparison/itda_atoms",
         "itda/comparison/itda_heldout_error", "itda/comparison/itda_heldout_l0",
         "itda/comparison/itda_heldout_fve")),
    Tie("representations.md", "a **CE loss score of 0.956**", "representations_summary.json",
        ("itda/comparison/itda_ce_loss_score",)),
    # user studies (Pičulin et al.): the worked example with simulated readers
    Tie("studies.md", "| explanation | 0.42 | 0.39 [0.31, 0.47] | 0.17 | 0.17 [0.12, 0.22] |",
        "studies_worked_example.json", _study_row("explanation", pointer=True)),
    Tie("studies.md", "| none | – | 0.30 [0.22, 0.38] | – | 0.27 [0.20, 0.33] |",
        "studies_worked_example.json", _study_row("none", pointer=False)),
    Tie("studies.md", "| placebo | 0.00 | 0.14 [0.09, 0.20] | 0.17 | 0.17 [0.12, 0.21] |",
        "studies_worked_example.json", _study_row("placebo", pointer=True)),
    Tie("studies.md", "| Logit lens | H1: explanation > none | +0.09 [-0.03, +0.21] | +0.19 | 0.0888 | 0.0888 | no | 0.650 |",
        "studies_worked_example.json", _hypothesis_row("lens", "H1")),
    Tie("studies.md", "| Logit lens | H2: explanation > placebo | +0.25 [+0.14, +0.36] | +0.58 | 0.0002 | 0.0004 | yes | 0.965 |",
        "studies_worked_example.json", _hypothesis_row("lens", "H2")),
    Tie("studies.md", "| Logit attribution | H1: explanation > none | -0.10 [-0.19, -0.01] | -0.24 | 0.9826 | 1.0000 | no | 0.000 |",
        "studies_worked_example.json", _hypothesis_row("dla", "H1")),
    Tie("studies.md", "| Logit attribution | H2: explanation > placebo | +0.00 [-0.08, +0.08] | +0.00 | 0.5751 | 1.0000 | no | 0.000 |",
        "studies_worked_example.json", _hypothesis_row("dla", "H2")),
    Tie("studies.md", "one torch\nthread, 164 s in all", "studies_worked_example.json",
        ("seconds_total",)),
    # representation shattering (Nishi et al.)
    Tie("editing.md", "r² 0.80 for ROME over 80 edits", "shattering_summary.json",
        ("sweep/rome/r2", "sweep/rome/n_edits")),
)


def _value(data, path: str) -> float:
    node = data
    for part in path.split("/"):
        node = node[int(part)] if isinstance(node, list) else node[part]
    return float(node)


def _parse(number: str) -> tuple[float, int]:
    text = number.replace("−", "-").replace(",", "")
    decimals = len(text.split(".")[1]) if "." in text else 0
    return float(text), decimals


def check_tie(tie: Tie, doc_text: str, data) -> list[str]:
    """The mismatches of one tie, as readable lines (empty when every number agrees)."""
    if tie.snippet not in doc_text:
        return [f"docs/{tie.doc}: snippet not found: {tie.snippet!r}"]
    numbers = NUMBER.findall(tie.snippet)
    if len(numbers) != len(tie.paths):
        return [f"docs/{tie.doc}: {len(numbers)} numbers in {tie.snippet!r} but "
                f"{len(tie.paths)} paths"]
    problems = []
    for number, path in zip(numbers, tie.paths):
        if path is None:
            continue
        quoted, decimals = _parse(number)
        actual = _value(data, path) * tie.scale
        if abs(actual - quoted) > 0.5 * 10 ** -decimals + 1e-9:
            problems.append(f"docs/{tie.doc} quotes {number} where {tie.json}:{path} is "
                            f"{actual:.6g}")
    return problems


@pytest.mark.parametrize("tie", TIES, ids=lambda t: f"{t.doc}:{t.snippet[:30]}")
def test_docs_number_equals_its_json(tie):
    doc_text = (ROOT / "docs" / tie.doc).read_text()
    data = json.loads((FIGURES / tie.json).read_text())
    assert check_tie(tie, doc_text, data) == []


def test_a_changed_number_fails():
    """The check can fail: the same tie against a doc with one digit changed reports it."""
    tie = TIES[0]
    data = json.loads((FIGURES / tie.json).read_text())
    changed = tie.snippet.replace("0.379", "0.389")
    problems = check_tie(Tie(tie.doc, changed, tie.json, tie.paths), changed, data)
    assert len(problems) == 1 and "0.389" in problems[0]
    missing = check_tie(tie, "no such row", data)
    assert "snippet not found" in missing[0]
