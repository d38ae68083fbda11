"""The study report (Markdown or HTML) and the CSV export of responses.

The report states what another lab needs to rerun the study and judge it: the
pre-registered hypotheses verbatim with the study file's hash, the design, the results with
their intervals, the exclusions, the limitations (the study's own and those the run shows),
an evaluation-hygiene checklist after Pičulin et al. (2025), and the exact software
versions and seeds.
"""
from __future__ import annotations

import csv
import datetime as dt
import html
import io
import math
import re
from pathlib import Path
from typing import Any

import xarray as xr

from explorer._checks import check_choice

from .analysis import analyse
from .run import software_versions

__all__ = ["study_report", "export_responses_csv", "CSV_COLUMNS", "hygiene_checklist"]

#: Columns of the exported CSV: participant codes only, nothing personal.
CSV_COLUMNS = ("participant", "slot", "trial_index", "item_id", "attention_check", "condition",
               "condition_kind", "choice", "choice_text", "correct", "confidence", "rt_ms",
               "shown_at_utc", "answered_at_utc", "simulated")


def _utc(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.timezone.utc).isoformat(timespec="milliseconds")


def export_responses_csv(run: Any, path: str | Path | None = None) -> str:
    """Every stored response as CSV (one row per answer; columns `CSV_COLUMNS`).

    Parameters
    ----------
    run : StudyRun
    path : str or Path, optional
        Also write the CSV there.

    Returns
    -------
    str
        The CSV text.
    """
    kinds = {c.name: c.kind for c in run.study.conditions}
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)
    for r in run.store.responses():
        item = run.items[r["item_id"]]
        writer.writerow([r["code"], r["slot"], r["trial_index"], r["item_id"],
                         int(r["attention_check"]), r["condition"],
                         kinds.get(r["condition"], "attention_check"), r["choice"],
                         item["choices"][r["choice"]], r["correct"], r["confidence"],
                         f"{r['rt_ms']:.1f}", _utc(r["shown_at"]), _utc(r["answered_at"]),
                         int(r["simulated"])])
    text = buf.getvalue()
    if path is not None:
        Path(path).expanduser().write_text(text, encoding="utf-8")
    return text


def hygiene_checklist(run: Any) -> list[tuple[str, bool, str]]:
    """The criteria Pičulin et al. (2025) code user studies by, each computed for this run.

    Every item is read from the study file and the run folder, so a study that lacks one is
    told (with what is missing in the note). The criteria are the paper's coding columns:
    baseline, placebo, attention check, data-quality check, reproducibility, pre-registration,
    questionnaire validation, pre-testing, limitations, and an objective (not self-reported)
    task.

    Returns
    -------
    list of (criterion, met, note)
    """
    study = run.study
    kinds = {c.kind for c in study.conditions}
    placebos = sorted({c.placebo for c in study.conditions if c.placebo})
    checks = study.task.attention_checks
    rows = [
        ("Baseline condition", "baseline" in kinds,
         "no explanation shown" if "baseline" in kinds else "no condition of kind 'baseline'"),
        ("Placebo explanation", "placebo" in kinds,
         ", ".join(placebos) if placebos else "no condition of kind 'placebo'"),
        ("Attention check", checks > 0,
         f"{checks} per participant" if checks else "task.attention_checks is 0"),
    ]
    quality = checks > 0 and study.analysis.exclude_failed_attention
    rows.append(("Data-quality check", quality,
                 "participants who fail an attention check are excluded from the analysis"
                 if quality else "no exclusion rule: set task.attention_checks > 0 with "
                 "analysis.exclude_failed_attention"))
    rows.append(_preregistration(run))
    rows.append(_reproducibility(run))
    objective = all("answer" in it for it in run.items.values() if not it["attention_check"])
    rows.append(("Objective task (not self-reported trust)", objective,
                 "accuracy against the model's own behaviour (an answer key per item)"
                 if objective else "some items have no answer key"))
    rows.append(("Questionnaire validated", bool(study.questionnaire_validation),
                 study.questionnaire_validation or
                 f"the {study.task.confidence_levels}-level confidence rating is not validated "
                 "(name its source in questionnaire_validation)"))
    rows.append(("Pre-tested", bool(study.pretest),
                 study.pretest or "no pilot stated (describe it in pretest)"))
    rows.append(("Limitations stated", bool(study.limitations),
                 f"{len(study.limitations)} in the study file, listed below" if study.limitations
                 else "the study file lists none (the report adds only those the run shows)"))
    return rows


def _preregistration(run: Any) -> tuple[str, bool, str]:
    """Hypotheses and analysis fixed in the study file, whose hash the run holds, before any
    response (the run folder refuses a study file edited after preparation)."""
    study = run.study
    missing = []
    if not study.hypotheses:
        missing.append("no hypotheses")
    if not study.analysis_in_file:
        missing.append("no analysis section (defaults only)")
    created = dt.datetime.fromisoformat(run.info["created"]).timestamp()
    early = [r for r in run.store.responses() if r["shown_at"] < created - 1.0]
    if early:
        missing.append(f"{len(early)} responses recorded before the run was prepared")
    if missing:
        return ("Pre-registered hypotheses and analysis", False, "; ".join(missing))
    return ("Pre-registered hypotheses and analysis", True,
            f"{len(study.hypotheses)} hypotheses and the analysis in the study file, "
            f"sha256 {study.sha256[:16]}, fixed at {run.info['created']}")


def _reproducibility(run: Any) -> tuple[str, bool, str]:
    """What another lab needs to rebuild the run: the study file, items, seeds, versions,
    and the model's weights identified."""
    info = run.info
    missing = [what for what, ok in (
        ("study file copy", any(run.folder.glob("study.*"))),
        ("items with answers and explanations",
         bool(run.items) and all("answer" in it and "explanations" in it
                                 for it in run.items.values())),
        ("seeds", bool(info.get("seeds"))),
        ("software versions", bool(info.get("versions"))),
        ("model weights id", bool(info.get("model", {}).get("weights"))),
    ) if not ok]
    if missing:
        return ("Reproducible", False, "missing: " + ", ".join(missing))
    return ("Reproducible", True, "study file, items, seeds, versions and the model's weights id "
            f"({info['model']['weights'][:16]}) stored with the run")


def _limitations(run: Any, ds: xr.Dataset) -> list[str]:
    study = run.study
    out = list(study.limitations)
    if ds.attrs["n_simulated"]:
        out.append(f"{ds.attrs['n_simulated']} of the participants are simulated "
                   "(explorer.studies.simulate_participants): these results check the pipeline, "
                   "they are not evidence about people.")
    if ds.attrs["n_analysed"] < study.participants:
        out.append(f"Only {ds.attrs['n_analysed']} of the {study.participants} planned "
                   "participants are analysed.")
    if study.design == "within" and any(c.placebo == "mismatched_example" for c in study.conditions):
        out.append("Within participants, a mismatched-example placebo shows the real explanation "
                   "of another item, which the same participant may also see as a real one.")
    if any(it["details"].get("shows_final_layer") for it in run.items.values()):
        out.append("The logit-lens explanation includes the last layer, whose top token is the "
                   "model's own prediction: the real condition then shows the answer.")
    if "tiny" in run.info["model"]["name"]:
        out.append(f"The items come from {run.info['model']['name']}, a random-init test model.")
    out.append("Items are a fixed, small set of prompts chosen by the study authors; results "
               "may not carry over to other prompts, models or explanation methods.")
    return out


def _fmt(x: Any, digits: int = 3) -> str:
    try:
        x = float(x)
    except (TypeError, ValueError):
        return str(x)
    return "n/a" if not math.isfinite(x) else f"{x:.{digits}f}"


def study_report(run: Any, ds: xr.Dataset | None = None, *, format: str = "markdown") -> str:
    """The report of a study run.

    Parameters
    ----------
    run : StudyRun
    ds : xarray.Dataset, optional
        The analysis (default: `explorer.studies.analysis.analyse` of the run).
    format : {"markdown", "html"}, default="markdown"

    Returns
    -------
    str
    """
    check_choice("format", format, ("markdown", "html"))
    ds = analyse(run) if ds is None else ds
    study = run.study
    level = int(round(100 * ds.attrs["confidence_level"]))
    blocks: list[tuple[str, Any]] = [("h1", f"Study report: {study.title}")]
    blocks.append(("p", f"Study `{study.name}` · study file sha256 `{study.sha256}` · run folder "
                        f"`{run.folder.name}` · report made "
                        f"{dt.datetime.now(dt.timezone.utc).isoformat(timespec='seconds')}"))
    if study.description:
        blocks.append(("p", study.description))

    blocks.append(("h2", "Design"))
    conds = [f"`{c.name}`: {c.kind}" + (f" ({c.placebo})" if c.placebo else "")
             for c in study.conditions]
    blocks.append(("ul", [
        f"Task: {study.task.kind} — “{study.task.question}” ({study.task.n_choices} choices, "
        f"chance accuracy {_fmt(ds.attrs['chance_accuracy'])}; confidence 1–"
        f"{study.task.confidence_levels})",
        f"Explanation: {study.explanation.kind}",
        f"Conditions: {'; '.join(conds)}",
        f"Design: {study.design}-participant; {len(study.prompts)} items"
        f" + {study.task.attention_checks} attention checks per participant",
        f"Model: {run.info['model']['name']} (weights {run.info['model']['weights']}); "
        f"study file asked for {run.info['model_requested']}",
        f"Participants: {study.participants} planned, {ds.attrs['n_enrolled']} enrolled, "
        f"{ds.attrs['n_complete']} complete, {ds.attrs['n_failed_attention']} failed an attention "
        f"check, {ds.attrs['n_excluded']} excluded, {ds.attrs['n_analysed']} analysed",
    ]))

    blocks.append(("h2", "Pre-registered hypotheses"))
    blocks.append(("ul", [f"**{h.id}** ({h.compare[0]} {_DIRECTION[h.direction]} {h.compare[1]}): "
                          f"{h.statement}" for h in study.hypotheses]))
    plan = study.analysis
    swaps = ("within-participant label swaps" if study.design == "within"
             else "group label permutations")
    blocks.append(("p", f"Analysis plan: accuracy per condition, pooled over responses, with "
                        f"{level}% percentile intervals from {plan.bootstrap} bootstrap resamples "
                        f"of participants; effects are accuracy differences and Cohen's h; "
                        f"p-values from {plan.permutations} permutations "
                        f"({swaps}), "
                        f"{'Holm-corrected' if plan.correction == 'holm' else 'uncorrected'}, "
                        f"alpha {plan.alpha}; participants failing an attention check are "
                        f"{'excluded' if plan.exclude_failed_attention else 'kept'}."))

    blocks.append(("h2", "Results"))
    rows = []
    for c in ds["condition"].values:
        s = ds.sel(condition=c)
        rows.append([str(c), str(s["condition_kind"].values), _fmt(s["accuracy"].values),
                     f"[{_fmt(s['accuracy_low'].values)}, {_fmt(s['accuracy_high'].values)}]",
                     str(int(s["n_responses"].values)), str(int(s["n_participants"].values)),
                     _fmt(s["mean_confidence"].values, 2), _fmt(s["median_rt_ms"].values / 1000, 1)])
    blocks.append(("table", (["condition", "kind", "accuracy", f"{level}% CI", "responses",
                              "participants", "mean confidence", "median time (s)"], rows)))
    rows = []
    for hid in ds["hypothesis"].values:
        s = ds.sel(hypothesis=hid)
        rows.append([str(hid), f"{s['compare_a'].values} − {s['compare_b'].values}",
                     _fmt(s["effect"].values),
                     f"[{_fmt(s['effect_low'].values)}, {_fmt(s['effect_high'].values)}]",
                     _fmt(s["cohens_h"].values, 2),
                     f"[{_fmt(s['cohens_h_low'].values, 2)}, {_fmt(s['cohens_h_high'].values, 2)}]",
                     _fmt(s["p_value"].values, 4), _fmt(s["p_adjusted"].values, 4),
                     "yes" if bool(s["supported"].values) else "no"])
    blocks.append(("table", (["hypothesis", "comparison", "accuracy difference", f"{level}% CI",
                              "Cohen's h", f"{level}% CI", "p", "p adjusted", "supported"], rows)))

    blocks.append(("h2", "Evaluation hygiene (Pičulin et al., ICML 2025)"))
    blocks.append(("table", (["criterion", "met", "note"],
                             [[name, "yes" if met else "no", note]
                              for name, met, note in hygiene_checklist(run)])))

    blocks.append(("h2", "Limitations"))
    blocks.append(("ul", _limitations(run, ds)))

    blocks.append(("h2", "Reproducibility"))
    seeds = ds.attrs["seeds"]
    blocks.append(("ul", [
        f"Randomisation seed {seeds['randomisation']} (schedule: explorer.studies.randomise; "
        f"placebos and choice order: explorer.studies.items); analysis seed {seeds['analysis']}",
        f"Items computed {run.info['created']} with: " + _versions(run.info["versions"]),
        "Analysed with: " + _versions(software_versions()),
        f"Rerun: `explorer study run {run.folder.name}/{Path(study.source).name} --dir NEW_FOLDER "
        f"--model {run.info['model']['name']}`, then `explorer study analyse NEW_FOLDER`",
    ]))
    return _render_html(blocks, study.title) if format == "html" else _render_markdown(blocks)


_DIRECTION = {"greater": ">", "less": "<", "two-sided": "≠"}


def _versions(v: dict[str, str]) -> str:
    return ", ".join(f"{k} {val}" for k, val in v.items())


def _render_markdown(blocks: list[tuple[str, Any]]) -> str:
    out: list[str] = []
    for kind, body in blocks:
        if kind == "h1":
            out.append(f"# {body}")
        elif kind == "h2":
            out.append(f"## {body}")
        elif kind == "p":
            out.append(body)
        elif kind == "ul":
            out.append("\n".join(f"- {x}" for x in body))
        else:
            head, rows = body
            lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
            lines += ["| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in rows]
            out.append("\n".join(lines))
    return "\n\n".join(out) + "\n"


def _inline_html(text: str) -> str:
    """Escape, then turn `code` and **bold** (the only Markdown the blocks use) into tags."""
    text = html.escape(text)
    text = re.sub(r"`([^`]+)`", r"<code>\1</code>", text)
    return re.sub(r"\*\*([^*]+)\*\*", r"<strong>\1</strong>", text)


def _render_html(blocks: list[tuple[str, Any]], title: str) -> str:
    out = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
           f"<title>{html.escape(title)}</title>",
           "<style>body{font-family:system-ui,sans-serif;max-width:60rem;margin:2rem auto;"
           "line-height:1.45}table{border-collapse:collapse;margin:1rem 0}"
           "td,th{border:1px solid #bbb;padding:.25rem .5rem;text-align:left}"
           "code{background:#f2f2f2;padding:0 .2rem}</style></head><body>"]
    for kind, body in blocks:
        if kind in ("h1", "h2"):
            out.append(f"<{kind}>{_inline_html(body)}</{kind}>")
        elif kind == "p":
            out.append(f"<p>{_inline_html(body)}</p>")
        elif kind == "ul":
            out.append("<ul>" + "".join(f"<li>{_inline_html(x)}</li>" for x in body) + "</ul>")
        else:
            head, rows = body
            out.append("<table><thead><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in head)
                       + "</tr></thead><tbody>"
                       + "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>"
                                 for r in rows)
                       + "</tbody></table>")
    out.append("</body></html>")
    return "\n".join(out) + "\n"
