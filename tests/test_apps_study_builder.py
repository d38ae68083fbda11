"""The User study page in the gallery: a study built from a page's explanation, participants
answering through the participant app's own buttons, and the analysis pane checked against a
bootstrap and an exact permutation test computed here from the raw database rows."""
from __future__ import annotations

import itertools
import re
import sqlite3

import numpy as np
import pytest

from apps.study_builder import DEFAULT_ITEMS as DEFAULT

@pytest.fixture
def gallery(tiny_model, tmp_path, monkeypatch, notes):
    from apps.gallery import VIEWS, Gallery

    monkeypatch.setenv("EXPLORER_STUDIES", str(tmp_path))
    views = [v for v in VIEWS if v[1] in ("lens", "dla", "study")]
    g = Gallery("tiny-llama", views=views, view="lens")
    yield g
    g.close()


def _answer_all(run, *, seed: int, reliance: float) -> str:
    """One participant through the participant app's buttons: consent, begin, then per item
    a choice read from what the page shows (`reader_choice`), a confidence and Submit."""
    from apps.study import StudySession
    from explorer.studies.readers import reader_choice

    rng = np.random.default_rng(seed)
    s = StudySession(run.folder)
    try:
        s._agree.value = True
        s._start.clicks += 1
        assert s.stage == "instructions"
        s._begin.clicks += 1
        while s.stage == "item":
            display = run.trial_display(s._trial)
            s._choice_buttons[reader_choice(display, rng, reliance=reliance)].clicks += 1
            s._confidence_buttons[int(rng.integers(5))].clicks += 1
            s._submit.clicks += 1
        assert s.stage == "done"
        return s.code
    finally:
        s.close()


def _db_table(folder, analysed_codes=None):
    """Hits and counts [participant, condition] read straight from the SQLite file."""
    with sqlite3.connect(folder / "responses.sqlite") as conn:
        rows = conn.execute("SELECT code, condition, correct FROM responses "
                            "WHERE condition != 'attention_check'").fetchall()
    codes = sorted({r[0] for r in rows})
    conds = ["explanation", "none", "placebo"]
    hits = np.zeros((len(codes), 3))
    counts = np.zeros((len(codes), 3))
    for code, cond, correct in rows:
        hits[codes.index(code), conds.index(cond)] += correct
        counts[codes.index(code), conds.index(cond)] += 1
    return codes, hits, counts


def test_a_study_from_the_lens_page_follows_its_setting_and_keeps_placebos_the_same_length(gallery):
    lens = gallery.page("lens")
    lens.k = 4
    page = gallery.page("study")
    assert page.source_settings() == {"k": 4}
    page.build()
    page.wait()
    assert page.error == "", page.error
    run = page.run
    n_layers = gallery.model.n_layers
    items = [it for it in run.items.values() if not it["attention_check"]]
    assert [it["prompt"] for it in items][0] == gallery.prompt     # the sidebar prompt first
    assert len(items) == 12
    for it in items:
        real, placebo = it["explanations"]["explanation"], it["explanations"]["placebo"]
        assert it["explanations"]["none"] is None
        assert real["layers"] == list(range(n_layers - 1))          # never the answer's layer
        assert all(len(row) == 4 for row in real["tokens"])          # the lens page's top-k
        # the placebo: the same form and length, but the lens of another item's prompt
        assert len(placebo["tokens"]) == len(real["tokens"])
        assert all(len(row) == 4 for row in placebo["tokens"])
        other = items[placebo["source_item"]]
        assert other["id"] != it["id"]
        assert placebo["tokens"] == other["explanations"]["explanation"]["tokens"]
    # the preview shows item 1 under the three conditions
    assert "No explanation" in page._preview[1].objects[1].object


def test_a_study_from_the_attribution_page_moves_the_same_scores_to_random_heads(gallery):
    page = gallery.page("study")
    page.param.update(source="dla", placebo=True, baseline=False, participants=4,
                      items="\n".join(["One, two, three,", "Monday, Tuesday,",
                                       "Roses are red, violets are"]))
    page.build()
    page.wait()
    assert page.error == "", page.error
    run = page.run
    assert run.study.condition_names == ("explanation", "placebo")
    assert [h.id for h in run.study.hypotheses] == ["H2"]
    item = run.items["item-001"]
    real, placebo = item["explanations"]["explanation"], item["explanations"]["placebo"]
    assert real["kind"] == placebo["kind"] == "head_attribution"
    assert np.shape(placebo["scores"]) == np.shape(real["scores"])
    assert sorted(np.ravel(placebo["scores"])) == sorted(np.ravel(real["scores"]))


def test_bad_settings_are_refused_with_the_setting_named(gallery, notes):
    page = gallery.page("study")
    page.param.update(baseline=False, placebo=False)
    page.build()
    assert "choose a baseline, a placebo or both" in page.error and page.run is None
    page.param.update(baseline=True, placebo=True, participants=31)
    page.build()
    assert "`participants` must be a multiple of the number of conditions (3)" in page.error
    assert "got 31" in page.error and page.run is None


def test_answers_from_the_participant_app_update_the_analysis_pane(gallery):
    from apps.study_builder import open_runs

    page = gallery.page("study")
    page.participants = 6
    page.build()
    page.wait()
    run = page.run
    link = page.open_to_participants()
    key = link.rsplit("run=", 1)[1]
    assert link.startswith("http://127.0.0.1:5006/study?run=") and len(key) >= 20
    assert open_runs.folder(key) == run.folder
    assert "n = 0" in page._analysis_pane.object

    codes = [_answer_all(run, seed=i, reliance=0.9) for i in range(3)]
    page._check_answers()                          # what the served page's poll calls
    assert page.n_answers == 3 * 13
    assert "<b>n = 3</b>" in page._analysis_pane.object
    codes += [_answer_all(run, seed=i, reliance=0.9) for i in range(3, 6)]
    page._check_answers()
    pane = page._analysis_pane.object
    assert "<b>n = 6</b> participants analysed (6 enrolled, 6 finished" in pane

    # accuracy and its interval, from the database rows: a percentile bootstrap over
    # participants with the analysis plan's seed stream (multinomial counts per participant)
    db_codes, hits, counts = _db_table(run.folder)
    assert db_codes == sorted(codes)
    plan = run.study.analysis
    rng = np.random.default_rng(np.random.SeedSequence([plan.seed, 101]))
    n = len(db_codes)
    weights = rng.multinomial(n, np.full(n, 1 / n), size=plan.bootstrap)
    boot = (weights @ hits) / (weights @ counts)
    low, high = np.quantile(boot[:, 0], [0.025, 0.975])
    accuracy = hits[:, 0].sum() / counts[:, 0].sum()
    ds = page.analysis
    assert ds["accuracy"].sel(condition="explanation").item() == pytest.approx(accuracy)
    assert ds["accuracy_low"].sel(condition="explanation").item() == pytest.approx(low)
    assert ds["accuracy_high"].sel(condition="explanation").item() == pytest.approx(high)
    row = re.search(r"<td>explanation</td><td>real</td><td class='num'>6</td>"
                    r"<td class='num'>(\d+)</td><td class='num'>([\d.]+)</td>"
                    r"<td class='num'>\[([\d.]+), ([\d.]+)\]</td>", pane)
    assert row is not None, pane
    assert int(row.group(1)) == counts[:, 0].sum()
    assert [float(x) for x in row.groups()[1:]] == [round(accuracy, 2), round(low, 2),
                                                    round(high, 2)]

    # the permutation p-values against the exact test (all 2^6 label swaps within
    # participants), and Holm's correction over the two hypotheses
    def exact_p(a, b):
        def diff(h, c):
            return h[:, 0].sum() / c[:, 0].sum() - h[:, 1].sum() / c[:, 1].sum()
        h2, c2 = hits[:, [a, b]], counts[:, [a, b]]
        observed = diff(h2, c2)
        null = []
        for flips in itertools.product([False, True], repeat=n):
            f = np.array(flips)[:, None]
            null.append(diff(np.where(f, h2[:, ::-1], h2), np.where(f, c2[:, ::-1], c2)))
        return np.mean(np.array(null) >= observed - 1e-12)

    p = np.array([exact_p(0, 1), exact_p(0, 2)])
    mc = ds["p_value"].values
    se = np.sqrt(p * (1 - p) / plan.permutations)
    assert np.all(np.abs(mc - p) <= 4 * se + 2 / plan.permutations), (mc, p)
    order = np.argsort(mc)
    holm = np.empty(2)
    holm[order[0]] = min(1, 2 * mc[order[0]])
    holm[order[1]] = min(1, max(holm[order[0]], mc[order[1]]))
    np.testing.assert_allclose(ds["p_adjusted"].values, holm)
    assert f"{ds['p_adjusted'].values[0]:.4f}" in pane

    # the plot draws the same interval, and its title the same n
    import holoviews as hv

    overlay = page._plot.object
    bars = next(el for el in overlay if isinstance(el, hv.ErrorBars)).data.set_index("condition")
    assert bars.loc["explanation", "accuracy"] - bars.loc["explanation", "below"] == pytest.approx(low)
    assert bars.loc["explanation", "accuracy"] + bars.loc["explanation", "above"] == pytest.approx(high)
    assert overlay.opts.get().kwargs["title"].endswith("n = 6")


def test_the_link_key_and_participant_codes_stay_out_of_exports(gallery):
    import io
    import zipfile

    from apps.study_builder import open_runs

    page = gallery.page("study")
    page.participants = 3
    page.build()
    page.wait()
    key = page.open_to_participants().rsplit("run=", 1)[1]
    code = _answer_all(page.run, seed=0, reliance=1.0)
    page.refresh_analysis()
    gallery.view = "study"
    data = gallery.export_page_data("study")
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        names = zf.namelist()
        text = "".join(zf.read(n).decode("utf-8", "replace") for n in names)
    assert "conditions.csv" in names and "hypotheses.csv" in names
    assert key not in text and code not in text
    assert key not in gallery.page_code("study")
    page.close_to_participants()
    assert open_runs.folder(key) is None and page._link.value == ""


def test_a_closed_or_wrong_link_shows_that_the_study_is_not_open():
    from apps.study_builder import participant_page

    page = participant_page()
    text = " ".join(str(getattr(o, "object", "")) for o in page.main)
    assert "This study is not open" in text


def test_a_reader_follows_the_deepest_layer_that_names_a_choice_and_the_largest_head():
    from explorer.studies.readers import explanation_pick, reader_choice

    lens = {"kind": "logit_lens", "layers": [0, 1, 2],
            "tokens": [["a", "b"], ["x", "c"], ["y", "z"]],
            "probs": [[0.9, 0.1], [0.6, 0.3], [0.5, 0.5]]}
    display = {"choices": ["a", "b", "c", "d"], "explanation": lens, "attention_check": False,
               "question": "?"}
    assert explanation_pick(display) == 2          # layer 2 names no choice; layer 1 names 'c'
    lens["tokens"][2] = ["b", "a"]
    lens["probs"][2] = [0.4, 0.4]
    assert explanation_pick(display) == 0          # a tie in probability: the first choice
    heads = {"kind": "head_attribution", "scores": [[0.1, -2.0], [0.7, 0.3]], "top": 1,
             "n_layers": 2, "n_heads": 2}
    shown = {"choices": ["L0 H1", "L1 H1", "L1 H0"], "explanation": heads,
             "attention_check": False, "question": "?"}
    assert explanation_pick(shown) == 2            # L1 H0 has the largest direct effect
    assert explanation_pick({**shown, "explanation": None}) is None
    rng = np.random.default_rng(0)
    assert all(reader_choice(shown, rng, reliance=1.0) == 2 for _ in range(20))
    guesses = [reader_choice(shown, rng, reliance=0.0) for _ in range(3000)]
    assert np.allclose(np.bincount(guesses, minlength=3) / 3000, 1 / 3, atol=0.04)
    check = {"choices": ["red", "blue"], "explanation": None, "attention_check": True,
             "question": "Attention check: to show that you are reading carefully, choose "
                         "the option 'blue'."}
    assert reader_choice(check, rng, reliance=0.0) == 1
    with pytest.raises(ValueError, match="`reliance` must be"):
        reader_choice(shown, rng, reliance=1.5)


@pytest.mark.slow
def test_the_participants_route_is_behind_the_servers_sign_in(tmp_path):
    """`explorer serve` with a password: /study asks for the sign-in like every other page,
    a signed-in browser is served it, and the server's log holds neither the password nor
    the key in the link."""
    import urllib.error
    import urllib.parse
    import urllib.request

    from _browser import free_port, served_in_subprocess

    class NoRedirect(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, *args, **kwargs):
            return None

    def get(url, data=None, cookie=""):
        request = urllib.request.Request(url, data=data, headers={"Cookie": cookie} if cookie else {})
        try:
            with urllib.request.build_opener(NoRedirect).open(request, timeout=60) as r:
                return r.status, r.headers, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.headers, e.read()

    secret, key = "correct horse battery", "not-a-study-key-123"
    port = free_port()
    log = tmp_path / "serve.log"
    with served_in_subprocess(["-m", "explorer.cli", "serve", "--model", "tiny-llama",
                               "--port", str(port)], port, log, timeout=180,
                              env={"EXPLORER_PASSWORD": secret,
                                   "EXPLORER_STUDIES": str(tmp_path / "studies")}) as url:
        status, headers, _ = get(f"{url}/study?run={key}")
        assert status == 302 and "/login" in headers["Location"]
        status, headers, _ = get(f"{url}/login", data=urllib.parse.urlencode(
            {"username": "researcher", "password": secret}).encode())
        cookies = "; ".join(c.split(";")[0] for c in headers.get_all("Set-Cookie") or [])
        assert status == 302 and "user=" in cookies
        status, _, body = get(f"{url}/study?run={key}", cookie=cookies)
        assert status == 200 and b"bokeh" in body.lower()
    text = log.read_text()
    assert secret not in text and key not in text


def test_the_pages_code_prepares_the_same_items(gallery, tmp_path, monkeypatch):
    """*Copy page as code*: the snippet, run on its own, writes the study file the page wrote
    and prepares a run whose items (prompts, choices, answers, explanations) equal the page's."""
    page = gallery.page("study")
    page.param.update(participants=3, items="\n".join(DEFAULT[:5]))
    page.build()
    page.wait()
    code = gallery.page_code("study")
    folder = tmp_path / "snippet"
    folder.mkdir()
    monkeypatch.chdir(folder)
    scope: dict = {}
    exec(compile(code, "page_code.py", "exec"), scope)
    run = scope["run"]
    try:
        assert run.study.sha256 != "" and run.study.to_dict() == page.run.study.to_dict()
        assert run.items == page.run.items
        assert int(scope["ds"].attrs["n_analysed"]) == 0
    finally:
        run.close()
