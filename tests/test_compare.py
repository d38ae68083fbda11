"""Two prompts side by side: the workspace's second prompt (state file, link, sidebar) and the
Two prompts page's results, checked against each prompt run alone (tiny-llama, in-process)."""
from __future__ import annotations

import base64
import json
import zlib

import pytest

from explorer._checks import InputError
from explorer.workspace import MAX_PROMPT_CHARS, Workspace, read_link, workspace_link
from tests._hooks import hf_attentions

pytestmark = pytest.mark.usefixtures("one_torch_thread")

A = "When Mary and John went to the store, John gave a drink to"
B = "When Mary and John went to the store, Mary gave a drink to"


def _ws(**kw):
    return Workspace(model_name="tiny-llama", n_layers=3, n_heads=4, **kw)


def _link_data(text: str) -> dict:
    body = text.split(".", 1)[1]
    return json.loads(zlib.decompress(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))))


# -- the workspace's second prompt -----------------------------------------------------------

def test_second_prompt_is_empty_by_default_and_travels_in_the_state_file():
    ws = _ws(prompts=[A])
    assert ws.second_prompt == ""
    assert json.loads(ws.to_json())["second_prompt"] == ""
    ws.second_prompt = B
    state = json.loads(ws.to_json())
    assert state["prompts"] == [A] and state["second_prompt"] == B
    back = Workspace.from_json(ws.to_json())
    assert back.prompt == A and back.second_prompt == B
    assert "second_prompt = " in ws.copy_as_code() and repr(B) in ws.copy_as_code()
    other = _ws()
    other.update_from(back)
    assert other.second_prompt == B


def test_a_state_without_the_second_prompt_loads_and_a_bad_one_is_refused():
    state = json.loads(_ws(prompts=[A]).to_json())
    del state["second_prompt"]  # a state written before the field existed
    assert Workspace.from_state(state).second_prompt == ""
    state["second_prompt"] = ["not", "text"]
    with pytest.raises(InputError, match="'second_prompt': the second prompt must be text; "
                                         "got a JSON array"):
        Workspace.from_state(state)
    state["second_prompt"] = "x" * (MAX_PROMPT_CHARS + 1)
    with pytest.raises(InputError, match="at most 100,000 are kept"):
        Workspace.from_state(state)


def test_a_link_carries_the_second_prompt_and_old_links_still_load():
    ws = _ws(prompts=[A], second_prompt=B)
    ws.select("L1.H2")
    text, _ = workspace_link(ws, view="compare")
    data = _link_data(text)
    assert data["p"] == [A] and data["q"] == B  # read back by hand
    link = read_link(text)
    assert link.view == "compare" and link.workspace.prompt == A
    assert link.workspace.second_prompt == B and link.workspace.selected == ["L1.H2"]
    # a link without a second prompt holds no "q", and reads back with none
    plain, _ = workspace_link(_ws(prompts=[A]), view="lens")
    assert "q" not in _link_data(plain) and read_link(plain).workspace.second_prompt == ""


def test_gallery_link_and_export_round_trip_the_second_prompt(tiny_model, notes):
    from apps.gallery import Gallery

    g = Gallery("tiny-llama", view="lens")
    assert g.submit_second_prompt("Water boils at")
    assert g.workspace.second_prompt == "Water boils at"
    query, _ = g.link()
    assert "&s=1." in query
    h = Gallery("tiny-llama")
    assert h.open_link("lens", query.split("&s=")[1])
    assert h.workspace.second_prompt == "Water boils at" and h.link_message == ""
    fresh = Gallery("tiny-llama")
    fresh.import_state(g.export_state())
    assert fresh.workspace.second_prompt == "Water boils at"
    # blank clears it; a prompt over the limit is refused with one notification
    assert g.submit_second_prompt("   ") and g.workspace.second_prompt == ""
    assert not g.submit_second_prompt("word " * 3000)
    assert notes[-1][0] == "warning" and "Second prompt not set" in notes[-1][1]
    assert g.workspace.second_prompt == ""
    assert "Empty" in g._second_prompt_line("")


# -- the comparison, against each prompt run alone ----------------------------------------------

SAME_A = "Mary gave a drink to John"   # the same length in tokens on tiny-llama
SAME_B = "John gave a drink to Mary"
LONGER = "Mary gave a drink to John at the store"


def _hooked_top1(model, prompt):
    """[layer, pos] top-1 probability and id of the lens, by plain torch hooks."""
    import torch
    from test_lens_edits import hooked_lens_logits

    probs = torch.softmax(hooked_lens_logits(model, prompt).double(), -1)   # [layer, pos, vocab]
    top = probs.max(-1)
    return top.values.numpy(), top.indices.numpy()


def test_lens_difference_is_the_hooked_lens_of_each_prompt_alone(tiny_model):
    import numpy as np

    from explorer.analyses.prompt_compare import compare_prompts

    n = len(tiny_model.tokenizer(SAME_A, add_special_tokens=False)["input_ids"])
    assert n == len(tiny_model.tokenizer(SAME_B, add_special_tokens=False)["input_ids"])
    ds = compare_prompts(tiny_model, SAME_A, SAME_B, view="lens")
    pa, ia = _hooked_top1(tiny_model, SAME_A)
    pb, ib = _hooked_top1(tiny_model, SAME_B)
    assert ds.value.dims == ("prompt", "layer", "pos") and ds.attrs["difference_note"] == ""
    np.testing.assert_allclose(ds.value.sel(prompt="A").values, pa, rtol=2e-3)
    np.testing.assert_allclose(ds.value.sel(prompt="B").values, pb, rtol=2e-3)
    np.testing.assert_allclose(ds.difference.values, pb - pa, atol=2e-5)
    # the changed-top-1 flag agrees wherever neither prompt's top two are (near) tied
    agree = ds.top_changed.values == (ia != ib)
    assert agree.mean() > 0.9
    # the answer's probability: at each layer, that of the token the output ranks first
    import torch
    from test_lens_edits import hooked_lens_logits

    probs = torch.softmax(hooked_lens_logits(tiny_model, SAME_B).double(), -1)  # [L, pos, V]
    final = probs[-1].argmax(-1)                                              # [pos]
    want = probs.gather(-1, final.expand(probs.shape[0], -1)[..., None])[..., 0].numpy()
    np.testing.assert_allclose(ds.answer_prob.sel(prompt="B").values, want, rtol=2e-3)


def test_attention_and_dla_differences_are_each_prompt_run_alone(tiny_model):
    import numpy as np

    from explorer.analyses.answer_dla import answer_logit_attribution
    from explorer.analyses.prompt_compare import compare_prompts

    def hf_pattern(prompt, layer, head):       # Hugging Face's own eager attention
        return hf_attentions(tiny_model, prompt)[layer, head]

    ds = compare_prompts(tiny_model, SAME_A, SAME_B, view="attention", layer=1, head=2)
    assert ds.attrs["component"] == "L1.H2"
    np.testing.assert_allclose(ds.difference.values,
                               hf_pattern(SAME_B, 1, 2) - hf_pattern(SAME_A, 1, 2), atol=1e-5)

    dla = compare_prompts(tiny_model, SAME_A, SAME_B, view="dla")
    a_id, b_id = dla.attrs["answer_id"], dla.attrs["alternative_id"]

    def alone(prompt):
        one = answer_logit_attribution(tiny_model, prompt, answer=a_id,
                                       alternative=b_id).sel(run="clean").isel(pos=-1)
        return np.concatenate([one.heads.values, one.mlp.values[:, None]], axis=1), one
    ga, one_a = alone(SAME_A)
    gb, one_b = alone(SAME_B)
    np.testing.assert_allclose(dla.difference.values, gb - ga, atol=1e-5)
    assert dla.component.values[2, 1] == "L2.H1" and dla.component.values[0, -1] == "L0.MLP"
    np.testing.assert_allclose(dla.logit_diff.values,
                               [float(one_a.logit_diff), float(one_b.logit_diff)], atol=1e-5)


def test_different_lengths_are_aligned_with_no_difference_and_a_note(tiny_model):
    import numpy as np

    from explorer.analyses.prompt_compare import compare_prompts

    n_a = len(tiny_model.tokenizer(SAME_A, add_special_tokens=False)["input_ids"])
    n_b = len(tiny_model.tokenizer(LONGER, add_special_tokens=False)["input_ids"])
    assert n_b > n_a
    for view in ("lens", "attention", "saturation"):
        ds = compare_prompts(tiny_model, SAME_A, LONGER, view=view, k=3)
        assert "difference" not in ds and "top_changed" not in ds
        assert ds.attrs["difference_note"].startswith(
            f"No difference drawn: prompt A has {n_a} tokens and prompt B {n_b}")
        assert ds.sizes["pos"] == n_b and ds.mask.values.sum(-1).tolist() == [n_a, n_b]
        a = ds.value.sel(prompt="A").values
        cols = a[..., n_a:] if view != "attention" else a[n_a:, :]
        assert np.isnan(cols).all()            # A is padded past its end, from position 0
        assert ds.token.values[0, n_a:].tolist() == [""] * (n_b - n_a)
    # A's cells are A's alone: the lens of the short prompt, aligned from position 0
    lens = compare_prompts(tiny_model, SAME_A, LONGER, view="lens")
    pa, _ = _hooked_top1(tiny_model, SAME_A)
    np.testing.assert_allclose(lens.value.sel(prompt="A").values[:, :n_a], pa, rtol=2e-3)


def test_saturation_view_is_the_library_function_of_each_prompt(tiny_model):
    import numpy as np

    from explorer.analyses.prompt_compare import compare_prompts
    from explorer.analyses.saturation import saturation_layers

    ds = compare_prompts(tiny_model, SAME_A, SAME_B, view="saturation", k=3)
    for which, prompt in (("A", SAME_A), ("B", SAME_B)):
        one = saturation_layers(tiny_model, [prompt], k=3, rank_cap=50, sample_positions=0,
                                progress=False).isel(prompt=0)
        s = one.sat_layer.values.T.astype(float)           # [rank, pos]
        np.testing.assert_array_equal(ds.value.sel(prompt=which).values,
                                      np.where(s < 0, np.nan, s))


def test_bad_inputs_are_named(tiny_model):
    from explorer.analyses.prompt_compare import compare_prompts

    with pytest.raises(InputError, match="`prompt_a` must be a non-empty prompt; got ' '"):
        compare_prompts(tiny_model, " ", SAME_B)
    with pytest.raises(InputError, match="view"):
        compare_prompts(tiny_model, SAME_A, SAME_B, view="heads")
    with pytest.raises(InputError, match="`head` must be an int in \\[0, 3\\]; got 7"):
        compare_prompts(tiny_model, SAME_A, SAME_B, view="attention", head=7)


# -- the page ----------------------------------------------------------------------------------

def test_an_empty_second_prompt_shows_a_alone_with_a_note(tiny_model):
    import numpy as np

    from apps.compare import CompareView, compare_caption, plot_compare
    from explorer.analyses.prompt_compare import NO_SECOND_PROMPT, compare_prompts

    ds = compare_prompts(tiny_model, SAME_A, "  ", view="lens")
    assert ds.prompt.values.tolist() == ["A"] and "difference" not in ds
    assert ds.attrs["difference_note"] == NO_SECOND_PROMPT
    pa, _ = _hooked_top1(tiny_model, SAME_A)
    np.testing.assert_allclose(ds.value.sel(prompt="A").values, pa, rtol=2e-3)

    view = CompareView(tiny_model, background=False, prompt=SAME_A)
    assert view.error == "" and view.result.prompt.values.tolist() == ["A"]
    assert "No second prompt" in view.note and "Second prompt (compare)" in view.note
    assert plot_compare(view.result, "B").text.startswith("No prompt B")
    assert NO_SECOND_PROMPT in compare_caption(view.result)
    for name in ("attention", "saturation", "dla"):
        view.view = name
        assert view.error == "" and view.result.attrs["view"] == name


def test_page_marks_a_stale_result_with_both_prompts(tiny_model):
    from apps.compare import CompareView

    view = CompareView(tiny_model, background=False, prompt=SAME_A, second_prompt=SAME_B)
    assert view.note == "" and view.result is not None and view.stale_note() == ""
    shown = view.shown_provenance()
    assert shown.prompts == (SAME_A, SAME_B) and dict(shown.request)["view"] == "lens"
    view._page_loaded = False                # as while a new result is being computed
    view.second_prompt = LONGER
    note = view.stale_note()
    assert note.startswith(f"Shown: computed on A = {SAME_A!r} and B = {SAME_B!r} (lens)")
    assert note.endswith("prompt B changed since: the page recomputes when it is opened.")
    assert "Outdated" in view.stale_markdown()
    view.prompt = "Hello"
    assert view.stale_note().endswith("both prompts changed since: the page recomputes when "
                                      "it is opened.")
    view._page_loaded = True                 # it computes: B over the page's 128 tokens fails
    view.second_prompt = "x " * 200
    assert "this page compares at most 128" in view.error
    assert view.stale_note().endswith("both prompts changed since: its recompute failed (the "
                                      "message above says why); the result shown is the old "
                                      "one.")
    view.running = True                      # a recompute in flight (served)
    assert view.stale_note().endswith("changed since: recomputing; the result shown is the "
                                      "old one until then.")


def test_page_views_clicks_caption_and_code(tiny_model):
    import numpy as np

    import explorer
    from apps.compare import CompareView, compare_caption, plot_compare

    view = CompareView(tiny_model, background=False, prompt=SAME_A, second_prompt=LONGER)
    assert "No difference drawn" in compare_caption(view.result)
    assert plot_compare(view.result, "difference").text == (
        "No B − A: A has 18 tokens, B 24 (see the note below).")
    view.second_prompt = SAME_B
    view.click(3.2, 1.0)                     # the lens: a cell's column is its position
    assert view.selected_positions == [3]
    view.click(3.0, 0.0)
    assert view.selected_positions == []
    view.selected = "L2.H1"                  # the newest head sets the attention's head
    view.view = "attention"
    assert (view.layer, view.head) == (2, 1) and view.result.attrs["component"] == "L2.H1"
    view.click(0.0, 4.0)                     # attention: the query row
    assert view.selected_positions == [4]
    view.view = "dla"
    view.click(4.0, 1.0)                     # the MLP column
    assert view.selected == "L1.MLP"
    caption = compare_caption(view.result)
    assert "logit difference" in caption and "Largest change B − A" in caption
    for panel in ("A", "B", "difference"):
        assert plot_compare(view.result, panel, [2], "L1.MLP") is not None
    # the page's code recomputes what it shows
    code = view.code_snippet()
    assert "compare_prompts(model, prompt_a, prompt_b, view='dla'" in code
    scope: dict = {}
    exec(compile(code.replace("explorer.load_model('tiny-llama')", "model_"), "code", "exec"),
         {"model_": tiny_model, "explorer": explorer}, scope)
    np.testing.assert_allclose(scope["difference"].values, view.result.difference.values)


def test_gallery_page_follows_the_second_prompt_and_selects_clicks(tiny_model):
    from apps.gallery import Gallery

    g = Gallery("tiny-llama", view="compare")
    page = g.page("compare")
    g.prompt = SAME_A
    assert "No second prompt" in page.note and page.result.attrs["prompts"] == [SAME_A]
    g.workspace.second_prompt = SAME_B
    assert page.second_prompt == SAME_B and page.result is not None
    assert page.param["second_prompt"].precedence == -1
    page.click(2.0, 0.0)
    assert g.workspace.selected_positions == [2]
    page.view = "dla"
    page.click(0.0, 1.0)
    assert g.workspace.selected == ["L1.H0"]
    query, _ = g.link()
    h = Gallery("tiny-llama")
    assert h.open_link("compare", query.split("&s=")[1])
    assert h.view == "compare" and h.page("compare").second_prompt == SAME_B
    assert h.page("compare").view == "dla"


# -- the command line ----------------------------------------------------------------------------

def test_command_prints_and_exports_the_same_dataset(tiny_model, monkeypatch, capsys, tmp_path):
    import numpy as np
    import xarray as xr
    from _cli import OneCommand

    from explorer.analyses.prompt_compare import compare_prompts

    cli = OneCommand("compare", monkeypatch, capsys)
    out = tmp_path / "cmp.nc"
    got = cli.json(["compare", "--model", "tiny-llama", "--prompt", SAME_A, "--second", SAME_B,
                    "--view", "dla", "--top", "3", "--out", str(out), "--json"])
    ds = compare_prompts(tiny_model, SAME_A, SAME_B, view="dla")
    d = ds.difference.values
    biggest = np.sort(np.abs(d).ravel())[::-1][:3]
    assert [abs(c["b_minus_a"]) for c in got["largest_changes"]] == pytest.approx(biggest)
    first = got["largest_changes"][0]
    assert first["b_minus_a"] == pytest.approx(first["b"] - first["a"])
    saved = xr.load_dataset(out, engine="scipy")
    np.testing.assert_allclose(saved.difference.values, d)
    assert saved.attrs["view"] == "dla" and json.loads(saved.attrs["prompts"]) == [SAME_A, SAME_B]
    # prompts of different lengths: no difference, and the note says why
    got = cli.json(["compare", "--model", "tiny-llama", "--prompt", SAME_A, "--second", LONGER,
                    "--view", "lens", "--json"])
    assert got["difference"] is None and got["note"].startswith("No difference drawn")
    got = cli.json(["compare", "--model", "tiny-llama", "--prompt", SAME_A, "--second", " ",
                    "--json"])
    assert got["n_tokens"] == [18] and got["note"].startswith("No second prompt")
    assert cli(["compare", "--model", "tiny-llama", "--prompt", "", "--second", SAME_B]) != 0
    assert "`prompt_a` must be a non-empty prompt" in capsys.readouterr().err
