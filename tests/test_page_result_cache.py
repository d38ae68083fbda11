"""The pages' result cache on disk (`apps._result_cache`): a page opened on inputs a page
computed before shows the stored result without running its job; any other input, model or
code version misses; a damaged entry is recomputed and replaced; the size bound evicts the
entries used longest ago."""
from __future__ import annotations

import logging
import os

import numpy as np
import pytest
import xarray as xr

from apps import _result_cache as rc
from explorer.interventions import Ablate

PROMPT = "The cat sat on the mat"


def _count_calls(monkeypatch, module, names) -> list[str]:
    """Wrap each function ``names`` of ``module`` to record its name when called; the list
    of names in call order."""
    calls = []
    for name in names:
        real = getattr(module, name)

        def counted(*args, _real=real, _name=name, **kw):
            calls.append(_name)
            return _real(*args, **kw)
        monkeypatch.setattr(module, name, counted)
    return calls


def _saturation(model, **params):
    from apps.saturation import SaturationView

    return SaturationView(model, store=None, background=False, compute_on_open=False,
                          prompt=params.pop("prompt", PROMPT), **params)


def _fresh_saturation_layers(model, prompt, edits=()):
    """The token view's computation, called on the library directly."""
    from explorer.analyses.saturation import saturation_layers

    k = min(10, model.vocab_size)
    return saturation_layers(model, [prompt], k=k, rank_cap=min(model.vocab_size, max(50, k)),
                             sample_positions=0, edits=list(edits), progress=False)


def test_saturation_second_page_reads_the_stored_result(cache_on, prompt_calls, tiny_model):
    first = _saturation(tiny_model)
    assert len(prompt_calls) == 1 and first.result_note == ""
    second = _saturation(tiny_model)
    assert len(prompt_calls) == 1                                   # no job ran
    fresh = _fresh_saturation_layers(tiny_model, PROMPT)
    xr.testing.assert_equal(second.prompt_result, fresh)
    assert second.prompt_edited is None
    assert second.shown_record.computed_at == first.shown_record.computed_at
    assert second.shown_record.prompts == (PROMPT,)
    when = first.shown_record.computed_at.replace("T", " ")[:16]
    assert second.result_note == (f"Shown from the result cache (computed {when} UTC on this "
                                  "machine)")
    assert second.stale_note() == ""
    # a new prompt on the page computes, and the note goes with the stored result
    second.prompt = "A different prompt"
    assert len(prompt_calls) == 2 and second.result_note == ""


def test_saturation_edits_are_stored_and_read_with_their_values(cache_on, prompt_calls,
                                                                tiny_model):
    edits = [Ablate(1, 0)]
    _saturation(tiny_model, edits=edits)
    assert len(prompt_calls) == 2                                   # clean and edited
    page = _saturation(tiny_model, edits=edits)
    assert len(prompt_calls) == 2
    xr.testing.assert_equal(page.prompt_edited,
                            _fresh_saturation_layers(tiny_model, PROMPT, edits))
    assert page.prompt_edited.attrs["edits"] == [e.to_dict() for e in edits]
    # the same head in another mode is another edit: a miss
    _saturation(tiny_model, edits=[Ablate(1, 0, mode="mean")])
    assert len(prompt_calls) == 4


@pytest.mark.parametrize("change", ["prompt", "weights", "edits", "model", "version"])
def test_saturation_any_other_input_misses(change, cache_on, prompt_calls, tiny_model, tiny_gpt2,
                                           monkeypatch):
    _saturation(tiny_model)
    assert len(prompt_calls) == 1
    model, params = tiny_model, {}
    if change == "prompt":
        params["prompt"] = PROMPT + "!"
    elif change == "weights":
        params["weights"] = "random-init"
    elif change == "edits":
        params["edits"] = [Ablate(0, 1)]
    elif change == "model":
        model = tiny_gpt2
    else:
        monkeypatch.setattr(rc, "code_version", lambda: "another version")
    page = _saturation(model, **params)
    assert len(prompt_calls) > 1 and page.result_note == ""


def test_cache_off_by_environment(cache_on, prompt_calls, tiny_model, monkeypatch):
    monkeypatch.setenv(rc.ENV_VAR, "off")
    assert rc.result_cache() is None
    _saturation(tiny_model)
    _saturation(tiny_model)
    assert len(prompt_calls) == 2
    assert not cache_on.exists()


def test_size_setting_is_checked(cache_on, monkeypatch):
    monkeypatch.setenv(rc.SIZE_ENV_VAR, "lots")
    with pytest.raises(ValueError, match="EXPLORER_RESULT_CACHE_MB='lots'"):
        rc.result_cache()
    monkeypatch.setenv(rc.SIZE_ENV_VAR, "2")
    assert rc.result_cache().max_bytes == 2 * 2**20


def test_damaged_entry_is_recomputed_and_replaced(cache_on, prompt_calls, tiny_model, caplog):
    _saturation(tiny_model)
    (entry,) = [p for p in cache_on.iterdir() if p.is_dir()]
    (nc,) = entry.glob("*.nc")
    nc.write_bytes(nc.read_bytes()[:100])                           # truncated
    with caplog.at_level(logging.WARNING, logger="apps._result_cache"):
        page = _saturation(tiny_model)
    assert len(prompt_calls) == 2 and page.result_note == ""
    assert any("cannot be read" in r.getMessage() for r in caplog.records)
    xr.testing.assert_equal(page.prompt_result, _fresh_saturation_layers(tiny_model, PROMPT))
    again = _saturation(tiny_model)                                 # the rewritten entry
    assert len(prompt_calls) == 2 and again.result_note.startswith("Shown from the result cache")
    # an entry that is not JSON at all is dropped as well
    (entry.parent / entry.name / "entry.json").write_text("{not json")
    _saturation(tiny_model)
    assert len(prompt_calls) == 3


def _dataset(n: int) -> xr.Dataset:
    return xr.Dataset({"x": ("i", np.arange(n, dtype=np.float64))}, attrs={"n": n, "d": {"a": 1}})


def test_size_bound_evicts_the_entry_used_longest_ago(tmp_path):
    cache = rc.ResultCache(tmp_path, max_bytes=10**9, version="v")
    parts = [{"job": "j", "i": i} for i in range(3)]
    for i, p in enumerate(parts):
        assert cache.put(p, {"ds": _dataset(1000)}, {"i": i}, computed_at="2026-01-01T00:00:00Z")
    sizes = {e.name: size for _, size, e in cache.entries()}
    one = max(sizes.values())
    for i, p in enumerate(parts):                                   # used in order 0, 1, 2
        os.utime(tmp_path / cache.key(p) / "entry.json", (1000 + i, 1000 + i))
    hit = cache.get(parts[0])                                       # 0 is now the newest
    xr.testing.assert_identical(hit.datasets["ds"], _dataset(1000))
    assert hit.values == {"i": 0}
    cache.max_bytes = 3 * one + one // 2                            # room for three
    cache.put({"job": "j", "i": 3}, {"ds": _dataset(1000)}, computed_at="2026-01-01T00:00:00Z")
    left = {e.name for _, _, e in cache.entries()}
    assert cache.key(parts[1]) not in left                          # used longest ago
    assert {cache.key(parts[0]), cache.key(parts[2]),
            cache.key({"job": "j", "i": 3})} == left
    assert cache.get(parts[1]) is None


def test_other_version_is_another_key(tmp_path, tiny_model):
    from apps._provenance import Provenance

    record = Provenance(page="p", model="tiny-llama", prompts=("a",))
    a = rc.ResultCache(tmp_path, version="1").parts("j", record, tiny_model)
    b = rc.ResultCache(tmp_path, version="2").parts("j", record, tiny_model)
    assert rc.ResultCache.key(a) != rc.ResultCache.key(b)
    # the time a record was computed is no input
    later = Provenance(page="p", model="tiny-llama", prompts=("a",), computed_at="2030")
    assert a == rc.ResultCache(tmp_path, version="1").parts("j", later, tiny_model)


# -- Knowledge conflicts -----------------------------------------------------------------------

@pytest.fixture
def conflict_calls(monkeypatch):
    """Counts the Knowledge conflicts page's model runs: head scores and run 1."""
    from explorer.analyses import conflicts as C

    return _count_calls(monkeypatch, C, ("head_context_memory_scores", "juice_first_run"))


def _conflicts(model, **params):
    from apps.conflicts import ConflictsView

    return ConflictsView(model, background=False, **params)


def test_conflicts_second_page_reads_scores_and_bars(cache_on, conflict_calls, tiny_model,
                                                     monkeypatch):
    first = _conflicts(tiny_model)
    assert conflict_calls == ["head_context_memory_scores", "juice_first_run"]
    second = _conflicts(tiny_model)
    assert len(conflict_calls) == 2                                 # nothing ran
    xr.testing.assert_equal(second.scores, first.scores)
    assert second.bar_rows == first.bar_rows
    assert second.shown.computed_at == first.shown.computed_at
    assert second.result_note.startswith("Shown from the result cache (computed ")
    assert second.stale_note() == ""
    # new heads: run 1 is made once, and the bars equal those of a page without the cache
    head = second.param.heads_plus.objects[1]
    second.heads_plus = [head]
    assert conflict_calls[2:] == ["juice_first_run"] and second.result_note == ""
    monkeypatch.setenv(rc.ENV_VAR, "off")
    plain = _conflicts(tiny_model, heads_plus=[head])
    assert second.bar_rows == plain.bar_rows
    assert second.bar_rows != first.bar_rows


def test_conflicts_other_inputs_miss(cache_on, conflict_calls, tiny_model):
    _conflicts(tiny_model)
    page = _conflicts(tiny_model, kind="coherent")
    assert conflict_calls[2:] == ["head_context_memory_scores", "juice_first_run"]
    page = _conflicts(tiny_model, edits=[Ablate(0, 1)])
    # the scores are the unedited model's (stored); the bars' run 1 with the edits runs
    assert conflict_calls[4:] == ["juice_first_run", "juice_first_run"]
    assert page.edited_rows is not None and page.result_note == ""
    again = _conflicts(tiny_model, edits=[Ablate(0, 1)])
    assert len(conflict_calls) == 6 and again.edited_rows == page.edited_rows


# -- ICL heads -------------------------------------------------------------------------------

@pytest.fixture
def icl_calls(monkeypatch):
    """Counts the ICL heads page's head scoring runs (induction and FV scores)."""
    from explorer.analyses import icl_heads as ih

    return _count_calls(monkeypatch, ih, ("induction_scores", "fv_scores"))


def _icl(model, **params):
    from apps.icl_heads import ICLHeadsView

    params.setdefault("n_prompts", 2)
    return ICLHeadsView(model, background=False, n_shots=2, **params)


def test_icl_scores_open_from_the_cache(cache_on, icl_calls, tiny_model):
    first = _icl(tiny_model, compute_on_open=True)
    assert icl_calls == ["induction_scores", "fv_scores"]
    # a page that would wait for the button shows the stored scores as it opens
    second = _icl(tiny_model, compute_on_open=False)
    assert len(icl_calls) == 2
    xr.testing.assert_identical(second.scores, first.scores)
    assert second.shown_provenance() == first.shown_provenance()
    assert second._scores_note.startswith("Shown from the result cache (computed ")
    # pressing Compute with the scores stored runs no scoring either
    second._compute()
    assert len(icl_calls) == 2
    # other inputs miss: the FV prompts, the induction settings, the edits
    assert _icl(tiny_model, compute_on_open=False, n_prompts=3).scores is None
    assert _icl(tiny_model, compute_on_open=False, induction_sequences=3).scores is None
    edited = _icl(tiny_model, compute_on_open=True, edits=[Ablate(0, 1)])
    assert icl_calls[2:] == ["induction_scores", "fv_scores"] and edited._scores_note == ""
    assert not np.array_equal(edited.scores.induction_score.values,
                              first.scores.induction_score.values)


def test_saturation_cuts_the_shipped_corpus_once_per_process(tiny_model, monkeypatch):
    """Every page open looks the corpus result up by its prompts: the shipped corpus is cut
    once per model and size, and the prompts equal a direct cut."""
    from apps import saturation as S
    from explorer.analyses import saturation as sat

    monkeypatch.setattr(S, "_SHIPPED_CHUNKS", S.BoundedCache(max_items=8))
    cuts = _count_calls(monkeypatch, sat, ("corpus_chunks",))
    first, second = _saturation(tiny_model), _saturation(tiny_model)
    chunks = first.texts()
    assert len(cuts) == 1
    assert second.texts() == chunks and first.texts() == chunks
    assert len(cuts) == 1                                         # no second cut
    monkeypatch.undo()
    assert second.texts() == sat.corpus_chunks(tiny_model, sat.load_corpus(),
                                               max_tokens=second.n_tokens)
    # another size is another cut; texts of the page's own are cut each time
    cuts = _count_calls(monkeypatch, sat, ("corpus_chunks",))
    second.n_tokens = second.n_tokens // 2
    second.texts()
    own = _saturation(tiny_model, texts=["A text of its own. It has two sentences."])
    own.texts()
    own.texts()
    assert len(cuts) == 3
