"""Browser test of the study app: a full participant run in headless chromium (consent,
instructions, every item, a closed tab and a resume by code, done), then the rows in SQLite."""
from __future__ import annotations

import json
import re
import sqlite3
from pathlib import Path

import pytest
from _browser import free_port, served_in_subprocess

from apps.theme import show_token
from explorer.benches.serve import CHROMIUM, CHROMIUM_ARGS
from explorer.studies.randomise import ATTENTION_CONDITION
from explorer.studies.run import StudyRun

pytestmark = pytest.mark.browser

REPO_ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = REPO_ROOT / "test-artifacts"   # gitignored screenshots for a look by eye
STUDY = {
    "name": "browser-study", "title": "Browser study", "model": "tiny-llama", "seed": 3,
    "design": "within", "participants": 3,
    "task": {"kind": "predict_next_token", "n_choices": 3, "attention_checks": 1},
    "items": {"prompts": ["The capital of France is", "Water boils at one hundred",
                          "She said that he would"]},
    "explanation": {"kind": "logit_lens", "k": 2},
    "conditions": [{"name": "real", "kind": "real"}, {"name": "none", "kind": "baseline"},
                   {"name": "fake", "kind": "placebo", "placebo": "mismatched_example"}],
    "hypotheses": [{"id": "H1", "statement": "real beats none", "compare": ["real", "none"]}],
    "consent": "Please read this consent text.", "instructions": "Pick the model's next token.",
}


@pytest.fixture
def served_run(tmp_path, tiny_model):
    if not Path(CHROMIUM).exists():
        pytest.skip("Debian chromium is not installed at /usr/bin/chromium")
    study_path = tmp_path / "study.json"
    study_path.write_text(json.dumps(STUDY), encoding="utf-8")
    folder = tmp_path / "run"
    StudyRun.prepare(study_path, folder, model=tiny_model).close()
    port = free_port()
    with served_in_subprocess(["-m", "apps.study", str(folder), str(port)], port,
                              tmp_path / "server.log", timeout=90,
                              env={"PYTHONPATH": str(REPO_ROOT)}) as url:
        yield folder, f"{url}/study"


def _answer(page, run, trial, index, n, plan):
    """Answer the trial on screen after checking it is the scheduled one; record the plan."""
    page.get_by_text(f"Question {index + 1} of {n}", exact=True).wait_for(timeout=30_000)
    shown = run.trial_display(trial)
    item = run.items[trial.item_id]
    if shown["prompt"]:
        page.get_by_text(shown["prompt"], exact=False).first.wait_for(timeout=10_000)
    lens_title = page.get_by_text("What the model's layers lean towards")
    assert lens_title.count() == (0 if shown["explanation"] is None else 1)
    correct = index % 2 == 0                     # right on even trials, wrong on odd ones
    choice = item["answer"] if correct else (item["answer"] + 1) % len(item["choices"])
    confidence = 1 + index % 5
    # a token may read like a confidence label ("3"): choices come first on the page
    page.get_by_role("button", name=show_token(item["choices"][choice]), exact=True).first.click()
    label = {1: "1 (a guess)", 5: "5 (certain)"}.get(confidence, str(confidence))
    page.get_by_role("button", name=label, exact=True).last.click()
    page.get_by_role("button", name="Submit answer").click()
    plan[trial.index] = (trial, choice, int(correct), confidence)


def test_full_participant_run_with_resume(served_run):
    from playwright.sync_api import sync_playwright

    folder, url = served_run
    run = StudyRun.open(folder)
    plan: dict[int, tuple] = {}
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            page.goto(url)
            page.get_by_text("Please read this consent text.").wait_for(timeout=60_000)
            start = page.get_by_role("button", name="Start the study")
            assert start.is_disabled()                   # no start before consent
            page.get_by_role("checkbox").check()
            start.click()
            alert = page.get_by_text("Your participant code is")
            alert.wait_for(timeout=30_000)
            code = re.search(r"code is (\S+?)\.", alert.inner_text()).group(1)
            trials = run.store.trials(code)
            n = len(trials)
            assert n == 4 and sum(t.condition == ATTENTION_CONDITION for t in trials) == 1
            page.get_by_role("button", name="Begin").click()
            page.get_by_text(f"Question 1 of {n}", exact=True).wait_for(timeout=30_000)
            ARTIFACTS.mkdir(exist_ok=True)
            page.screenshot(path=str(ARTIFACTS / "study-item.png"), full_page=True)
            for i in range(2):
                _answer(page, run, trials[i], i, n, plan)
            page.get_by_text(f"Question 3 of {n}", exact=True).wait_for(timeout=30_000)
            page.close()                                 # the tab is closed mid-study

            page = browser.new_page()                    # ... and the participant comes back
            page.goto(f"{url}?code={code}")
            page.get_by_role("button", name="Resume").wait_for(timeout=60_000)
            assert page.get_by_role("textbox").input_value() == code
            page.get_by_role("button", name="Resume").click()
            for i in range(2, n):
                _answer(page, run, trials[i], i, n, plan)
            page.get_by_text("Thank you!").wait_for(timeout=30_000)
            assert code in page.get_by_text("Your participant code").inner_text()

            other = browser.new_context().new_page()     # a second participant sees only their own
            other.goto(url)
            other.get_by_role("checkbox").check()
            other.get_by_role("button", name="Start the study").click()
            other_alert = other.get_by_text("Your participant code is")
            other_alert.wait_for(timeout=30_000)
            other_code = re.search(r"code is (\S+?)\.", other_alert.inner_text()).group(1)
            other.get_by_role("button", name="Begin").click()
            other.get_by_text(f"Question 1 of {n}", exact=True).wait_for(timeout=30_000)
            assert other_code != code
        finally:
            browser.close()
    run.close()

    with sqlite3.connect(folder / "responses.sqlite") as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        parts = conn.execute("SELECT code, slot, finished_at FROM participants ORDER BY slot").fetchall()
        rows = conn.execute("SELECT trial_index, item_id, condition, choice, correct, confidence, "
                            "rt_ms FROM responses WHERE code = ? ORDER BY trial_index", (code,)).fetchall()
        others = conn.execute("SELECT COUNT(*) FROM responses WHERE code = ?", (other_code,)).fetchone()[0]
    assert [(c, s) for c, s, _ in parts] == [(code, 0), (other_code, 1)]   # the resume enrolled no one new
    assert parts[0][2] is not None and parts[1][2] is None
    assert others == 0
    assert [r[0] for r in rows] == list(range(n))    # every answer once, none lost across the closed tab
    for trial_index, item_id, condition, choice, correct, confidence, rt_ms in rows:
        trial, planned_choice, planned_correct, planned_confidence = plan[trial_index]
        assert (item_id, condition) == (trial.item_id, trial.condition)
        assert (choice, correct, confidence) == (planned_choice, planned_correct, planned_confidence)
        assert rt_ms > 0
