"""A study run: one folder holding the study file, its precomputed items and the responses.

``StudyRun.prepare`` runs the model once, stores every item and explanation
(``items.json``), the exact study file, and creates the response database with the
schedule; ``StudyRun.open`` gives the app, the analysis and the export everything they need
without a model. Preparing an existing folder again reopens it if it holds the same study
file and refuses if the file has changed, so a pre-registered run cannot drift.

Layout::

    RUN/
      study.yaml (or .json)   the study file, byte for byte
      items.json              items, explanations per condition, model, versions, seeds
      responses.sqlite        schedule, answer key, participants, responses (WAL mode)
"""
from __future__ import annotations

import datetime as dt
import hashlib
import importlib.metadata
import json
import os
import platform
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from explorer._checks import InputError, StoreError

from .items import build_items
from .randomise import ATTENTION_CONDITION, Trial, study_schedule
from .responses import ResponseStore
from .schema import Study, load_study

__all__ = ["StudyRun", "software_versions", "ITEMS_FILE", "DB_FILE"]

ITEMS_FILE = "items.json"
DB_FILE = "responses.sqlite"
_STUDY_STEM = "study"
_PACKAGES = ("explorer", "numpy", "scipy", "xarray", "torch", "transformers", "nnsight",
             "tokenizers", "panel", "bokeh", "holoviews", "pyyaml")


def software_versions() -> dict[str, str]:
    """Versions of Python and of the packages a study run depends on (from package metadata)."""
    out = {"python": platform.python_version(), "platform": platform.platform(terse=True)}
    for name in _PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


class StudyRun:
    """The folder of one run of a study: study, items, response store.

    Build with `StudyRun.prepare` (runs the model) or `StudyRun.open` (no model).

    Attributes
    ----------
    folder : Path
    study : Study
    items : dict of str to dict
        By item id, as computed by `explorer.studies.items.build_items`.
    info : dict
        ``items.json`` without the items: model provenance, versions, seeds, creation time.
    store : ResponseStore
    """

    def __init__(self, folder: Path, study: Study, items: dict[str, dict[str, Any]],
                 info: dict[str, Any], store: ResponseStore):
        self.folder, self.study, self.items, self.info, self.store = folder, study, items, info, store

    def __repr__(self) -> str:
        return f"StudyRun({str(self.folder)!r}, study={self.study.name!r}, items={len(self.items)})"

    # -- building ------------------------------------------------------------------------
    @classmethod
    def prepare(cls, study_path: str | Path, folder: str | Path, *, model: Any = None,
                progress: Callable[[int, int], None] | None = None) -> StudyRun:
        """Compute the items of a study once and create its run folder.

        Parameters
        ----------
        study_path : str or Path
            The study file (validated first).
        folder : str or Path
            The run folder: created, or reopened if it holds a run of the same study file.
        model : str or explorer.Model, optional
            Overrides the study's ``model`` (recorded in the run); default the study's.
        progress : callable(done, total), optional

        Returns
        -------
        StudyRun
        """
        study = load_study(study_path)
        folder = Path(folder).expanduser()
        if (folder / ITEMS_FILE).exists():
            run = cls.open(folder)
            if run.study.sha256 != study.sha256:
                run.close()
                raise InputError(f"`folder` {str(folder)!r} holds a run of another version of "
                                 f"the study (sha256 {run.study.sha256[:12]}, this file "
                                 f"{study.sha256[:12]}); choose a new folder.")
            wanted = model if isinstance(model, str) or model is None else model.spec.name
            if wanted is not None and wanted != run.info["model"]["name"]:
                run.close()
                raise InputError(f"`folder` {str(folder)!r} holds a run on model "
                                 f"{run.info['model']['name']!r}; got model {wanted!r}.")
            return run
        if folder.exists() and any(folder.iterdir()):
            raise InputError(f"`folder` {str(folder)!r} exists and is not a prepared study run "
                             "(or its preparation was interrupted); give a new folder or empty it.")
        if model is None or isinstance(model, str):
            from explorer.models import load_model

            model = load_model(model or study.model)
        items = build_items(study, model, progress=progress)
        info = {
            "study": {"name": study.name, "title": study.title, "sha256": study.sha256,
                      "file": Path(study.source).name},
            "model": model.spec.provenance(),
            "model_requested": study.model,
            "versions": software_versions(),
            "seeds": {"randomisation": study.seed, "analysis": study.analysis.seed},
            "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        }
        folder.mkdir(parents=True, exist_ok=True)
        suffix = Path(study.source).suffix.lower()
        shutil.copyfile(study.source, folder / f"{_STUDY_STEM}{suffix}")
        schedule = study_schedule(study)
        meta = {"study_name": study.name, "study_sha256": study.sha256, "seed": study.seed,
                "design": study.design, "conditions": list(study.condition_names)}
        ResponseStore.create(folder / DB_FILE, schedule=schedule, items=items, meta=meta).close()
        _write_json_atomic(folder / ITEMS_FILE, {**info, "items": items})  # last: marks the run ready
        return cls.open(folder)

    @classmethod
    def open(cls, folder: str | Path) -> StudyRun:
        """Open a prepared run folder (no model needed).

        Raises
        ------
        InputError
            The folder is not a prepared study run, or its study file changed since.
        """
        folder = Path(folder).expanduser()
        items_path = folder / ITEMS_FILE
        if not items_path.exists():
            raise InputError(f"`folder` {str(folder)!r} is not a prepared study run (no "
                             f"{ITEMS_FILE}); run 'explorer study run STUDY --dir {folder}' first.")
        studies = sorted(p for p in folder.glob(f"{_STUDY_STEM}.*")
                         if p.suffix.lower() in (".yaml", ".yml", ".json"))
        if len(studies) != 1:
            raise InputError(f"`folder` {str(folder)!r} must hold one study file "
                             f"({_STUDY_STEM}.yaml or .json); found {len(studies)}.")
        study = load_study(studies[0])
        try:
            data = json.loads(items_path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as err:
            raise StoreError(f"cannot read {str(items_path)!r} ({err}).") from None
        if data["study"]["sha256"] != study.sha256:
            raise InputError(f"{str(studies[0])!r} was edited after the run was prepared "
                             f"(sha256 {study.sha256[:12]}, run {data['study']['sha256'][:12]}); "
                             "restore it or prepare a new run.")
        items = {it["id"]: it for it in data.pop("items")}
        store = ResponseStore(folder / DB_FILE)
        if store.meta().get("study_sha256") != study.sha256:
            store.close()
            raise StoreError(f"{str(folder / DB_FILE)!r} belongs to another study run.")
        return cls(folder, study, items, data, store)

    def close(self) -> None:
        self.store.close()

    def __enter__(self) -> StudyRun:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- what a participant sees ------------------------------------------------------------
    def trial_display(self, trial: Trial) -> dict[str, Any]:
        """What the participant is shown for ``trial``: never the answer, the condition
        name, the other conditions' explanations, or how a placebo was made.

        Returns
        -------
        dict
            ``item_id``, ``prompt``, ``prompt_tokens``, ``context``, ``question``,
            ``choices``, ``attention_check`` and ``explanation`` (None for a baseline).
        """
        item = self.items[trial.item_id]
        explanation = None
        if trial.condition != ATTENTION_CONDITION:
            real = item["explanations"].get(trial.condition)
            if real is not None:
                explanation = {k: v for k, v in real.items() if k not in ("placebo", "source_item")}
        return {"item_id": item["id"], "prompt": item["prompt"],
                "prompt_tokens": list(item["prompt_tokens"]), "context": item.get("context", ""),
                "question": item["question"], "choices": list(item["choices"]),
                "attention_check": bool(item["attention_check"]), "explanation": explanation}

    def summary(self) -> dict[str, Any]:
        """A JSON-able summary: study, model, counts of items, slots, participants, responses."""
        parts = self.store.participants()
        return {
            "folder": str(self.folder), "study": self.study.name, "title": self.study.title,
            "sha256": self.study.sha256, "model": self.info["model"]["name"],
            "design": self.study.design, "conditions": list(self.study.condition_names),
            "n_items": sum(not it["attention_check"] for it in self.items.values()),
            "n_attention_checks": sum(bool(it["attention_check"]) for it in self.items.values()),
            "n_slots": self.store.n_slots, "n_enrolled": len(parts),
            "n_finished": sum(p.finished_at is not None for p in parts),
            "n_responses": len(self.store.responses()),
            "seeds": self.info["seeds"],
        }


def _write_json_atomic(path: Path, data: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{hashlib.sha1(os.urandom(8)).hexdigest()[:8]}")
    try:
        tmp.write_text(json.dumps(data, indent=1, ensure_ascii=False), encoding="utf-8")
        os.replace(tmp, path)
    except OSError as err:
        raise StoreError(f"could not write {str(path)!r} ({err.strerror or err}).") from None
    finally:
        tmp.unlink(missing_ok=True)
