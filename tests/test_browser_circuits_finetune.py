"""Browser test of the Circuits page's fine-tuning comparison on tiny-llama: a LoRA run with
checkpoints (scored EAP-IG on KL, saved as ``circuits.nc``) is opened by the page, which
measures the prompt-resampling noise floor on the base model; in the browser's Bokeh
document the per-layer change plot has the floor's line and band, one legend entry naming
them, one value per layer (tests/test_apps_circuits_finetune.py checks the values against
D_l by hand). A screenshot goes to ``test-artifacts/`` (gitignored)."""
from __future__ import annotations

from pathlib import Path

import pytest
from _browser import ARTIFACTS, open_page, painted, served_view_fixture, wait_for, wait_for_text

from apps._circuits_finetune import FLOOR_LABEL

pytestmark = [pytest.mark.browser, pytest.mark.slow]

_FLOOR_JS = """(label) => {
  for (const doc of Bokeh.documents) {
    const models = [...doc.all_models];
    const line = models.find(m => m.name === 'noise-floor');
    const band = models.find(m => m.name === 'noise-floor-band');
    if (!line || !band) continue;
    const text = (l) => l == null ? null : (typeof l === 'string' ? l : l.value);
    const items = models.filter(m => m.renderers !== undefined && m.label !== undefined
                                     && text(m.label) === label);
    const fig = models.find(m => m.renderers !== undefined && m.title !== undefined
                                 && Array.isArray(m.renderers) && m.renderers.includes(line));
    return {floor: Array.from(line.data_source.data.floor),
            items: items.map(i => i.renderers.map(r => r.name).sort()),
            title: fig && fig.title ? fig.title.text : null};
  }
  return null;
}"""


def _train_and_score(folder: Path) -> str:
    """The server's setup: a LoRA run with checkpoints in ``folder``/run, scored and saved."""
    run = folder / "run"
    return f"""
        from apps.circuits import CircuitsView
        from explorer import load_model
        from explorer.analyses import circuit_lora as cl
        from explorer.analyses import circuits as ca
        model = load_model("tiny-llama")
        data = ca.make_task("add", 16, seed=2)
        cl.finetune_lora(model, data.clean, data.answer, ranks=cl.uniform_lora_ranks(model, 2),
                         steps=3, batch_size=4, lr=1e-2, checkpoints=[0, 1, 3], folder={str(run)!r})
        ck = cl.checkpoint_circuits(model, {str(run)!r}, ca.make_task("add", 4, seed=0),
                                    batch_size=4)
        cl.save_netcdf(ck, {str(run / "circuits.nc")!r})
        """


def _page_of_the_run(folder: Path) -> str:
    """The page: the Circuits view on the run in ``folder``/run."""
    return f"""
        view = CircuitsView(model, task="add", n_prompts=4, run_folder={str(folder / "run")!r},
                            autostart=False, checkpoint=2)
        return theme.page([view], title="Circuits")
        """


page_url = served_view_fixture("circuits", _train_and_score, _page_of_the_run, one_thread=True,
                               timeout=300)


def test_the_layer_change_plot_draws_the_noise_floor_with_a_legend_entry(page_url, browser):
    page, errors = open_page(browser, page_url, viewport={"width": 1500, "height": 1500},
                             ready=".circuit-state", timeout=300)
    wait_for(page, "data-circuit-checkpoints", lambda v: v == "3")
    wait_for(page, "data-circuit-floor", lambda v: v == "ready", timeout=240)
    page.wait_for_function(f"() => ({_FLOOR_JS})({FLOOR_LABEL!r}) !== null", timeout=60_000)
    got = page.evaluate(f"({_FLOOR_JS})({FLOOR_LABEL!r})")
    assert len(got["floor"]) == 3 and max(got["floor"]) > 0      # tiny-llama: 3 layers
    assert got["items"] == [["noise-floor", "noise-floor-band"]]
    assert got["title"].startswith("Per-layer edge change vs step 0 (EAP-IG on KL)")
    wait_for_text(page, ".circuit-layer-change", "3 prompt samples of the base model", timeout=60)
    ARTIFACTS.mkdir(exist_ok=True)
    (ARTIFACTS / "circuits-noise-floor.png").write_bytes(painted(page, full_page=True))
    assert not errors, errors
    page.close()
