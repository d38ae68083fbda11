"""What the JupyterLab notebook tests share: the Lab, running a notebook from its UI, reading its plots.

The example notebooks in a real JupyterLab, offline: every view cell draws, widgets reach the
kernel. `test_browser_notebooks.py` checks every notebook (`LAB_NOTEBOOKS`) in one JupyterLab
(one server start for all of them); `test_browser_notebook_export.py` checks the HTML export,
so a second test worker runs it meanwhile. The `lab` fixture serves JupyterLab (127.0.0.1, a
free port, its own token, a temporary copy of examples/, the kernel is this interpreter with
the worktree first on the path); `check_in_lab` opens each notebook in one headless chromium
tab on the Lab (`LabTab`: the Lab's page loads once, the notebooks open one after another from
the Lab's document manager, as the file browser opens them, each closed before the next), waits
until the server and the page both have its kernel idle, runs all cells from the Lab's Run menu
on ``tiny-llama``, and reads from the page that every cell that shows a plot drew it: a Bokeh
figure whose data area has pixels other than its background, a title that fits, no plot wider
than the output area. The notebook is then saved from the Lab's File menu and the saved file checked
(`test_notebooks.check_outputs`: every cell ran, no error, the objects the notebook promises,
the tiny model named).
Every request to a host other than the Lab fails the test (the page must load everything from
the installed packages), after a widget's change too. For the lens view and the attention
view, moving a slider in the browser must redraw the plot (the value goes to the kernel, the
kernel sends a new plot). The notebook's kernel is stopped after its test. What was measured
(seconds to run all cells, view cells drawn, the seconds of each phase: open, kernel and run,
drawn, saved, screenshots) goes to test-artifacts/lab_<notebook>.json.

A notebook exported with ``jupyter nbconvert --to html --execute`` must draw its plots in a page
that may fetch nothing but the file itself.
"""
from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import subprocess
import sys
import time
import urllib.request

import pytest
from _browser import ARTIFACTS, ROOT, TITLE_FIT, free_port, title_fits
from test_notebooks import TINY, TINY_FACTS, TINY_KNOWLEDGE, check_outputs

from explorer.benches.child import child_server

EXAMPLES = ROOT / "examples"

# Per notebook: the cells (0-based, over all cells) that show a plot or a view.
VIEW_CELLS = {
    "quickstart.ipynb": [10, 14, 17],
    "lens_saturation.ipynb": [8, 13],
    "conflicts.ipynb": [7],
    "icl_heads.ipynb": [8, 13],
    "circuits.ipynb": [11],
    "representations.ipynb": [7, 16],
    "dynamics.ipynb": [4, 8],
    "editing_unlearning.ipynb": [8],
    "workspace_atlas.ipynb": [13, 15, 16],
}

RUN_TIMEOUT = 420  # seconds for one notebook's cells (tiny model; the CI machine has 2 cores)
VIEWPORT = {"width": 1330, "height": 1000}  # with the file browser open: an output area of 900 px

# Per notebook with a live view: the view's cell and the key pressed on its first slider
# (quickstart: the lens view's steering layer to 0; workspace_atlas: the attention view's
# layer from the last to 0). The plot in that cell must change: the kernel re-ran and sent it.
# On a failed round trip the kernel is asked for the view's value (the third item): whether
# the change reached it tells a lost message from a lost redraw.
ROUND_TRIP = {"quickstart.ipynb": (10, "Home", "view.steer_layer"),
              "workspace_atlas.ipynb": (15, "Home", "(attention_view.layer, attention_view.head)")}

# The notebooks `test_browser_notebooks.py` runs in its one JupyterLab, in this order. Each
# runs in a kernel of its own (started as the notebook opens, stopped after its test): a
# kernel shared between notebooks would let one notebook's imports and extension calls hide
# another's omissions.
LAB_NOTEBOOKS = list(VIEW_CELLS)


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """JupyterLab on a copy of examples/: yields (base URL, token, notebook folder)."""
    pytest.importorskip("jupyterlab")
    tmp = tmp_path_factory.mktemp("lab")
    notebooks = tmp / "notebooks"
    shutil.copytree(EXAMPLES, notebooks, ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
    facts = tmp / "facts.json"
    facts.write_text(json.dumps(TINY_FACTS))
    settings = tmp / "settings"
    tracker = settings / "@jupyterlab" / "notebook-extension"
    tracker.mkdir(parents=True)
    # every cell stays laid out (the default skips off-screen cells), so every plot can draw
    # and the notebook's kernel starts without asking
    (tracker / "tracker.jupyterlab-settings").write_text(
        json.dumps({"windowingMode": "none", "autoStartDefaultKernel": True}))
    news = settings / "@jupyterlab" / "apputils-extension"
    news.mkdir(parents=True)
    (news / "notification.jupyterlab-settings").write_text(
        json.dumps({"fetchNews": "false", "checkForUpdates": False}))
    port, token = free_port(), secrets.token_hex(16)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "EXPLORER_EXAMPLE_MODEL": TINY, "EXPLORER_EXAMPLE_FACTS": str(facts),
           "EXPLORER_EXAMPLE_KNOWLEDGE": json.dumps(TINY_KNOWLEDGE),
           "JUPYTERLAB_SETTINGS_DIR": str(settings), "JUPYTERLAB_WORKSPACES_DIR": str(tmp / "workspaces"),
           "JUPYTER_RUNTIME_DIR": str(tmp / "runtime"), "TOKENIZERS_PARALLELISM": "false"}
    argv = [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--ServerApp.ip=127.0.0.1",
            f"--ServerApp.port={port}", f"--IdentityProvider.token={token}",
            f"--ServerApp.root_dir={notebooks}", "--LabServerApp.extension_manager=readonly",
            "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate", "--LabApp.news_url=None",
            # window.jupyterapp: the page opens each notebook as the file browser does
            "--LabApp.expose_app_in_browser=True"]
    if hasattr(os, "getuid") and os.getuid() == 0:
        argv.append("--allow-root")
    with child_server(argv, port, log=tmp / "lab.log", env=env, cwd=notebooks, timeout=300,
                      poll=0.3):
        yield f"http://127.0.0.1:{port}", token, notebooks


def _block_outside(page, allowed: str, outside: list[str]) -> None:
    """Fail (abort and record) every request of ``page`` that does not start with ``allowed``."""
    def route(r):
        url = r.request.url
        if url.startswith((allowed, "data:", "blob:")):
            r.continue_()
        else:
            outside.append(url)
            r.abort()
    page.route("**/*", route)


# Per Bokeh figure on show: the notebook cell it is in (index over all cells, through shadow
# roots), its size, the output area's width, the share of its data area's pixels that differ
# from the commonest colour, its title's width and the room for it, and a hash of its canvas.
_PLOTS = """() => {
  const cells = [...document.querySelectorAll('.jp-Notebook .jp-Cell')]
  const cellOf = el => {
    let node = el
    while (node != null) {
      const cell = node.closest ? node.closest('.jp-Cell') : null
      if (cell != null) return cell
      const root = node.getRootNode()
      node = root && root.host ? root.host : null
    }
    return null
  }
  if (window.Bokeh == null || Bokeh.index == null) return []
  const out = []
  for (const v of Bokeh.index.all_views()) {
    if (!(v.model.type === 'Figure' || v.model.type === 'Plot') || !v.el.isConnected) continue
    const cell = cellOf(v.el)
    const area = cell != null ? cell.querySelector('.jp-OutputArea-output') : null
    const frame = v.frame.bbox, cv = v.canvas_view, canvas = cv.primary.canvas
    let ink = 0
    const r = canvas.width / Math.max(1, cv.bbox.width)
    const x = Math.max(0, Math.floor(frame.left * r)), y = Math.max(0, Math.floor(frame.top * r))
    const w = Math.min(canvas.width - x, Math.floor(frame.width * r))
    const h = Math.min(canvas.height - y, Math.floor(frame.height * r))
    if (w > 0 && h > 0) {
      const data = canvas.getContext('2d').getImageData(x, y, w, h).data
      const counts = new Map()
      for (let i = 0; i < data.length; i += 4) {
        const key = (data[i] << 24) | (data[i + 1] << 16) | (data[i + 2] << 8) | data[i + 3]
        counts.set(key, (counts.get(key) || 0) + 1)
      }
      ink = 1 - Math.max(...counts.values()) / (w * h)
    }
    const {text, tw, room} = (""" + TITLE_FIT + """)(v)
    const box = v.el.getBoundingClientRect()
    const areaBox = area != null ? area.getBoundingClientRect() : null
    out.push({cell: cell != null ? cells.indexOf(cell) : -1, id: v.model.id, title: text,
              title_width: tw, title_room: room, width: Math.round(box.width),
              right: Math.round(box.right), area_right: areaBox ? Math.round(areaBox.right) : null,
              area_width: areaBox ? Math.round(areaBox.width) : null,
              area_overflow: area != null ? area.scrollWidth - area.clientWidth : null,
              ink, image: canvas.toDataURL()})
  }
  return out
}"""


def _plots(page) -> list[dict]:
    plots = page.evaluate(_PLOTS)
    for p in plots:
        p["image"] = hashlib.sha1(p["image"].encode()).hexdigest()
    return plots


def _prompts(page) -> list[str]:
    return page.eval_on_selector_all(".jp-Notebook .jp-CodeCell .jp-InputPrompt",
                                     "els => els.map(e => e.innerText.trim())")


def _kernels(lab, name: str) -> list[dict]:
    """The kernel of ``name``'s session as the Lab's server has it (none or one)."""
    base, token, _ = lab
    request = urllib.request.Request(f"{base}/api/sessions", headers={"Authorization": f"token {token}"})
    with urllib.request.urlopen(request) as r:
        sessions = json.load(r)
    return [s["kernel"] for s in sessions if s.get("path") == name and s.get("kernel")]


def _kernel_state(lab, name: str) -> str | None:
    """The execution state of the kernel of ``name``'s session, as the Lab's server has it."""
    states = [k["execution_state"] for k in _kernels(lab, name)]
    return states[0] if states else None


# the kernel as the page has it: the status bar reads "Python 3 (ipykernel) | Idle" once the
# page is connected to it (the notebook's execution indicator reads idle before that)
_STATUS_BAR = "() => [...document.querySelectorAll('.jp-StatusBar-TextItem')].map(e => e.innerText).join(' ')"


def _run_all(page, lab, name: str, timeout: float) -> float:
    """Run all cells from the Lab's Run menu once the kernel is idle, for the server and in
    the page; seconds until every code cell has an execution count."""
    select = page.locator(".jp-Dialog button.jp-mod-accept")  # "Select Kernel", if it asks
    deadline = time.time() + 240
    while not ("| Idle" in page.evaluate(_STATUS_BAR) and _kernel_state(lab, name) == "idle"):
        if select.count():
            select.first.click()
        assert time.time() < deadline, (f"the notebook's kernel was not idle after 240 s: "
                                        f"{page.evaluate(_STATUS_BAR)!r}, {_kernel_state(lab, name)}")
        page.wait_for_timeout(200)
    start = time.time()
    started = False
    for attempt in range(3):
        if select.count():
            select.first.click()
        page.locator(".jp-Notebook .jp-Cell").first.click()  # the notebook is the Lab's current widget
        page.get_by_role("menuitem", name="Run", exact=True).click()
        page.locator("li[data-command='runmenu:run-all']").click()
        for _ in range(60):
            if any(p != "[ ]:" for p in _prompts(page)):
                started = True
                break
            page.wait_for_timeout(500)
        if started:
            break
    if not started:
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "lab_not_started.png"))
        raise AssertionError("Run > Run All Cells started no cell (see lab_not_started.png)")
    stalled_since = None
    while True:
        prompts = _prompts(page)
        if prompts and all(p[1:-2].strip().isdigit() for p in prompts):
            return time.time() - start
        # cells left unrun while none runs or waits and the kernel is idle: the run stopped
        if "[*]:" not in prompts and _kernel_state(lab, name) == "idle":
            stalled_since = stalled_since or time.time()
            assert time.time() - stalled_since < 10, f"Run All stopped with cells unrun: {prompts}"
        else:
            stalled_since = None
        errors = page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']")
        traceback = page.locator(".jp-RenderedText[data-mime-type='application/vnd.jupyter.error']")
        if traceback.count():
            raise AssertionError(f"a cell failed: {traceback.first.inner_text()[-1500:]}")
        if time.time() - start > timeout:
            raise AssertionError(f"cells not done after {timeout} s: {prompts}; "
                                 f"stderr: {[e.inner_text()[-300:] for e in errors.all()[:3]]}")
        page.wait_for_timeout(500)


def _drawn(page, view_cells: list[int], timeout: float = 120) -> list[dict]:
    """The plots once every view cell has a figure with ink and the images stop changing."""
    deadline = time.time() + timeout
    last, since = None, time.time()
    while True:
        plots = _plots(page)
        cells = {p["cell"] for p in plots if p["ink"] > 0.005}
        key = json.dumps(sorted((p["id"], p["image"]) for p in plots))
        if key != last:
            last, since = key, time.time()
        if set(view_cells) <= cells and time.time() - since > 2:
            return plots
        if time.time() > deadline:
            return plots
        page.wait_for_timeout(500)


class LabTab:
    """One browser tab on the Lab (a workspace of its own), in which the notebooks open one
    after another, as a person opens them from the file browser: the Lab's page loads once.
    ``outside`` collects the requests to any other host (they fail)."""

    def __init__(self, browser, lab):
        self.browser, self.lab = browser, lab
        self.page = None
        self.outside: list[str] = []

    def open(self, name: str):
        """The tab with ``name`` open and its cells laid out (no other notebook open)."""
        base, token, _ = self.lab
        if self.page is None:
            self.page = self.browser.new_page(viewport=VIEWPORT)
            _block_outside(self.page, base, self.outside)
            self.page.goto(f"{base}/lab/workspaces/notebooks?token={token}", timeout=180_000)
            self.page.wait_for_function("() => window.jupyterapp != null && jupyterapp.shell != null"
                                        " && jupyterapp.serviceManager.isReady", timeout=180_000)
            self.page.wait_for_selector(".jp-DirListing-item", timeout=180_000)
        self.outside.clear()
        self.page.evaluate("async name => { await jupyterapp.commands.execute('docmanager:open', "
                           "{path: name}) }", name)
        self.page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=180_000)
        return self.page

    def close_notebooks(self) -> None:
        """Close every document tab without asking (its kernel is stopped by the server)."""
        if self.page is not None:
            self.page.evaluate("() => { for (const w of [...jupyterapp.shell.widgets('main')]) "
                               "if (w.context != null) w.dispose() }")
            self.page.wait_for_selector(".jp-Notebook", state="detached", timeout=30_000)

    def close(self) -> None:
        if self.page is not None:
            self.page.close()
            self.page = None


@pytest.fixture(scope="module")
def lab_tab(browser, lab):
    """The `LabTab` the module's notebooks open in."""
    tab = LabTab(browser, lab)
    yield tab
    tab.close()


def _shut_down_kernels(lab) -> None:
    """Stop every kernel the Lab runs (one notebook's kernel at a time keeps the load low)."""
    base, token, _ = lab
    headers = {"Authorization": f"token {token}"}
    with urllib.request.urlopen(urllib.request.Request(f"{base}/api/kernels", headers=headers)) as r:
        kernels = json.load(r)
    for kernel in kernels:
        urllib.request.urlopen(urllib.request.Request(f"{base}/api/kernels/{kernel['id']}",
                                                      method="DELETE", headers=headers)).close()


def check_in_lab(tab: LabTab, name: str) -> None:
    """Open ``name`` in the Lab's tab, run all its cells, check its views (`_check_notebook`);
    it is closed and its kernel stopped afterwards, whatever the outcome (after a failure the
    next notebook gets a fresh tab)."""
    opened = time.time()
    try:
        page = tab.open(name)
        _check_notebook(page, tab.lab, name, tab.outside, open_s=time.time() - opened)
        tab.close_notebooks()
    except BaseException:
        if tab.page is not None:
            ARTIFACTS.mkdir(exist_ok=True)
            tab.page.screenshot(path=str(ARTIFACTS / f"lab_{name.removesuffix('.ipynb')}_failed.png"))
        tab.close()
        raise
    finally:
        _shut_down_kernels(tab.lab)


def _saved(page, lab, name: str, timeout: float = 60) -> dict:
    """The notebook as the Lab saves it from its File menu, outputs included (JSON)."""
    _, _, folder = lab
    path = folder / name
    before = path.stat().st_mtime_ns
    page.get_by_role("menuitem", name="File", exact=True).click()
    page.locator("li[data-command='docmanager:save']").click()
    deadline = time.time() + timeout
    while True:
        if path.stat().st_mtime_ns != before:
            try:
                return json.loads(path.read_text(encoding="utf-8"))
            except json.JSONDecodeError:        # read while the Lab writes it
                pass
        assert time.time() < deadline, f"the Lab did not save {name} in {timeout} s"
        page.wait_for_timeout(250)


def _kernel_value(lab, name: str, expression: str) -> str:
    """``repr(expression)`` evaluated in the kernel of ``name``'s session, through a client of
    its own (the connection file in the Lab's runtime folder); the error's words if it fails."""
    from jupyter_client import BlockingKernelClient

    notebooks = lab[2]
    try:
        (kernel,) = [k["id"] for k in _kernels(lab, name)]
        client = BlockingKernelClient(
            connection_file=str(notebooks.parent / "runtime" / f"kernel-{kernel}.json"))
        client.load_connection_file()
        client.start_channels()
        try:
            reply = client.execute_interactive("", user_expressions={"v": expression}, timeout=30)
        finally:
            client.stop_channels()
        got = reply["content"]["user_expressions"]["v"]
        return got.get("data", {}).get("text/plain", str(got))
    except Exception as exc:  # noqa: BLE001 - a report for a failure message, not a check
        return f"(not read: {type(exc).__name__}: {exc})"


def _check_notebook(page, lab, name: str, outside: list[str], open_s: float) -> None:
    phases = {"open_s": open_s}
    mark = time.time()
    seconds = _run_all(page, lab, name, RUN_TIMEOUT)
    phases["kernel_and_run_s"], mark = time.time() - mark, time.time()
    plots = _drawn(page, VIEW_CELLS[name])
    phases["drawn_s"], mark = time.time() - mark, time.time()
    check_outputs(_saved(page, lab, name), name)    # no error, the outputs its text promises
    phases["saved_s"], mark = time.time() - mark, time.time()
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"lab_{name.removesuffix('.ipynb')}.png"), full_page=True)
    drawn = sorted({p["cell"] for p in plots if p["ink"] > 0.005})
    assert drawn == VIEW_CELLS[name], f"cells with a drawn plot {drawn}, expected {VIEW_CELLS[name]}"
    for p in plots:
        if p["cell"] not in VIEW_CELLS[name]:
            continue
        assert p["right"] <= p["area_right"] + 1, f"plot {p['title']!r} runs past the output area: {p}"
        assert p["area_overflow"] <= 1, f"cell {p['cell']} scrolls sideways: {p}"
        assert title_fits(p), f"title {p['title']!r} is clipped: {p}"
    assert not outside, f"requests left the Lab: {outside[:5]}"
    for cell in VIEW_CELLS[name]:  # each view's output as a reader sees it
        output = page.locator(".jp-Notebook .jp-Cell").nth(cell).locator(".jp-OutputArea")
        output.scroll_into_view_if_needed()
        output.screenshot(path=str(ARTIFACTS / f"lab_{name.removesuffix('.ipynb')}_cell{cell}.png"))
    phases["screenshots_s"] = time.time() - mark
    record = {"notebook": name, "run_all_cells_s": round(seconds, 1), "view_cells_drawn": len(drawn),
              "figures": len(plots), "output_area_px": plots[0]["area_width"],
              **{k: round(v, 1) for k, v in phases.items()}}
    print(f"{name}: all cells ran in {seconds:.1f} s, {len(drawn)} view cells drew "
          f"({len(plots)} figures, output area {plots[0]['area_width']} px)")
    if name in ROUND_TRIP:
        cell, key, value = ROUND_TRIP[name]
        before = {p["image"] for p in plots if p["cell"] == cell}
        handle = page.locator(".jp-Notebook .jp-Cell").nth(cell).locator(".noUi-handle").first
        handle.scroll_into_view_if_needed()
        console: list[str] = []
        listeners = {"console": lambda m: console.append(f"{m.type}: {m.text[:200]}"),
                     "pageerror": lambda e: console.append(f"error: {str(e)[:200]}")}
        for event, listener in listeners.items():
            page.on(event, listener)
        handle.focus()
        handle.press(key)
        start, deadline = time.time(), time.time() + 240
        while True:
            now = {p["image"] for p in _plots(page) if p["cell"] == cell}
            if now and now != before:
                break
            if time.time() > deadline:
                raise AssertionError(f"moving the slider in cell {cell} changed no plot; the kernel "
                                     f"has {value} = {_kernel_value(lab, name, value)}; the page's "
                                     f"console: {console[-10:]}")
            page.wait_for_timeout(500)
        for event, listener in listeners.items():
            page.remove_listener(event, listener)
        record["redraw_after_key_s"] = round(time.time() - start, 1)
        print(f"{name}: the plot in cell {cell} redrew {time.time() - start:.1f} s after the key press")
        page.screenshot(path=str(ARTIFACTS / f"lab_{name.removesuffix('.ipynb')}_moved.png"))
        assert not outside, f"after the widget change the page requested {sorted(set(outside))[:5]}"
    # what was measured, for a look after the run (test-artifacts/ is not tracked)
    (ARTIFACTS / f"lab_{name.removesuffix('.ipynb')}.json").write_text(json.dumps(record))


def check_exported_html(browser, tmp_path) -> None:
    """dynamics.ipynb executed and exported with nbconvert: its four plots draw in a page that
    can load nothing but the file."""
    pytest.importorskip("nbconvert")
    shutil.copy(EXAMPLES / "dynamics.ipynb", tmp_path)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    subprocess.run([sys.executable, "-m", "jupyter", "nbconvert", "--to", "html", "--execute",
                    "--ExecutePreprocessor.timeout=600", "dynamics.ipynb",
                    # the template's own MathJax and require.js (the notebook needs neither)
                    "--HTMLExporter.mathjax_url=", "--HTMLExporter.require_js_url="],
                   cwd=tmp_path, env=env, check=True, capture_output=True)
    html = tmp_path / "dynamics.html"
    page = browser.new_page(viewport=VIEWPORT)
    outside: list[str] = []
    _block_outside(page, "file://", outside)
    page.goto(html.as_uri(), timeout=180_000)
    deadline = time.time() + 120
    while True:
        inked = [p for p in page.evaluate(_PLOTS) if p["ink"] > 0.005]
        if len(inked) >= 4 or time.time() > deadline:
            break
        page.wait_for_timeout(500)
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "html_dynamics.png"), full_page=True)
    assert sorted(p["title"] for p in inked) == sorted(
        ["Automaton size", "Generalisation", "In-context loss", "Task decodability (layer 1)"]), inked
    assert not outside, f"the exported page requested {outside[:5]}"
    page.close()
