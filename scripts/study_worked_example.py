"""A worked user study with simulated participants, built as the gallery's User study page
builds it, for docs/studies.md.

For each source page (the Logit lens and the Logit attribution page) the script builds the
page's study on SmolLM2 (`apps.study_builder.StudyBuilderView`: 12 items, the sidebar's default
prompt first; conditions explanation / none / placebo; 30 participants in a within design, the
scale of studies/example_study.yaml), then lets 30 simulated *readers*
(`explorer.studies.readers`) take it through the participant app's own buttons
(`apps.study.StudySession`: consent, the items, a choice and a confidence, Submit). A reader
follows what the explanation points at with probability ``--reliance`` and guesses otherwise,
so its accuracy in a condition measures what that condition's explanation tells a literal
reader. The analysis is the page's (`explorer.studies.analyse`).

It also reports, per condition, how often the explanation points at the correct choice (a
property of the items alone), and the power of the design: the share of ``--replicates``
fresh populations of readers, analysed in memory, for which each hypothesis is supported.

    python scripts/study_worked_example.py                 # docs/figures/studies_worked_example.json
    python scripts/study_worked_example.py --model tiny-llama --replicates 20 --out /tmp/s.json
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from explorer.defaults import DEFAULT_MODEL  # noqa: E402


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def take_part(run: Any, rng: np.random.Generator, reliance: float) -> str:
    """One reader through the participant app's buttons; returns their code."""
    from apps.study import StudySession
    from explorer.studies.readers import reader_choice

    s = StudySession(run.folder)
    try:
        s._agree.value = True
        s._start.clicks += 1
        s._begin.clicks += 1
        while s.stage == "item":
            display = run.trial_display(s._trial)
            s._choice_buttons[reader_choice(display, rng, reliance=reliance)].clicks += 1
            s._confidence_buttons[int(rng.integers(len(s._confidence_buttons)))].clicks += 1
            s._submit.clicks += 1
        return s.code
    finally:
        s.close()


def pointer_accuracy(run: Any) -> dict[str, float]:
    """Per condition: the share of items whose explanation points at the correct choice."""
    from explorer.studies.randomise import Trial
    from explorer.studies.readers import explanation_pick

    out = {}
    items = [it for it in run.items.values() if not it["attention_check"]]
    for name in run.study.condition_names:
        hits = [explanation_pick(run.trial_display(Trial(0, it["id"], name))) == it["answer"]
                for it in items]
        out[name] = float(np.mean(hits))
    return out


def power(run: Any, reliance: float, replicates: int, seed: int) -> dict[str, float]:
    """Share of fresh reader populations for which each hypothesis is supported."""
    from explorer.studies.analysis import analyse_responses
    from explorer.studies.randomise import ATTENTION_CONDITION, participant_schedule
    from explorer.studies.readers import reader_choice

    study = run.study
    schedules = [participant_schedule(study, slot) for slot in range(study.participants)]
    supported = np.zeros(len(study.hypotheses))
    rng = np.random.default_rng(seed)
    for _ in range(replicates):
        rows = []
        for slot, trials in enumerate(schedules):
            for t in trials:
                item = run.items[t.item_id]
                choice = reader_choice(run.trial_display(t), rng, reliance=reliance)
                rows.append({"code": f"R{slot}", "condition": t.condition,
                             "correct": int(choice == item["answer"]), "confidence": 3,
                             "rt_ms": 1.0, "attention_check": t.condition == ATTENTION_CONDITION})
        ds = analyse_responses(rows, study)
        supported += ds["supported"].values
    return {h.id: float(s / replicates) for h, s in zip(study.hypotheses, supported)}


def one_study(model: Any, source: str, args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    from apps.study_builder import StudyBuilderView

    t0 = time.perf_counter()
    page = StudyBuilderView(model, folder=folder)
    page.param.update(source=source, participants=args.participants, seed=args.seed)
    page.build()
    page.wait()
    if page.error:
        raise SystemExit(f"building the {source} study failed: {page.error}")
    run = page.run
    build_s = time.perf_counter() - t0
    _log(f"{source}: {len(run.study.prompts)} items built in {build_s:.1f} s")
    rng = np.random.default_rng(args.seed)
    t1 = time.perf_counter()
    for i in range(args.participants):
        take_part(run, rng, args.reliance)
    answer_s = time.perf_counter() - t1
    page.refresh_analysis()
    ds = page.analysis
    _log(f"{source}: {args.participants} readers answered in {answer_s:.1f} s; "
         f"accuracy {dict(zip(map(str, ds['condition'].values), np.round(ds['accuracy'].values, 3).tolist()))}")
    t2 = time.perf_counter()
    pw = power(run, args.reliance, args.replicates, args.seed + 1)
    power_s = time.perf_counter() - t2
    _log(f"{source}: power over {args.replicates} replicates {pw} ({power_s:.1f} s)")
    out = {
        "source_page": source, "study": run.study.to_dict(), "study_sha256": run.study.sha256,
        "n_items": len(run.study.prompts), "n_attention_checks": run.study.task.attention_checks,
        "participants": int(ds.attrs["n_analysed"]), "n_complete": int(ds.attrs["n_complete"]),
        "n_excluded": int(ds.attrs["n_excluded"]),
        "pointer_accuracy": pointer_accuracy(run),
        "conditions": {
            str(c): {k: float(ds[k].sel(condition=c)) for k in
                     ("accuracy", "accuracy_low", "accuracy_high", "n_responses",
                      "n_participants")}
            for c in ds["condition"].values},
        "hypotheses": {
            str(h): {"compare": [str(ds["compare_a"].sel(hypothesis=h).item()),
                                 str(ds["compare_b"].sel(hypothesis=h).item())],
                     **{k: float(ds[k].sel(hypothesis=h)) for k in
                        ("effect", "effect_low", "effect_high", "cohens_h", "cohens_h_low",
                         "cohens_h_high", "p_value", "p_adjusted")},
                     "supported": bool(ds["supported"].sel(hypothesis=h))}
            for h in ds["hypothesis"].values},
        "power": pw,
        "seconds": {"build": build_s, "answer": answer_s, "power": power_s},
    }
    page.close()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=DEFAULT_MODEL, help="model the items are computed on")
    p.add_argument("--sources", default="lens,dla", help="source pages, comma-separated")
    p.add_argument("--participants", type=int, default=30, help="simulated readers per study")
    p.add_argument("--reliance", type=float, default=0.8,
                   help="probability that a reader follows the explanation")
    p.add_argument("--replicates", type=int, default=200, help="populations for the power")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "figures" / "studies_worked_example.json")
    args = p.parse_args(argv)

    from explorer import load_model

    t0 = time.perf_counter()
    model = load_model(args.model)
    summary: dict[str, Any] = {
        "command": " ".join(["python scripts/study_worked_example.py", *(argv or sys.argv[1:])]),
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d"),
        "machine": {"platform": platform.platform(terse=True), "processor": platform.processor(),
                    "cpus": os.cpu_count(), "python": platform.python_version(),
                    "torch_threads": __import__("torch").get_num_threads()},
        "model": model.spec.name, "reliance": args.reliance, "replicates": args.replicates,
        "seed": args.seed, "studies": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        for source in [s for s in args.sources.split(",") if s]:
            summary["studies"][source] = one_study(model, source, args, Path(tmp))
    summary["seconds_total"] = time.perf_counter() - t0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    _log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
