"""Headless tests of the Panel pages: parameters in, the plotted data out, layout, sessions.

The lens values are checked against a plain-torch logit lens (forward hooks on the Hugging
Face layers, final norm and unembedding applied by hand), with the steering vector built
the same independent way.
"""
from __future__ import annotations

import inspect
import json
import threading

import numpy as np
import panel as pn
import pytest
import torch

import explorer
from apps import theme
from apps._session import Runner
from apps.gallery import VIEWS, Gallery, create_app, serve
from apps.lens import LensView, lens_table, plot_lens_heatmap
from tests._hooks import removed_after

PROMPT = "The capital of France is"
A, B = "I love you. You are wonderful.", "I hate you. You are terrible."



@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("EXPLORER_CACHE", str(tmp_path / "cache"))


# -- an independent logit lens ---------------------------------------------------------

def _layer_outputs(model, prompt, *, steer=None, steers=()):
    """Each decoder layer's output [layer, pos, d_model] from plain hooks; ``steer`` =
    (layer, vector, alpha) adds alpha * vector to that layer's output (``steers``: several)."""
    steers = [*steers, *([steer] if steer is not None else [])]
    hf = model.hf
    ids = torch.tensor([model.tokenizer(prompt, add_special_tokens=False)["input_ids"]])
    outs, hooks = [], []
    for i, layer in enumerate(hf.model.layers):
        def hook(_module, _inputs, output, i=i):
            h = output[0] if isinstance(output, tuple) else output
            for at, vector, alpha in steers:
                if i == at:
                    h = h + alpha * torch.as_tensor(vector, dtype=h.dtype)
            outs.append(h[0].detach().clone())
            return (h, *output[1:]) if isinstance(output, tuple) else h
        hooks.append(layer.register_forward_hook(hook))
    with removed_after(hooks), torch.no_grad():
        hf(input_ids=ids)
    return torch.stack(outs)


def _plain_lens(model, prompt, *, steer=None):
    """Top-1 id and probability [pos, layer] of norm + unembed of every layer output."""
    h = _layer_outputs(model, prompt, steer=steer)                        # [layer, pos, d]
    probs = torch.softmax(model.hf.lm_head(model.hf.model.norm(h)).float(), -1)
    p, i = probs.max(-1)                                                  # [layer, pos]
    return i.T.numpy(), p.T.numpy()


def _plain_vector(model, layer):
    """Mean layer output over tokens 1.. of A minus that of B."""
    a = _layer_outputs(model, A)[layer, 1:].mean(0)
    b = _layer_outputs(model, B)[layer, 1:].mean(0)
    return (a - b).numpy()


def _heat(view):
    """The HeatMap element the page shows, as (pos, layer) -> (top_prob, top-1 id)."""
    overlay = plot_lens_heatmap(view.result)
    heat = overlay.get(0)
    df = heat.dframe()
    return df


def _grid(df, column, n_pos, n_layers):
    out = np.zeros((n_pos, n_layers), dtype=df[column].dtype)
    out[df["pos"].to_numpy(), df["layer"].to_numpy()] = df[column].to_numpy()
    return out


# -- theme -----------------------------------------------------------------------------

def test_show_token_makes_whitespace_visible():
    assert theme.show_token(" Paris") == "·Paris"
    assert theme.show_token("\n\n") == "↵↵"
    assert theme.show_token("\ta") == "⇥a"
    assert theme.show_token("") == "∅"
    assert theme.show_token("\x13") == "\\x13"
    assert theme.show_tokens(["a", " b"]) == ["a", "·b"]


def test_colour_maps_by_quantity():
    lum = [theme._luminance(c) for c in theme.CMAPS["probability"][::32]]
    assert all(x >= y for x, y in zip(lum, lum[1:])), "probability map must darken monotonically"
    signed = theme.CMAPS["signed"]
    centre = theme._luminance(signed[len(signed) // 2])
    assert centre > max(theme._luminance(signed[0]), theme._luminance(signed[-1]))
    assert len(set(theme.CATEGORICAL[:10])) == 10
    assert theme.text_colors([0.0, 1.0], theme.PROBABILITY_CMAP) == ["black", "white"]


def test_format_bytes():
    assert theme.format_bytes(0) == "0 B"
    assert theme.format_bytes(1_500_000) == "1.5 MB"


# -- lens view -------------------------------------------------------------------------

def test_heatmap_equals_plain_torch_lens(tiny_model):
    view = LensView(tiny_model, prompt=PROMPT, k=3)
    assert view.error == ""
    df = _heat(view)
    ids, probs = _plain_lens(tiny_model, PROMPT)
    n_pos, n_layers = ids.shape
    assert len(df) == n_pos * n_layers
    np.testing.assert_allclose(_grid(df, "top_prob", n_pos, n_layers), probs, rtol=1e-4, atol=1e-6)
    np.testing.assert_array_equal(_grid(df, "id0", n_pos, n_layers), ids)
    # the axis is labelled with the input tokens, whitespace visible
    table = lens_table(view.result)
    tokens = tiny_model.tokenizer.convert_ids_to_tokens(
        tiny_model.tokenizer(PROMPT, add_special_tokens=False)["input_ids"])
    assert list(table.drop_duplicates("pos")["input"]) == [t.replace("Ġ", "·") for t in tokens]
    assert view.result.attrs["edits"] == []


def test_steering_slider_changes_heatmap_like_a_hooked_run(tiny_model):
    view = LensView(tiny_model, prompt=PROMPT, k=3, steer_layer=1)
    before = _heat(view)
    view.alpha = 4.0
    after = _heat(view)
    assert not np.allclose(before["top_prob"], after["top_prob"])
    ids, probs = _plain_lens(tiny_model, PROMPT, steer=(1, _plain_vector(tiny_model, 1), 4.0))
    n_pos, n_layers = ids.shape
    np.testing.assert_allclose(_grid(after, "top_prob", n_pos, n_layers), probs, rtol=1e-4, atol=1e-6)
    np.testing.assert_array_equal(_grid(after, "id0", n_pos, n_layers), ids)
    # layers before the steered one are unchanged
    np.testing.assert_allclose(_grid(after, "top_prob", n_pos, n_layers)[:, 0],
                               _grid(before, "top_prob", n_pos, n_layers)[:, 0])
    (edit,) = view.result.attrs["edits"]
    assert edit["kind"] == "steer" and edit["layer"] == 1 and edit["alpha"] == 4.0
    np.testing.assert_allclose(edit["vector"], _plain_vector(tiny_model, 1), rtol=1e-4, atol=1e-5)


def test_export_load_round_trip(tiny_model):
    one = LensView(tiny_model, prompt="One two three", k=4, steer_layer=2, alpha=-1.5,
                   contrast_a="Water boils", contrast_b="The lazy dog")
    state = json.loads(json.dumps(one.export_state()))  # through JSON, as a file would be
    assert state["model"] == "tiny-llama" and state["view"] == "lens"
    assert state["prompts"] == ["One two three"]
    assert {"explorer", "torch", "nnsight", "panel", "holoviews", "bokeh"} <= set(state["versions"])
    (edit,) = explorer.edits_from_json(json.dumps(state["edits"]))
    assert isinstance(edit, explorer.Steer) and edit.layer == 2 and edit.alpha == -1.5

    two = LensView(tiny_model)
    two.load_state(state)
    again = two.export_state()
    assert again["params"] == state["params"]
    assert again["edits"] == state["edits"]
    np.testing.assert_array_equal(two.result.top_prob.values, one.result.top_prob.values)
    assert two.result.attrs["edits"] == one.result.attrs["edits"]


@pytest.mark.parametrize("change, match", [
    ({"format": "something-else"}, "format"),
    ({"params": {"alpha": 99.0}}, "alpha"),
    ({"params": {"layer_count": 3}}, "unknown lens parameter"),
    ({"params": {"steer_layer": 7}}, "steer_layer"),
    ({"params": {"prompt": 3}}, "prompt"),
    ({"edits": [{"kind": "scale", "layer": 0, "head": 0, "alpha": 2.0}]}, "steer edits only"),
    ({"edits": [{"kind": "melt"}]}, "kind"),
])
def test_load_state_rejects_bad_fields(tiny_model, change, match):
    view = LensView(tiny_model)
    state = view.export_state()
    for key, value in change.items():
        state[key] = {**state[key], **value} if key == "params" else value
    before = view.export_state()["params"]
    with pytest.raises(explorer.ExplorerError, match=match):
        view.load_state(state)
    assert view.export_state()["params"] == before


def test_upload_widget_loads_json_and_reports_bad_files(tiny_model, notes):
    source = LensView(tiny_model, prompt="Water boils at", alpha=2.0, k=2)
    payload = json.dumps(source.export_state()).encode()
    view = LensView(tiny_model)
    upload = view.controls().select(pn.widgets.FileInput)[0]
    assert ".json" in upload.accept
    upload.param.update(filename="state.json", value=payload)
    assert (view.prompt, view.alpha, view.k) == ("Water boils at", 2.0, 2)
    assert notes[-1][0] == "success"

    for name, data, match in [("state.pkl", payload + b" ", ".json"),
                              ("state.json", b"{not json", "not valid JSON"),
                              ("state.json", b"[1, 2]", "JSON object")]:
        upload.param.update(filename=name, value=data)
        kind, message = notes[-1]
        assert kind == "error" and match in message
        assert view.prompt == "Water boils at"


def test_download_widget_exports_current_state(tiny_model):
    view = LensView(tiny_model, alpha=1.0)
    download = view.controls().select(pn.widgets.FileDownload)[0]
    assert download.filename.endswith(".json")
    state = json.loads(download.callback().getvalue())
    assert state["params"]["alpha"] == 1.0 and state["edits"][0]["kind"] == "steer"


def test_bad_prompt_notifies_and_keeps_last_result(tiny_model, notes):
    view = LensView(tiny_model, prompt=PROMPT)
    good = view.result
    view.prompt = "   "                      # must not raise
    assert "empty" in view.error
    assert view.result is good
    assert notes and notes[-1][0] == "error" and "empty" in notes[-1][1]
    view.prompt = "Paris is"
    assert view.error == "" and view.result is not good


def test_empty_contrast_prompts_are_a_notified_error(tiny_model, notes):
    view = LensView(tiny_model, contrast_a="\n \n")
    view.alpha = 1.0
    assert "contrast_a" in view.error and notes[-1][0] == "error"


def test_background_run_and_cancel(tiny_model):
    view = LensView(tiny_model, background=True).wait()
    first = view.result
    assert first is not None and not view.running
    view.alpha = 3.0
    view.wait()
    assert view.result is not first and view.result.attrs["edits"][0]["alpha"] == 3.0
    shown = view.result
    view.alpha = -3.0
    view.cancel()
    view.wait()
    assert view.result is shown and not view.running and not view.busy
    view.close()                              # a closed session computes nothing more
    view.alpha = 1.0
    view.wait()
    assert view.result is shown


def test_runner_discards_stale_and_cancelled_results():
    results, errors, busy = [], [], []
    runner = Runner(on_result=results.append, on_error=errors.append, on_busy=busy.append,
                    background=True, busy_delay=0.05)
    gate = threading.Event()

    def slow(token):
        gate.wait(5)
        token.check()
        return "slow"

    runner.submit(slow)
    runner.submit(lambda token: "fresh")      # supersedes the slow job
    runner.wait(5)
    gate.set()
    assert results == ["fresh"]
    gate.clear()
    runner.submit(slow)
    threading.Event().wait(0.2)               # past busy_delay: the spinner shows
    runner.cancel()
    gate.set()
    runner.wait(5)
    assert results == ["fresh"] and True in busy and busy[-1] is False
    runner.submit(lambda token: 1 / 0)
    runner.wait(5)
    assert isinstance(errors[-1], ZeroDivisionError)


def test_lens_layout(tiny_model):
    view = LensView(tiny_model)
    layout = view.__panel__()
    assert isinstance(layout, pn.Row)
    controls, main = layout
    names = [w.name for w in controls.select(pn.widgets.Widget)]
    for label in ("Prompt", "Contrast prompts A", "Contrast prompts B", "Steering layer",
                  "Steering strength α", "Top-k tokens"):
        assert label in names
    alpha = next(w for w in controls.select(pn.widgets.FloatSlider) if w.name.startswith("Steering"))
    assert (alpha.start, alpha.end) == (-10.0, 10.0)
    layer = next(w for w in controls.select(pn.widgets.IntSlider) if w.name == "Steering layer")
    assert (layer.start, layer.end) == (0, tiny_model.spec.n_layers - 1)
    (plot,) = main.select(pn.pane.HoloViews)
    heat = plot.object.get(0)
    np.testing.assert_array_equal(heat.dimension_values("top_prob"),
                                  lens_table(view.result)["top_prob"].to_numpy())
    assert plot.object.get(0).opts.get().kwargs["cmap"] == theme.PROBABILITY_CMAP
    details = [h.object for h in main.select(pn.pane.HTML) if "lens-details" in h.object]
    assert len(details) == 1 and "data-lens-digest" in details[0]
    assert main.select(pn.indicators.LoadingSpinner)
    assert any(b.label == "Cancel" for b in main.select(pn.widgets.Button))


def test_heatmap_tooltip_and_labels(tiny_model):
    view = LensView(tiny_model, k=4)
    overlay = plot_lens_heatmap(view.result)
    heat, labels = overlay.get(0), overlay.get(1)
    tooltips = heat.opts.get().kwargs["hover_tooltips"]
    assert [name for name, _ in tooltips] == ["input", "layer", "#1", "#2", "#3", "#4"]
    table = lens_table(view.result)
    assert list(labels.dimension_values("label")) == list(table["label"])
    assert all(len(s) <= 8 for s in table["label"])
    assert "unedited" in heat.opts.get().kwargs["title"]


# -- gallery ---------------------------------------------------------------------------

def test_gallery_lists_every_registered_view(tiny_model):
    calls = []

    def other(model):
        calls.append(model)
        return LensView(model, k=2)

    views = [*VIEWS, ("Another page", "another", other)]
    gallery = Gallery("tiny-llama", views=views)
    nav = gallery.sidebar()[1]
    assert nav.options == {title: slug for title, slug, _ in views}
    assert list(gallery.pages) == ["lens"] and not calls  # pages are built on first visit
    gallery.view = "another"
    assert calls == [gallery.model] and set(gallery.pages) == {"lens", "another"}
    # the sidebar prompt drives every page that has one (the one in view at once, the
    # others when opened), and hides the page's own box
    gallery.prompt = "Water boils at"
    assert gallery.pages["another"].prompt == "Water boils at"
    assert gallery.pages["lens"].prompt != "Water boils at"
    gallery.view = "lens"
    assert all(p.prompt == "Water boils at" for p in gallery.pages.values())
    assert gallery.pages["lens"].param["prompt"].precedence < 0
    assert LensView.param.prompt.precedence is None or LensView.param.prompt.precedence >= 0
    assert "Activation cache" in gallery.cache


def test_gallery_opens_each_page_with_its_intro(tiny_model):
    from apps._intros import INTROS

    views = [*VIEWS[:1], ("Another page", "another", lambda model: LensView(model, k=2))]
    gallery = Gallery("tiny-llama", views=views)
    intro, scope, page = gallery._main.objects
    assert "page-intro" in intro.css_classes and "page-intro" not in page.css_classes
    assert INTROS["lens"].try_first in intro.object
    assert "page-scope" in scope.css_classes    # the lens states its scope under the intro
    gallery.view = "another"  # a page without an intro: its scope line, then the page
    scope, page = gallery._main.objects
    assert "page-intro" not in page.css_classes and "page-scope" in scope.css_classes


def test_gallery_rejects_unknown_view():
    with pytest.raises(explorer.ExplorerError, match="view"):
        Gallery("tiny-llama", view="nope")


def test_gallery_switches_model(tiny_model, notes):
    gallery = Gallery("tiny-llama")
    old = gallery.pages["lens"]
    gallery.model_name = "tiny-gpt2"
    assert gallery.model.spec.name == "tiny-gpt2"
    assert gallery.pages["lens"] is not old
    assert gallery.pages["lens"].result.attrs["model"] == "tiny-gpt2"


def test_gallery_switch_removes_a_second_prompt_the_new_model_cannot_take(tiny_model, notes):
    """A second prompt kept under a longer limit (as on a model with a longer context) is
    removed when the gallery moves to a model it does not fit, and a warning that stays up
    quotes its beginning and the new limit."""
    gallery = Gallery("tiny-llama")
    ws = gallery.workspace
    ws._prompt_limit = 100_000                      # as the workspace of a longer-context model
    long_text = "A long second prompt" + " word" * 300
    ws.second_prompt = long_text
    assert ws.second_prompt == long_text
    gallery.model_name = "tiny-gpt2"                # context of 256 tokens
    assert gallery.model.spec.name == "tiny-gpt2" and ws.second_prompt == ""
    warning = [m for kind, m in notes if kind == "warning"]
    assert warning and "'A long second prompt word word" in warning[-1]
    assert "on tiny-gpt2 (256 tokens): removed" in warning[-1]


def test_gallery_model_load_failure_is_notified(tiny_model, notes, monkeypatch):
    import apps.gallery

    gallery = Gallery("tiny-llama")
    page = gallery.pages["lens"]

    def broken(name, **kwargs):
        raise explorer.ExplorerError(f"cannot load {name}")

    monkeypatch.setattr(apps.gallery, "get_model", broken)
    gallery.model_name = "tiny-gpt2"
    assert notes[-1] == ("error", "Could not load the model: cannot load tiny-gpt2")
    assert gallery.model_name == "tiny-llama" and gallery.pages["lens"] is page


def test_two_apps_share_no_view_objects(tiny_model):
    one, two = create_app("tiny-llama", view="lens"), create_app("tiny-llama", view="lens")
    assert isinstance(one, pn.template.FastListTemplate)

    def objects(tmpl):
        found = {}
        for part in (*tmpl.main, *tmpl.sidebar):
            for obj in part.select():
                found[id(obj)] = obj
        return found

    a, b = objects(one), objects(two)
    assert len(a) > 10 and not set(a) & set(b)
    lens_a = [o for o in a.values() if isinstance(o, pn.pane.HoloViews)]
    lens_b = [o for o in b.values() if isinstance(o, pn.pane.HoloViews)]
    assert lens_a and lens_b and lens_a[0].object is not lens_b[0].object


def test_serve_binds_localhost_by_default():
    sig = inspect.signature(serve)
    assert sig.parameters["address"].default == "127.0.0.1"
    assert sig.parameters["model"].default == "smollm2-135m"
    assert sig.parameters["show"].default is False
