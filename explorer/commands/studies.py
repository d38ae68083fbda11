"""``explorer study ...`` (flags, parsing and printing over `explorer.studies`): validate a
study file, prepare and serve a run, simulate participants, analyse, export.

Added to the ``explorer`` command line by `register_cli` (listed in
``explorer.cli.COMMAND_MODULES``). Every action takes ``--json``; errors a user can cause
raise `explorer.ExplorerError` subclasses, which ``explorer`` prints as one line. ``study
run`` serves the participant page, `apps.study`, loaded with ``importlib``.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path
from typing import Any

from explorer._checks import InputError
from explorer.commands._common import add_serve_options, print_json, served_url, server_sign_in

__all__ = ["register_cli", "parse_accuracy"]


def _add_action_globals(p: argparse.ArgumentParser) -> None:
    """``--json``, ``--debug`` and ``--cache`` after the action too (``explorer study validate X --json``)."""
    p.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="print JSON")
    p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                   help="show the full traceback of an error")
    p.add_argument("--cache", metavar="DIR", default=argparse.SUPPRESS,
                   help="cache folder for this run (sets EXPLORER_CACHE)")


def register_cli(subparsers: Any) -> None:
    """Add ``study`` with its actions ``validate``, ``run``, ``simulate``, ``analyse``, ``export``."""
    p = subparsers.add_parser(
        "study", help="user studies of explanations: validate, run, simulate, analyse, export",
        description="Run small, reproducible user studies of the explorer's explanations with "
                    "baseline and placebo conditions (see docs/studies.md).")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_cmd_study_help)
    actions = p.add_subparsers(dest="study_action", metavar="ACTION")
    positional = {"study": dict(metavar="STUDY", help="study file (.yaml, .yml or .json)"),
                  "dir": dict(metavar="FOLDER", help="run folder")}

    def action(name: str, on: str, func: Any, help: str) -> argparse.ArgumentParser:
        """The subcommand ``name`` on a study file (``on="study"``) or a run folder (``"dir"``)."""
        a = actions.add_parser(name, help=help)
        a.add_argument(on, **positional[on])
        a.set_defaults(func=func)
        return a

    action("validate", "study", _cmd_validate, "check a study file; print its design")

    a = action("run", "study", _cmd_run,
               "prepare a run folder (computes items once), then serve the participant app")
    a.add_argument("--dir", required=True, metavar="FOLDER",
                   help="run folder: created, or reopened if it holds this study file")
    a.add_argument("--model", default=None, metavar="NAME",
                   help="override the study file's model (recorded in the run)")
    a.add_argument("--prepare-only", action="store_true", help="prepare the folder, do not serve")
    add_serve_options(a, port=5007)

    a = action("simulate", "dir", _cmd_simulate, "add simulated participants with known "
               "accuracies (to check the analysis and power; reports flag them)")
    a.add_argument("--accuracy", required=True, metavar="COND=P,...",
                   help="accuracy per condition, e.g. real=0.8,baseline=0.5,placebo=0.5")
    a.add_argument("--n", type=int, default=None, help="participants (default: every free place)")
    a.add_argument("--spread", type=float, default=0.0,
                   help="per-participant offset, uniform in [-spread, spread] (default: 0)")
    a.add_argument("--seed", type=int, default=0, help="simulation seed (default: 0)")

    a = action("analyse", "dir", _cmd_analyse, "accuracy per condition, hypotheses; write the report")
    a.add_argument("--report", metavar="PATH", help="write the report (.md or .html)")

    a = action("export", "dir", _cmd_export, "responses as CSV (participant codes only)")
    a.add_argument("--out", required=True, metavar="PATH", help="CSV file to write")
    a.add_argument("--report", metavar="PATH", help="also write the report (.md or .html)")
    a.add_argument("--force", action="store_true", help="replace existing files")

    for a in actions.choices.values():
        _add_action_globals(a)


def parse_accuracy(text: str) -> dict[str, float]:
    """``"real=0.8,baseline=0.5"`` -> ``{"real": 0.8, "baseline": 0.5}``; InputError otherwise."""
    out: dict[str, float] = {}
    for part in str(text).split(","):
        name, sep, value = part.partition("=")
        name = name.strip()
        try:
            out[name] = float(value)
        except ValueError:
            sep = ""
        if not sep or not name:
            raise InputError(f"`--accuracy` must be COND=P pairs separated by commas, e.g. "
                             f"real=0.8,baseline=0.5; got {part!r}.")
    return out


def _cmd_study_help(args: argparse.Namespace) -> int:
    raise InputError("`study` needs an action: validate, run, simulate, analyse or export.")


def _json(args: argparse.Namespace) -> bool:
    return bool(getattr(args, "json", False))


def _cmd_validate(args: argparse.Namespace) -> int:
    from explorer.studies.schema import load_study

    study = load_study(args.study)
    if _json(args):
        print_json({"valid": True, "path": study.source, "sha256": study.sha256,
                     "study": study.to_dict()})
        return 0
    print(f"{study.source}: valid (sha256 {study.sha256[:16]})")
    print(f"  {study.title}")
    print(f"  task {study.task.kind}, {len(study.prompts)} items, {study.task.n_choices} choices, "
          f"{study.task.attention_checks} attention checks; model {study.model}")
    conds = ", ".join(f"{c.name} ({c.kind}{': ' + c.placebo if c.placebo else ''})"
                      for c in study.conditions)
    print(f"  {study.design}-participant design, {study.participants} participants, seed "
          f"{study.seed}; conditions: {conds}")
    for h in study.hypotheses:
        print(f"  {h.id}: {h.compare[0]} {h.direction} {h.compare[1]} — {h.statement}")
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    from explorer.studies.run import StudyRun

    port, url = served_url(args, "study")
    sign_in, described = server_sign_in(args)     # before any work: a missing sign-in fails now

    def progress(done: int, total: int) -> None:
        if _json(args) or (done < total and not sys.stderr.isatty()):
            return
        print(f"\rcomputing items: {done}/{total}", end="\n" if done == total else "",
              file=sys.stderr, flush=True)

    run = StudyRun.prepare(args.study, args.dir, model=args.model, progress=progress)
    summary = run.summary()
    run.close()
    if args.prepare_only:
        if _json(args):
            print_json(summary)
        else:
            print(f"prepared {summary['folder']}: {summary['n_items']} items on "
                  f"{summary['model']}, {summary['n_slots']} participant places "
                  f"({summary['n_enrolled']} enrolled)")
        return 0
    if _json(args):
        print_json({**summary, "url": url})
    else:
        print(f"serving study {summary['study']} at {url} (Ctrl-C stops; answers are saved "
              f"as they are given)", flush=True)
    sys.stdout.flush()
    if sign_in or args.no_auth:
        print(f"explorer: {described}", file=sys.stderr, flush=True)
    app = importlib.import_module("apps.study")
    app.serve(args.dir, port=port, address=args.address, show=args.show,
              allow_websocket_origin=args.allow_websocket_origin, **sign_in)
    return 0


def _cmd_simulate(args: argparse.Namespace) -> int:
    from explorer.studies.analysis import simulate_participants
    from explorer.studies.run import StudyRun

    accuracy = parse_accuracy(args.accuracy)
    with StudyRun.open(args.dir) as run:
        codes = simulate_participants(run, accuracy, seed=args.seed, n_participants=args.n,
                                      spread=args.spread)
        summary = run.summary()
    if _json(args):
        print_json({"simulated": codes, **summary})
    else:
        print(f"simulated {len(codes)} participants in {summary['folder']} "
              f"({summary['n_enrolled']} of {summary['n_slots']} places now taken)")
    return 0


def _write_report(run: Any, ds: Any, path: str, *, force: bool = True) -> str:
    from explorer.studies.report import study_report

    out = Path(path).expanduser()
    suffix = out.suffix.lower()
    if suffix not in (".md", ".html", ".htm"):
        raise InputError(f"`--report` must end in .md or .html; got {path!r}.")
    if out.exists() and not force:
        raise InputError(f"`--report` {path!r} already exists; pass --force to replace it.")
    text = study_report(run, ds, format="markdown" if suffix == ".md" else "html")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text, encoding="utf-8")
    return str(out)


def _analysis_json(ds: Any) -> dict[str, Any]:
    conditions = {}
    for c in ds["condition"].values:
        s = ds.sel(condition=c)
        conditions[str(c)] = {k: s[k].values.item() for k in
                              ("condition_kind", "accuracy", "accuracy_low", "accuracy_high",
                               "n_responses", "n_participants", "mean_confidence", "median_rt_ms")}
    hypotheses = {}
    for h in ds["hypothesis"].values:
        s = ds.sel(hypothesis=h)
        hypotheses[str(h)] = {k: s[k].values.item() for k in
                              ("statement", "compare_a", "compare_b", "direction", "effect",
                               "effect_low", "effect_high", "cohens_h", "cohens_h_low",
                               "cohens_h_high", "p_value", "p_adjusted", "supported")}
    return {"conditions": conditions, "hypotheses": hypotheses, "attrs": dict(ds.attrs)}


def _cmd_analyse(args: argparse.Namespace) -> int:
    from explorer.studies.analysis import analyse
    from explorer.studies.run import StudyRun

    with StudyRun.open(args.dir) as run:
        ds = analyse(run)
        report = _write_report(run, ds, args.report) if args.report else None
    if _json(args):
        print_json({**_analysis_json(ds), "report": report})
        return 0
    level = int(round(100 * ds.attrs["confidence_level"]))
    print(f"{ds.attrs['study']}: {ds.attrs['n_analysed']} participants analysed "
          f"({ds.attrs['n_excluded']} excluded); chance accuracy {ds.attrs['chance_accuracy']:.3f}")
    for c in ds["condition"].values:
        s = ds.sel(condition=c)
        print(f"  {c:<12} accuracy {float(s.accuracy):.3f}  {level}% CI "
              f"[{float(s.accuracy_low):.3f}, {float(s.accuracy_high):.3f}]  "
              f"n={int(s.n_responses)}")
    for h in ds["hypothesis"].values:
        s = ds.sel(hypothesis=h)
        print(f"  {h}: {s.compare_a.item()} - {s.compare_b.item()} = {float(s.effect):+.3f} "
              f"[{float(s.effect_low):+.3f}, {float(s.effect_high):+.3f}], h={float(s.cohens_h):+.2f}, "
              f"p_adj={float(s.p_adjusted):.4f}: {'supported' if bool(s.supported) else 'not supported'}")
    if report:
        print(f"wrote {report}")
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    from explorer.studies.analysis import analyse
    from explorer.studies.report import export_responses_csv
    from explorer.studies.run import StudyRun

    out = Path(args.out).expanduser()
    if out.exists() and not args.force:
        raise InputError(f"`--out` {args.out!r} already exists; pass --force to replace it.")
    with StudyRun.open(args.dir) as run:
        out.parent.mkdir(parents=True, exist_ok=True)
        text = export_responses_csv(run, out)
        report = None
        if args.report:
            report = _write_report(run, analyse(run), args.report, force=args.force)
    n_rows = text.count("\n") - 1
    if _json(args):
        print_json({"csv": str(out), "rows": n_rows, "report": report})
    else:
        print(f"wrote {out} ({n_rows} responses)" + (f" and {report}" if report else ""))
    return 0
