"""Each method's setting in its paper, and the paper's headline result beside the explorer's.

`PAPER_SETTINGS` maps a method to the parameter values of its paper, read from the paper's
own code where it has one (the repository and file are named in ``code``) and from the
paper's text otherwise. A value is tied to the method page's parameter (``page``) and the
command's option (``flag``, the argparse destination) that set it, so ``--paper`` on a
command and the *Paper's setting* button on a page set the same values, and
`differences_from_paper` says in words which of a page's current values are not the paper's.

`PAPER_RESULTS` holds, per method, the paper's headline result (its setting and model) and
where the explorer's measured number lies in ``docs/figures/*.json``; `measured_numbers`
reads it and `reproduction_line` says whether it reproduces, by the comparison stated in the
entry. Nothing here imports the page layer; ``apps/_paper.py`` draws the card.
"""
from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from explorer._checks import InputError

__all__ = [
    "PaperValue",
    "PaperSetting",
    "PAPER_SETTINGS",
    "Measured",
    "PaperResult",
    "PAPER_RESULTS",
    "FIGURES_DIR",
    "paper_setting",
    "page_values",
    "flag_values",
    "differences_from_paper",
    "differs_line",
    "apply_paper_flags",
    "measured_numbers",
    "reproduces",
    "reproduction_line",
]

#: The committed evidence JSON the cards read.
FIGURES_DIR = Path(__file__).resolve().parents[1] / "docs" / "figures"


@dataclass(frozen=True)
class PaperValue:
    """One parameter of a paper's setting.

    name : words for the parameter ("induction sequences").
    value : the paper's value, in the unit of the page parameter / command option.
    page, flag : the page parameter and the command option (argparse destination) it sets;
        None where the page or the command has no such control.
    note : where the value comes from when not obvious (a file, a section).
    """

    name: str
    value: Any
    page: str | None = None
    flag: str | None = None
    note: str = ""


@dataclass(frozen=True)
class PaperSetting:
    method: str
    paper: str
    code: str
    values: tuple[PaperValue, ...]
    #: What the table cannot set (model, scale): said once in words on the page and in --help.
    beyond: str = ""


PAPER_SETTINGS: dict[str, PaperSetting] = {s.method: s for s in (
    PaperSetting(
        "saturation", "Lioubashevski et al., ICML 2025",
        "daria-lioubashevski/beyond_top1 (consts.py, utils.py)",
        (PaperValue("top-k ranks in the order test", 5, page="k", flag="order_k"),
         PaperValue("saturation filter (share of layers)", 0.85, flag="max_ratio",
                    note="MAX_TOP_1_SATUR_LAYER_RATIO"),
         PaperValue("permutations of the order test", 1000, flag="permutations",
                    note="KENDALLS_TAU_NUM_PERMUTATIONS"),
         PaperValue("weights", "trained", page="weights")),
        beyond="GPT2-XL, Llama3-8B, Mistral-7B and Falcon-7B on ~1k MMLU questions, texts of "
               "up to 1,024 tokens (TEXT_INPUT_LENGTH)"),
    PaperSetting(
        "icl-heads", "Yin & Steinhardt, ICML 2025",
        "kayoyin/icl-heads (src/find_induction_heads.py, src/find_fv_heads.py, src/ablate.py)",
        (PaperValue("induction sequences", 1000, page="induction_sequences",
                    flag="induction_sequences"),
         PaperValue("induction tokens per half", 50, page="induction_half_len",
                    flag="induction_half_len"),
         PaperValue("induction measure", "abs", page="induction_measure", flag="induction_measure",
                    note='detect_head(error_measure="abs")'),
         PaperValue("exclusion of the other score's top heads", True, page="exclude_other"),
         PaperValue("excluded top % of the other score", 2.0, page="exclude_percent",
                    note="excl_num=0.02"),
         PaperValue("excluded top fraction", 0.02, flag="top_fraction"),
         PaperValue("ablation mean", "cross-task", page="mean_source", flag="mean_source"),
         PaperValue("ICL score", "f1", page="icl_score", flag="icl_score",
                    note="src/ablate.py: F1 of the answer parsed from 5 generated tokens"),
         PaperValue("largest % of heads ablated", 20.0, page="max_percent"),
         PaperValue("ablated percents", "0,1,3,5,7,9,15,20", flag="percents"),
         PaperValue("prompts per task", 100, flag="n_prompts"),
         PaperValue("shots per prompt", 10, flag="n_shots")),
        beyond="12 models (Pythia 70M-6.9B, GPT-2 S-XL, Llama-2-7B), 37 FV tasks"),
    PaperSetting(
        "conflicts", "Li, Chen & Tong (JuICE), ICML 2025",
        "GaotangLi/JUICE (src/select_intervention_head.py, src/main_intervene.py)",
        (PaperValue("heads per set (K)", 5, page="select_k", flag="k"),
         PaperValue("facts the heads are selected on", 4, page="select_facts",
                    flag="select_facts"),
         PaperValue("alpha search on validation facts", True, flag="alpha_search",
                    note="alpha_s in 0..3, alpha_l in 0..5"),
         PaperValue("intervention", "juice", page="mode")),
        beyond="Gemma-2B, Llama-2-7B, Llama-3-8B and others on six fact domains"),
    PaperSetting(
        "task-emergence", "Han et al., ICML 2025",
        "no code published; the paper's section on the synthetic experiment",
        (PaperValue("input dimension", 16, flag="d"),
         PaperValue("latent tasks (bases)", 4, flag="n_tasks"),
         PaperValue("rank of each basis", 4, flag="rank"),
         PaperValue("in-context examples", 20, flag="n_examples"),
         PaperValue("coefficient mean", 0.0, flag="coef_mean"),
         PaperValue("coefficient std", 1.0, flag="coef_std"),
         PaperValue("layers", 12, flag="n_layers"),
         PaperValue("width", 128, flag="d_model"),
         PaperValue("heads", 8, flag="n_heads")),
        beyond="a 12-layer GPT-2, 5 seeds"),
    PaperSetting(
        "itda", "Leask, Nanda & Al Moubayed, ICML 2025",
        "no code in the index; the paper's Algorithm 1 and section 5",
        (PaperValue("similarity measure", "itda", page="method", flag="similarity",
                    note="Jaccard index of atom labels"),
         PaperValue("encoder", "mp", flag="encoder"),
         PaperValue("matching-pursuit steps (L0)", 40, page="l0", flag="l0",
                    note="the Llama-3.1-70B example")),
        beyond="a second trained model (another seed or checkpoint) on the same tokens; "
               "Pythia, Gemma-2-2B, GPT-2 seeds"),
    PaperSetting(
        "neuron-eval", "Oikarinen, Yan & Weng, ICML 2025",
        "Trustworthy-ML-Lab/Neuron_Eval (metrics.py, theoretical_sanity_check.ipynb)",
        (PaperValue("synthetic inputs", 500_000, flag="n_inputs"),
         PaperValue("perturbation seeds", 1000, flag="seeds"),
         PaperValue("decrease tolerance", 0.001, flag="epsilon"),
         PaperValue("activation frequencies", "0.499,0.1,0.01,0.001,0.0001", flag="frequencies"),
         PaperValue("binarisation", "top_quantile", page="binarize")),
        beyond="ViT-B/16, ResNet-50, ResNet-18, GPT-2 known neurons"),
    PaperSetting(
        "parity", "van Rossem & Saxe, 2025",
        "loekvanrossem/rnn_structure (parity/main.ipynb, source/data_analysis/automata.py)",
        (PaperValue("epochs", 1000, flag="epochs"),
         PaperValue("hidden units", 100, flag="hidden_size"),
         PaperValue("init gain", 0.1, flag="gain"),
         PaperValue("learning rate", 0.02, flag="lr"),
         PaperValue("optimizer", "sgd", flag="optimizer"),
         PaperValue("merge threshold", 0.01, page="threshold", flag="threshold",
                    note="thresh_factor")),
        beyond=""),
    PaperSetting(
        "linear-icl", "He, Pan, Chen & Yang, 2025",
        "XintianPan/ICL_linear (utils/config.py, icl_linear.ipynb)",
        (PaperValue("learning rate", 0.001, flag="lr"),
         PaperValue("training steps", 500_000, flag="steps"),
         PaperValue("heads (the notebook's example)", "4", flag="heads")),
        beyond=""),
    PaperSetting(
        "shattering", "Nishi et al., ICML 2025",
        "KentoNishi/KE-ICML-2025 (not in the index); the paper's section 3",
        (PaperValue("entities", 2048, flag="n_entities"),
         PaperValue("cyclic orders", 3, flag="n_orders"),
         PaperValue("layers", 2, flag="n_layers"),
         PaperValue("training steps", 150_000, flag="steps"),
         PaperValue("batch size", 256, flag="batch_size"),
         PaperValue("edit method", "rome", page="method", flag="method")),
        beyond="a 2-layer nanoGPT; Llama-3-8B on the months for the natural setting"),
    PaperSetting(
        "unlearning", "Guo et al., ICML 2025",
        "magikarp01/mechanistic-unlearning (finetuning_scripts/localized_finetuning_script_sports.py)",
        (PaperValue("learning rate", 1e-5, page="lr", flag="lr"),
         PaperValue("training steps", 50, page="steps", flag="steps"),
         PaperValue("facts to forget", 16, page="n_forget", flag="n_forget"),
         PaperValue("relearning steps", 20, page="relearn_steps", flag="relearn_steps"),
         PaperValue("relearning learning rate", 2e-4, flag="relearn_lr"),
         PaperValue("localization", "fact_lookup", page="method")),
        beyond="Gemma-7B, Gemma-2-9B, Llama-3-8B on sports facts"),
    PaperSetting(
        "circuits", "Wang et al. (CircuitLoRA), ICML 2025",
        "Xu0615/FinetuneCircuits (eap/attribute.py, find_circuit_100 notebooks)",
        (PaperValue("attribution", "eap-ig", page="method", flag="method"),
         PaperValue("integration steps", 5, flag="steps", note="ig_steps"),
         PaperValue("metric", "kl", flag="metric")),
        beyond="Pythia-1.4B-deduped on add/sub with operands up to 100"),
)}


def paper_setting(method: str) -> PaperSetting:
    """The table entry of ``method``; InputError listing the methods otherwise."""
    if method not in PAPER_SETTINGS:
        raise InputError(f"`method` must be one of {sorted(PAPER_SETTINGS)}; got {method!r}.")
    return PAPER_SETTINGS[method]


def page_values(method: str) -> dict[str, Any]:
    """Page parameter -> the paper's value (what the *Paper's setting* button sets)."""
    return {v.page: v.value for v in paper_setting(method).values if v.page}


def flag_values(method: str) -> dict[str, Any]:
    """Command option (argparse destination) -> the paper's value (what ``--paper`` sets)."""
    return {v.flag: v.value for v in paper_setting(method).values if v.flag}


def _words(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=1e-12)
    return a == b


def differences_from_paper(method: str, current: Mapping[str, Any], *, by: str = "page"
                           ) -> list[str]:
    """Each value of ``current`` that is not the paper's, in words: ``"induction sequences 4
    (paper: 1,000)"``. ``by="page"``: ``current`` maps page parameters to values; ``"flag"``:
    command options (e.g. the training settings of a stored run). Names the table does not tie
    are not looked at."""
    if by not in ("page", "flag"):
        raise InputError(f"`by` must be 'page' or 'flag'; got {by!r}.")
    out = []
    for v in paper_setting(method).values:
        key = v.page if by == "page" else v.flag
        if key and key in current and not _same(current[key], v.value):
            out.append(f"{v.name} {_words(current[key])} (paper: {_words(v.value)})")
    return out


def differs_line(method: str, current: Mapping[str, Any],
                 run: Mapping[str, Any] | None = None) -> str:
    """The page's line on the paper's setting: which of the page's values (``current``) and of
    the shown run's training settings (``run``, by command option) differ from the paper's,
    or that none does; then what the page cannot set (the paper's models and scale)."""
    diffs = differences_from_paper(method, current)
    trained = differences_from_paper(method, run, by="flag") if run else []
    if trained:
        diffs.append("the shown run was trained with " + ", ".join(trained))
    beyond = paper_setting(method).beyond
    tail = f" Not set on this page: {beyond}." if beyond else ""
    if not diffs:
        return "The paper's setting: every value set on this page is the paper's." + tail
    return "Differs from the paper: " + "; ".join(diffs) + "." + tail


def apply_paper_flags(args: Any, method: str, *, keep: Any = ()) -> list[str]:
    """Set ``args``' options to the paper's values (``--paper``), except those in ``keep``
    (options the user set); returns ``name=value`` for each option set, for the command to
    report."""
    done = []
    for flag, value in flag_values(method).items():
        if hasattr(args, flag) and flag not in keep:
            setattr(args, flag, value)
            done.append(f"{flag}={_words(value)}")
    return done


# -- paper vs here --------------------------------------------------------------------------

@dataclass(frozen=True)
class Measured:
    """One number of the explorer's own evidence: a key path into a committed JSON."""

    label: str
    path: str
    low: str | None = None
    high: str | None = None


@dataclass(frozen=True)
class PaperResult:
    method: str
    paper: str                    # the paper's headline result, in words
    paper_setting: str            # its setting and model
    figure: str                   # docs/figures/<figure>
    here_setting: str             # the explorer's setting and model
    measured: tuple[Measured, ...]
    #: (left, op, right): a measured label or a number on each side, op one of "<", ">".
    test: tuple[Any, str, Any]
    claim: str                    # what the test checks, in words
    doc: str = ""                 # the docs page with the details
    extra: Mapping[str, Any] = field(default_factory=dict)


#: The ICL ablation table's cross-task cell (both folds pooled); index 2 of a row is 3 % of heads.
_ICL_CELL = "ablation_cross_fit/by_mean_source/cross-task"

PAPER_RESULTS: dict[str, PaperResult] = {r.method: r for r in (
    PaperResult(
        "saturation",
        "top-k tokens saturate in rank order: mean strict Kendall τ of the saturation "
        "layers against the ranks is positive and significant (permutation test)",
        "GPT2-XL, Llama3-8B, Mistral-7B, Falcon-7B; k = 5; 1,000 permutations",
        "saturation_summary.json",
        "SmolLM2-135M (trained), 21,250 corpus tokens, k = 5, 1,000 permutations",
        (Measured("mean τ", "trained/mean_tau"), Measured("p", "trained/p_value")),
        ("p", "<", 0.05), "τ > 0 with permutation p < 0.05", "docs/saturation.md"),
    PaperResult(
        "icl-heads",
        "few-shot ICL depends mainly on FV heads: ablating the top FV heads (other score's "
        "top 2 % excluded) costs far more accuracy than ablating the top induction heads",
        "12 models, 70M-7B; 10-shot; mean ablation of the top 3 % of heads",
        "icl_heads_summary.json",
        "SmolLM2-135M, 13 tasks, 10-shot, 3 % of heads, cross-task mean",
        (Measured("FV excl. induction", f"{_ICL_CELL}/mean_accuracy/fv_excl_induction/2",
                  f"{_ICL_CELL}/mean_accuracy_low/fv_excl_induction/2",
                  f"{_ICL_CELL}/mean_accuracy_high/fv_excl_induction/2"),
         Measured("induction excl. FV", f"{_ICL_CELL}/mean_accuracy/induction_excl_fv/2",
                  f"{_ICL_CELL}/mean_accuracy_low/induction_excl_fv/2",
                  f"{_ICL_CELL}/mean_accuracy_high/induction_excl_fv/2")),
        ("FV excl. induction", "<", "induction excl. FV"),
        "accuracy with FV heads ablated < accuracy with induction heads ablated",
        "docs/icl_heads.md"),
    PaperResult(
        "conflicts",
        "JuICE selects heads whose enhancement is consistent over the three prompt types "
        "and raises parametric accuracy under conflicting context",
        "Gemma-2B and five other models; K = 5 heads on 4 facts; alphas searched",
        "conflicts_summary_parametric_select4.json",
        "SmolLM2-135M, K = 5 on 4 facts, parametric direction",
        (Measured("consistent S+ heads", "directions/parametric/n_consistent_plus"),
         Measured("consistent S- heads", "directions/parametric/n_consistent_minus")),
        ("consistent S+ heads", ">", 0),
        "at least one head enhances the parametric answer on all three prompt types",
        "docs/conflicts.md"),
    PaperResult(
        "task-emergence",
        "task decodability (k-NN vote of the latent task) rises during training as the "
        "in-context loss falls below task-agnostic regression",
        "12-layer GPT-2 (d = 128), x in R^16, 4 rank-4 bases, 20 examples, 5 seeds",
        "task_emergence_summary.json",
        "3-layer width-64 transformer, x in R^8, 4 rank-2 bases, 4 examples, seed 0, "
        "20,000 steps",
        (Measured("TD at step 0", "emergence/seeds/0/initial_td"),
         Measured("TD at step 20,000 (best layer)", "emergence/seeds/0/final_td/1"),
         Measured("correlation of TD with ICL loss", "emergence/seeds/0/td_icl_correlation")),
        ("TD at step 20,000 (best layer)", ">", "TD at step 0"),
        "task decodability at the end of training above its value at initialisation",
        "docs/dynamics.md"),
    PaperResult(
        "itda",
        "ITDA dictionaries reconstruct as well as SAEs for a small share of the cost "
        "(8 minutes per GPT-2-small ITDA against 2-8 hours per SAE)",
        "GPT-2 small/medium, Pythia, Gemma-2-2B residual streams on ~1.2M Pile tokens",
        "representations_summary.json",
        "SmolLM2-135M layer 15, 6,280 tokens, tau 0.2, L0 8, SAE trained to the same error",
        (Measured("ITDA / SAE time", "itda/comparison/time_ratio_itda_over_sae"),
         Measured("ITDA CE loss score", "itda/comparison/itda_ce_loss_score"),
         Measured("SAE CE loss score", "itda/comparison/sae_ce_loss_score")),
        ("ITDA / SAE time", "<", 1.0), "ITDA takes less time than the SAE at a matched error",
        "docs/representations.md"),
    PaperResult(
        "neuron-eval",
        "only a few metrics (AUPRC, inverse AUPRC, correlation-type) pass both sanity "
        "checks: decrease accuracy > 90 % under missing and under extra labels",
        "n = 500,000 simulated inputs, 1,000 seeds, frequencies 0.499-0.0001",
        "representations_summary.json",
        "n = 100,000 simulated inputs, 100 seeds, the same frequencies",
        (Measured("AUPRC passes both (1 = yes)", "sanity/synthetic/rows/15/passed"),
         Measured("recall passes both (1 = yes)", "sanity/synthetic/rows/0/passed")),
        ("AUPRC passes both (1 = yes)", ">", "recall passes both (1 = yes)"),
        "AUPRC passes both checks where recall does not",
        "docs/representations.md"),
    PaperResult(
        "parity",
        "an RNN trained on strings up to length 10 merges its states into the 2-state "
        "parity automaton and generalises to strings of any length",
        "ReLU RNN, 100 units, gain 0.1, SGD lr 0.02, 1,000 epochs",
        "dynamics_summary.json",
        "the same network and training on this machine",
        (Measured("final automaton states", "parity/seeds/0/final_n_states_minimal"),
         Measured("accuracy on length 10,000", "parity/seeds/0/final_accuracy/10000")),
        ("final automaton states", "<", 3), "a 2-state automaton at the end of training",
        "docs/dynamics.md"),
    PaperResult(
        "linear-icl",
        "two heads pair up (ω, −ω; μ, −μ) and implement debiased gradient descent",
        "1-layer multi-head softmax attention, d = 5, L = 40, noise 0.1, Adam 1e-3",
        "dynamics_summary.json",
        "the same model and data, H = 2, 20,000 steps",
        (Measured("R² vs debiased GD", "icl/runs/2/dgd_r2"),
         Measured("|Σμ| / Σ|μ|", "icl/runs/2/mu_sum_ratio")),
        ("R² vs debiased GD", ">", 0.95), "R² of the model against debiased GD above 0.95",
        "docs/dynamics.md"),
    PaperResult(
        "shattering",
        "edits that distort the entity geometry more (larger shattering R) break more of "
        "the other facts",
        "2-layer nanoGPT, 2,048 entities, 3 cyclic orders; ROME, MEMIT, AlphaEdit, PMET",
        "shattering_summary.json",
        "2-layer transformer, 64 entities, 3 orders; 80 ROME edits",
        (Measured("r² of R vs accuracy drop (ROME)", "sweep/rome/r2"),),
        ("r² of R vs accuracy drop (ROME)", ">", 0.5), "R explains most of the accuracy drop",
        "docs/editing.md"),
    PaperResult(
        "unlearning",
        "the attribute is looked up in early-mid MLPs: a probe on the subject token reads it "
        "there (the fact-lookup layers unlearning is localized to)",
        "Gemma-7B, Gemma-2-9B, Llama-3-8B; 16 or 64 athletes; lr 1e-5, 50 steps",
        "unlearning_summary.json",
        "SmolLM2-135M, 16 facts, 8 steps, lr 2e-4",
        (Measured("probe accuracy at the best layer (known facts)",
                  "localize/probe_known/probe_accuracy/8"),
         Measured("chance", "localize/probe_known/chance")),
        ("probe accuracy at the best layer (known facts)", ">", "chance"),
        "a probe finds the attribute above chance in the fact-lookup layers",
        "docs/unlearning.md"),
    PaperResult(
        "circuits",
        "at equal trainable parameters, LoRA with more rank on the layers whose circuit edges "
        "change most in a cheap fine-tune (CircuitLoRA) beats uniform LoRA",
        "Pythia-1.4B-deduped, arithmetic with operands up to 100; EAP-IG circuits, K = 5 "
        "critical layers",
        "circuit_lora_summary.json",
        "SmolLM2-135M on addition, ranks 4 (LoRA) vs 14 / 2 (CircuitLoRA), 1,221,120 "
        "parameters each, mean test accuracy of 3 seeds on 300 problems",
        (Measured("CircuitLoRA accuracy",
                  "comparison/variants/circuit-lora/test_accuracy_mean_sd/0"),
         Measured("LoRA accuracy", "comparison/variants/lora/test_accuracy_mean_sd/0")),
        ("CircuitLoRA accuracy", ">", "LoRA accuracy"),
        "CircuitLoRA's mean test accuracy above LoRA's",
        "docs/circuit_lora.md"),
)}


def _lookup(data: Any, path: str) -> Any:
    node = data
    for part in path.split("/"):
        if isinstance(node, list):
            node = node[int(part)]
        else:
            node = node[part]
    return node


def _number(node: Any) -> float:
    if not isinstance(node, (int, float)):       # bool is an int: a pass/fail reads 1 / 0
        raise InputError(f"a measured number must be a number in the JSON; got {node!r}.")
    return float(node)


def measured_numbers(method: str, folder: str | Path | None = None
                     ) -> dict[str, dict[str, float | None]]:
    """label -> {"value", "low", "high"} of the entry's measured numbers, read from its
    committed JSON (``low``/``high`` None where the JSON has no interval)."""
    if method not in PAPER_RESULTS:
        raise InputError(f"`method` must be one of {sorted(PAPER_RESULTS)}; got {method!r}.")
    result = PAPER_RESULTS[method]
    data = json.loads((Path(folder or FIGURES_DIR) / result.figure).read_text())
    return {m.label: {"value": _number(_lookup(data, m.path)),
                      "low": None if m.low is None else _number(_lookup(data, m.low)),
                      "high": None if m.high is None else _number(_lookup(data, m.high))}
            for m in result.measured}


def reproduces(method: str, numbers: Mapping[str, Mapping[str, float | None]]) -> bool:
    """Whether the entry's test holds for ``numbers`` (from `measured_numbers`)."""
    left, op, right = PAPER_RESULTS[method].test

    def side(x: Any) -> float:
        return float(numbers[x]["value"]) if isinstance(x, str) else float(x)
    a, b = side(left), side(right)
    return a < b if op == "<" else a > b


def reproduction_line(method: str, numbers: Mapping[str, Mapping[str, float | None]]) -> str:
    """One line: whether the paper's result reproduces here, and by which test."""
    claim = PAPER_RESULTS[method].claim
    if reproduces(method, numbers):
        return f"Reproduces here: {claim}."
    return f"Does not reproduce here: the test ({claim}) does not hold."
