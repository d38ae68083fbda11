"""The base of every page: status, busy, error, progress, named runners, posting, closing, serving.

A page is a `View`: its state lives in Parameters, its plots are pure functions of that state,
and its slow work runs in named `Runner`s (`View.runner`) off the server's event loop. A job
never touches the page itself: its return value reaches the runner's ``on_result`` on the
session's event loop, and what it reports on the way (`View.post`, `View.progress_fn`,
`View.status_reporter`) is applied there too, at the document's next tick. A failed job shows in
the error parameter, the status line and a notification (`View.show_error`); `View.close` stops
every runner and empties the page's caches (`apps._page_cache.PageCaches`, a base of `View`;
the gallery calls it when the session goes). A pasted item of the user's comes in through
`View.adopt_own`. `serve` is the standalone footer of a page module. docs/views.md describes
the pattern.

Reproducibility: `View.export_datasets` (default: every Dataset / DataArray the view holds in
its parameters), `View.export_tables` (the view's DataFrames and its Datasets' 1-D / 2-D
variables), `View.export_bytes` (a zip: one NetCDF per Dataset, a CSV per table, the snippet and
a manifest JSON; nothing pickled) and `View.code_snippet` (Python that recomputes what the page
shows with the library API: `apps._recipe.render` of the page's `View.code_recipe`, the records
of its calls, which pages override with their own).
"""
from __future__ import annotations

import html
import io
import json
import math
import os
import sys
import time
import zipfile
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

import numpy as np
import pandas as pd
import panel as pn
import param
import xarray as xr

from apps import theme
from apps._job_status import JobStatus
from apps._page_cache import PageCaches
from apps._provenance import ShownResult
from apps._recipe import Let, Note, Recipe, render
from apps._session import (CancelToken, Runner, jobs_running, schedule, served_document,
                           user_message)
from explorer._checks import InputError
from explorer.defaults import DEFAULT_MODEL
from explorer.interventions import Edit

__all__ = ["View", "Scope", "scope_line", "serve", "STATIC_TOOLS", "workspace_edits",
           "workspace_selection", "workspace_positions", "ZOOM_TOOLS", "netcdf_ready",
           "dataset_tables", "read_export", "EXPORT_FORMAT", "NETCDF_ENGINE", "JSON_ATTRS"]

EXPORT_FORMAT = "explorer-page-data"
"""The ``format`` field of an exported page's manifest."""

NETCDF_ENGINE = "scipy"
"""The NetCDF writer of the page exports (NetCDF 3, readable by every NetCDF library)."""

_TABLE_CELLS = 200_000  # a Dataset's variables beyond this many cells are not flattened to CSV

STATIC_TOOLS = ["save", "box_zoom", "reset"]
"""The toolbar of plots that are read rather than explored (no pan or wheel zoom)."""

ZOOM_TOOLS = theme.PLOT_TOOLS
"""The toolbar of the pages' zoomable plots."""

_DEFAULT = object()
_Item = TypeVar("_Item")


class Scope(NamedTuple):
    """What a page runs on and whether the workspace's edits apply to what it shows.

    ``on`` names the inputs, e.g. ``"your prompt"``, ``"task pairs: ioi, 8 pairs"``, ``"its own
    probe set"``; ``edits`` is ``"applied"`` or ``"not applicable: <why>"``.
    """

    on: str
    edits: str


class View(PageCaches, ShownResult, JobStatus, pn.viewable.Viewer):
    """A page of the explorer: the plumbing every view shares.

    Parameters
    ----------
    background : bool, optional
        Run jobs in worker threads (default when served) or inline (tests, notebooks).
    **params
        Initial values of the view's parameters.

    Subclasses set ``notify_title`` (the prefix of their notifications; None: the message
    alone) and ``failed_status`` (the status line after a failure, ``{message}`` filled in;
    None leaves the status as it is).
    """

    notify_title: str | None = "Page"
    failed_status: str | None = "Failed: {message}"
    kept_note = ""   # said after a failure while `result` is shown ("The previous grid is still shown.")
    wait_timeout: float | None = 600
    link_params: tuple[str, ...] = ()
    """The page's main settings, by Parameter name, that a link and an export carry."""

    status = param.String(default="", precedence=-1, doc="One line on what the page is doing or did.")
    busy = param.Boolean(default=False, precedence=-1,
                         doc="A job has run for a moment and is still running (shows the spinner).")
    running = param.Boolean(default=False, precedence=-1,
                            doc="A job the page waits on is in flight (set by the view when it "
                                "asks; cleared when it fails).")
    error = param.String(default="", precedence=-1, doc="Message of the last failure; '' after a good run.")
    progress = param.Integer(default=0, bounds=(0, 100), precedence=-1,
                             doc="Percent done of the job that reports progress.")
    progress_active = param.Boolean(default=False, precedence=-1,
                                    doc="A job is reporting progress and has not finished.")

    def __init__(self, *, background: bool | None = None, **params: Any):
        super().__init__(**params)
        doc = served_document()
        self._background = (doc is not None) if background is None else bool(background)
        self._doc = doc
        self._runners: dict[str, Runner] = {}
        self._busy_runners: set[str] = set()

    @property
    def model(self) -> Any:  # the page's explorer.Model (None on a page without one)
        return getattr(self, "_model", None)

    # -- runners -----------------------------------------------------------------------------
    def runner(self, name: str, on_result: Callable[[Any], None], *, busy: bool = True,
               progress: bool = False, heavy: bool | None = None,
               counted: bool = True) -> Runner:
        """A new runner called ``name`` whose results go to ``on_result`` on the page's loop.

        ``busy``: its jobs set `busy` while they run (after the runner's short delay).
        ``progress``: it reports progress, so the bar hides when its job ends.
        ``heavy`` (default: ``progress``): served, its jobs wait their turn in the server's
        queue of heavy jobs, and the status line shows their place in line meanwhile.
        ``counted``: served, its jobs light the sidebar's stop button (`Runner`'s ``counted``).
        Failures go to `show_error`. The runner stops when the session closes or at `close`.
        """
        def done(value: Any) -> None:
            if progress:
                self.progress_active = False
            on_result(value)

        r = Runner(on_result=done, on_error=self.show_error,
                   on_busy=(lambda b: self._runner_busy(name, b)) if busy else (lambda b: None),
                   background=self._background, doc=self._doc,
                   heavy=progress if heavy is None else heavy, on_place=self._queue_place,
                   counted=counted, on_stopped=lambda: self.job_stopped(name))
        r.bind_session()
        self._runners[name] = r
        return r

    def submit(self, name: str, job: Callable[[CancelToken], Any]) -> CancelToken | None:
        """Run ``job(token)`` on the runner ``name``; a job in flight there is superseded.

        Served, a job started while others run (this page's or another page's or session's:
        they share the worker threads and the model) says so after the page's status, since
        the time it announces then does not hold."""
        runner = self._runners[name]
        others = jobs_running() - (1 if runner.running else 0)
        token = runner.submit(job)
        shown = "shares the model" in self.status    # a page that posts no new status
        if token is not None and self._background and others > 0 and not shown:
            note = (f"(shares the model with {others} other job{'s' if others > 1 else ''} "
                    "running on this server: it takes longer)")
            self.status = f"{self.status} {note}" if self.status else note.strip("()").capitalize()
        return token

    def cancel(self, name: str | None = None) -> None:
        """Cancel the job in flight on runner ``name`` (default: on every runner)."""
        for key, r in self._runners.items():
            if name is None or key == name:
                r.cancel()

    def wait(self, timeout: Any = _DEFAULT) -> View:
        """Block until every runner's job has finished and delivered (tests, scripts)."""
        timeout = self.wait_timeout if timeout is _DEFAULT else timeout
        for r in list(self._runners.values()):
            r.wait(timeout)
        return self

    def close(self) -> None:
        """Cancel every job and refuse new ones, and empty the page's caches (the page is
        gone)."""
        for r in self._runners.values():
            r.close()
        self.forget()

    def run_once_loaded(self, request: Callable[[], Any]) -> None:
        """Call ``request`` now, or, served, once the browser has loaded the page (it runs at
        once if the page is already up). Until then ``self._page_loaded`` is False, and a page's
        requests return at once while it is: the changes made before the page is up (the
        gallery sets the prompt first) coalesce into its first run."""
        self._page_loaded = self._doc is None
        if self._page_loaded:
            request()
            return

        def loaded() -> None:
            self._page_loaded = True
            request()
        pn.state.onload(loaded)

    def bound_layer(self, name: str, value: int, n_layers: int) -> None:
        """Bound the layer Parameter ``name`` to the model's ``n_layers`` layers, then set it
        to ``value`` (a page takes it out of its ``params`` before `View.__init__`, where the
        bounds are not known yet, so a value past the model's layers is refused here)."""
        self.param[name].bounds = (0, n_layers - 1)
        setattr(self, name, value)

    def progress_bar(self, **options: Any) -> pn.indicators.Progress:
        """The page's progress bar: it follows `progress` and shows while `progress_active`
        (``options`` go to the widget, e.g. ``height``, ``margin`` or another ``visible``)."""
        options = {"sizing_mode": "stretch_width", "visible": self.param.progress_active, **options}
        return pn.indicators.Progress(value=self.param.progress, max=100, **options)

    def status_text(self, css_class: str) -> pn.pane.HTML:
        """The page's status line as plain grey text (escaped: a file name or a prompt in it
        stays text), following `status`."""
        return pn.pane.HTML(pn.bind(html.escape, self.param.status), css_classes=[css_class],
                            styles={"color": "#555"}, sizing_mode="stretch_width")

    def _runner_busy(self, name: str, busy: bool) -> None:
        if busy:
            self._busy_runners.add(name)
        else:
            self._busy_runners.discard(name)
        busy = bool(self._busy_runners)
        if self.busy != busy:
            self.busy = busy

    # -- from a job to the page ----------------------------------------------------------------
    def schedule(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the session's event loop at the document's next tick; right here when
        not served or when jobs run inline (their results arrive at once, so must their posts)."""
        schedule(self._doc if self._background else None, fn)

    def post(self, **values: Any) -> None:
        """Set parameters from any thread: on the session's document at its next tick."""
        self.schedule(lambda: self.param.update(**values))

    def progress_fn(self, token: CancelToken | None = None, *, lo: int = 0,
                    hi: int = 100) -> Callable[[int, int], None]:
        """A ``progress(done, total)`` callback for an analysis: posts `progress` (``done/total``
        mapped onto ``lo``..``hi`` percent) and `progress_active`; with ``token``, it raises
        `Cancelled` once the job is cancelled."""
        def report(done: int, total: int) -> None:
            if token is not None:
                token.check()
            self.post(progress=int(lo + (hi - lo) * done / max(1, total)), progress_active=done < total)
        return report

    def status_reporter(self, token: CancelToken, message: Callable[[int, int, float], str], *,
                        every: float = 0.5) -> Callable[[int, int], bool]:
        """A ``progress(done, total) -> bool`` callback that posts ``message(done, total,
        seconds)`` as the status at most every ``every`` seconds (and at the end), and returns
        False once the job is cancelled (the training loops stop then)."""
        started = time.perf_counter()
        last = [0.0]

        def report(done: int, total: int) -> bool:
            now = time.perf_counter()
            if now - last[0] > every or done == total:
                last[0] = now
                self.post(status=message(done, total, now - started))
            return not token.cancelled
        return report

    # -- what every page shows ----------------------------------------------------------------
    def busy_spinner(self) -> pn.indicators.LoadingSpinner:
        """The spinner that turns while a job of this page runs (`busy`), hidden otherwise."""
        return pn.indicators.LoadingSpinner(value=self.param.busy, visible=self.param.busy,
                                            size=theme.SIZES["spinner"], color="primary")

    def scope(self) -> Scope | None:
        """What the page runs on and whether the workspace's edits apply (its header line).
        Pages override it; None: the page states no scope."""
        return None

    def scope_pane(self) -> pn.pane.Markdown:
        """The page's header line, "on: … · edits: …" (`scope`), following its parameters;
        empty for a page that states no scope."""
        names = [n for n in self.param if n != "name"]
        return pn.pane.Markdown(pn.bind(lambda *_: scope_line(self), *[self.param[n] for n in names]),
                                css_classes=["page-scope"], sizing_mode="stretch_width",
                                margin=(0, 10), styles={"color": "#444", "font-size": "0.9em"})

    # -- errors -----------------------------------------------------------------------------------
    def show_error(self, exc: BaseException) -> None:
        """Show a failure: `error`, the status line (``failed_status``) and a notification."""
        message = user_message(exc)
        values: dict[str, Any] = {"error": message, "running": False, "progress_active": False}
        if self.failed_status is not None:
            values["status"] = self.failed_status.format(message=message)
        self.param.update(**values)
        text = message + self._error_note()
        theme.notify("error", f"{self.notify_title}: {text}" if self.notify_title else text,
                     source=self.notify_title, fault=text)

    def adopt_own(self, text: str, parse: Callable[[str], _Item],
                  use: Callable[[_Item], Any]) -> _Item | None:
        """Take in an item the user pasted (the Use button of a page's own-items box).

        Parameters
        ----------
        text : str
            The pasted text.
        parse : callable
            The page's parser (one of `explorer.analyses.user_items`): ``parse(text)`` is the
            item, or raises `InputError` with a one-line message.
        use : callable
            ``use(item)`` takes the item in (the page's options) and starts what the page
            shows of it; it runs after `error` is cleared, so a failure of its job shows.

        Returns
        -------
        item or None
            The parsed item; None when ``text`` is refused: the message shows (`show_error`)
            and the page's result stays as it is.
        """
        try:
            item = parse(text)
        except InputError as exc:
            self.show_error(exc)
            return None
        self.error = ""
        use(item)
        return item

    def _error_note(self) -> str:
        """Text added to a failure's notification: ``kept_note`` while the last result shows."""
        return f" {self.kept_note}" if self.kept_note and getattr(self, "result", None) is not None else ""

    # -- reproducibility ------------------------------------------------------------------------
    def export_datasets(self) -> dict[str, xr.Dataset]:
        """The Datasets behind what the page shows, by name. Default: every parameter holding
        an xarray Dataset (a DataArray becomes a one-variable Dataset), and those in a dict
        parameter (named ``<parameter>_<key>``). Pages may override."""
        out: dict[str, xr.Dataset] = {}
        for name, value in self.param.values().items():
            if isinstance(value, xr.DataArray):
                value = value.to_dataset(name=value.name if value.name is not None else name)
            if isinstance(value, xr.Dataset):
                out[name] = value
            elif isinstance(value, dict):                # e.g. one run per setting
                for key, item in value.items():
                    if isinstance(item, xr.DataArray):
                        item = item.to_dataset(name=item.name if item.name is not None else name)
                    if isinstance(item, xr.Dataset):
                        out[f"{name}_{key}"] = item
        return out

    def export_tables(self) -> dict[str, pd.DataFrame]:
        """The page's tables, by name: every DataFrame parameter, then its Datasets' 1-D / 2-D
        variables flattened (`dataset_tables`). Pages may override."""
        out = {name: value for name, value in self.param.values().items()
               if isinstance(value, pd.DataFrame)}
        for name, ds in self.export_datasets().items():
            for key, table in dataset_tables(ds, name).items():
                out.setdefault(key, table)
        return out

    def export_manifest(self) -> dict[str, Any]:
        """What the export holds and where it came from: page, model, prompt, parameters,
        versions."""
        import explorer

        spec = getattr(self.model, "spec", None)
        params = {}
        for name, p in self.param.objects("existing").items():
            if name == "name" or p.precedence is not None and p.precedence < 0:
                continue
            value = getattr(self, name)
            if isinstance(value, (str, int, float, bool)) or value is None:
                params[name] = value if not (isinstance(value, float) and not math.isfinite(value)) else str(value)
            elif isinstance(value, (list, tuple)) and all(isinstance(v, (str, int, float, bool)) for v in value):
                params[name] = list(value)
        return {"format": EXPORT_FORMAT, "version": 1, "page": type(self).__name__,
                "module": type(self).__module__,
                "model": getattr(spec, "name", None), "prompt": getattr(self, "prompt", None),
                "parameters": params,
                **({"provenance": shown.to_dict()} if (shown := self.shown_provenance())
                   is not None else {}),
                "versions": {"explorer": getattr(explorer, "__version__", None),
                             "xarray": xr.__version__, "numpy": np.__version__,
                             "pandas": pd.__version__},
                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}

    def export_bytes(self, fmt: str = "netcdf", *, extra: dict[str, Any] | None = None) -> bytes:
        """The page's data as one zip: ``<name>.nc`` per Dataset (``fmt="netcdf"``, the scipy
        engine) or ``<name>.zarr/`` (``fmt="zarr"``), ``<name>.csv`` per table, ``code.py``
        (`code_snippet`) and ``manifest.json`` (`export_manifest`, updated with ``extra``).
        Attributes NetCDF cannot store are written as JSON strings (`netcdf_ready`)."""
        if fmt not in ("netcdf", "zarr"):
            raise ValueError(f"fmt must be 'netcdf' or 'zarr', not {fmt!r}.")
        manifest = {**self.export_manifest(), **(extra or {})}
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
            files: dict[str, list[str]] = {"datasets": [], "tables": []}
            for name, ds in self.export_datasets().items():
                ready = netcdf_ready(ds)
                if fmt == "netcdf":
                    path = f"{_safe_name(name)}.nc"
                    zf.writestr(path, ready.to_netcdf(engine=NETCDF_ENGINE))
                else:
                    path = f"{_safe_name(name)}.zarr"
                    _zarr_into(zf, ready, path)
                files["datasets"].append(path)
            for name, table in self.export_tables().items():
                path = f"{_safe_name(name)}.csv"
                zf.writestr(path, table.to_csv(index=False))
                files["tables"].append(path)
            try:
                code = self.code_snippet()
            except Exception as exc:  # noqa: BLE001 - the data export must not fail on it
                code = f"# the page could not write its snippet: {exc}\n"
            zf.writestr("code.py", code)
            manifest.update(files, code="code.py",
                            netcdf_engine=NETCDF_ENGINE if fmt == "netcdf" else None)
            zf.writestr("manifest.json", json.dumps(manifest, indent=2, default=str))
        return buf.getvalue()

    def code_snippet(self) -> str:
        """Python that recomputes what the page shows with the library API: its
        `code_recipe` written by `apps._recipe.render`."""
        return render(self.code_recipe())

    def code_recipe(self) -> Recipe:
        """What the page computes, as records (`apps._recipe`). Default: load the model,
        import the library functions and analysis modules the page's module uses, and its
        settings; pages override it with their real calls."""
        name = getattr(getattr(self.model, "spec", None), "name", None)
        module = sys.modules.get(type(self).__module__)
        imports, aliases = ["explorer"], {}
        for attr, value in sorted(vars(module).items()) if module is not None else []:
            if attr.startswith("_") or attr in ("model", "prompt", "params", "edits"):
                continue
            if isinstance(value, type(sys)):
                path = value.__name__
                if not path.startswith("explorer.analyses."):
                    continue
            else:
                where = getattr(value, "__module__", None) or ""
                if (not callable(value) or isinstance(value, type)
                        or not where.startswith("explorer.")
                        or where.startswith(("explorer._", "explorer.components"))):
                    continue
                path = f"{where}.{getattr(value, '__name__', attr)}"
            imports.append(path)
            if attr != path.rpartition(".")[2]:
                aliases[path] = attr
        prompt = getattr(self, "prompt", None)
        params = {k: v for k, v in self.export_manifest()["parameters"].items() if k != "prompt"}
        path = (module.__name__.replace(".", "/") + ".py") if module is not None else "its module"
        steps: list[Any] = [Let("params", params, "the page's settings")] if params else []
        steps.append(Note(f"{type(self).__name__} is built on the calls imported above; {path} "
                          "shows how it makes them."))
        return Recipe(model=name, imports=imports, aliases=aliases, steps=steps,
                      inputs={"prompt": prompt} if isinstance(prompt, str) else {})

# -- the workspace's lists a page follows (the gallery keeps them equal to the workspace's) ----

def workspace_edits(*, doc: str) -> param.List:
    """A page's ``edits`` Parameter: the workspace's edit stack (intervention records);
    ``doc`` says what they change on the page."""
    return param.List(default=[], item_type=Edit, precedence=-1, doc=doc)


def workspace_selection(*, doc: str) -> param.List:
    """A page's ``highlighted`` Parameter: the workspace's selected components (``L3.H1``)."""
    return param.List(default=[], item_type=str, precedence=-1, doc=doc)


def workspace_positions(*, doc: str) -> param.List:
    """A page's ``selected_positions`` Parameter: the workspace's selected token positions (0-based)."""
    return param.List(default=[], item_type=int, precedence=-1, doc=doc)


def shown_dataset(*, doc: str | None = None) -> param.ClassSelector:
    """A page's Parameter for a Dataset it shows or draws from (``result`` and the like; None
    before the first run); ``doc`` says what it holds."""
    return param.ClassSelector(class_=xr.Dataset, default=None, allow_None=True, precedence=-1,
                               doc=doc)


def run_seconds(*, doc: str) -> param.Number:
    """A page's ``seconds`` Parameter: how long its last run took (None before the first);
    ``doc`` says from what to what."""
    return param.Number(default=None, allow_None=True, precedence=-1, doc=doc)


def scope_line(view: Any) -> str:
    """The header line of ``view``'s scope, "**on:** your prompt · **edits:** applied";
    '' when the view states none (or has no `View.scope`)."""
    scope = getattr(view, "scope", None)
    s = scope() if callable(scope) else None
    return "" if s is None else f"**on:** {s.on} · **edits:** {s.edits}"


# -- export helpers ---------------------------------------------------------------------------

def _safe_name(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in str(name)) or "data"


def _attr_ok(value: Any) -> bool:
    """Whether NetCDF 3 stores the attribute as it is (strings, numbers, 1-D numeric arrays)."""
    if isinstance(value, str):
        return True
    if isinstance(value, (bool, np.bool_)):
        return False                                   # NetCDF has no booleans
    if isinstance(value, (int, np.integer)):
        return -2**31 <= int(value) < 2**31
    if isinstance(value, (float, np.floating)):
        return True
    if isinstance(value, (list, tuple, np.ndarray)):
        arr = np.asarray(value)
        return arr.ndim == 1 and arr.size > 0 and (arr.dtype.kind == "f" or (
            arr.dtype.kind in "iu" and -2**31 <= arr.min() and arr.max() < 2**31))
    return False


def _json_attr(value: Any) -> str:
    def default(v: Any) -> Any:
        if isinstance(v, np.generic):
            return v.item()
        if isinstance(v, np.ndarray):
            return v.tolist()
        return str(v)
    return json.dumps(value, default=default)


JSON_ATTRS = "explorer_json_attrs"
"""The attribute listing (as JSON) the attributes `netcdf_ready` wrote as JSON strings."""


def _ready_attrs(attrs: dict[Any, Any]) -> dict[str, Any]:
    out = {str(k): (v if _attr_ok(v) else _json_attr(v)) for k, v in attrs.items()}
    encoded = [str(k) for k, v in attrs.items() if not _attr_ok(v)]
    if encoded:
        out[JSON_ATTRS] = json.dumps(encoded)
    return out


def _restore_attrs(attrs: dict[str, Any]) -> dict[str, Any]:
    out = dict(attrs)
    for key in json.loads(out.pop(JSON_ATTRS, "[]")):
        if key in out:
            out[key] = json.loads(out[key])
    return out


def read_export(data: bytes) -> dict[str, Any]:
    """An `View.export_bytes` zip read back: ``{"manifest": dict, "datasets": {name: Dataset},
    "tables": {name: DataFrame}, "code": str}``; the attributes written as JSON are decoded
    (a dict comes back a dict, None None)."""
    out: dict[str, Any] = {"datasets": {}, "tables": {}}
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        out["manifest"] = json.loads(zf.read("manifest.json"))
        out["code"] = zf.read("code.py").decode()
        for path in out["manifest"]["datasets"]:
            if not path.endswith(".nc"):
                continue
            with xr.open_dataset(io.BytesIO(zf.read(path)), engine=NETCDF_ENGINE) as ds:
                ds = ds.load()
            ds.attrs = _restore_attrs(ds.attrs)
            for var in ds.variables.values():
                var.attrs = _restore_attrs(var.attrs)
            out["datasets"][path[:-3]] = ds
        for path in out["manifest"]["tables"]:
            out["tables"][path[:-4]] = pd.read_csv(io.BytesIO(zf.read(path)))
    return out


def _ready_values(var: xr.Variable) -> xr.Variable:
    kind = var.dtype.kind
    if var.dtype == np.float16:
        return var.astype(np.float32)
    if kind in "iu" and var.dtype.itemsize >= 4 and var.size:
        lo, hi = int(var.values.min()), int(var.values.max())
        if lo < -2**31 or hi >= 2**31:
            return var.astype(np.float64)              # NetCDF 3 stores 32-bit integers
    if kind == "O":
        values = var.values
        if all(isinstance(v, str) for v in values.ravel()):
            return var.astype(str)
        return var.copy(data=np.vectorize(_json_attr, otypes=[str])(values) if values.size
                        else values.astype(str))
    return var


def netcdf_ready(ds: xr.Dataset) -> xr.Dataset:
    """A copy of ``ds`` that NetCDF 3 (the scipy engine) can write without losing values:
    attributes it cannot hold (dicts, None, booleans, nested lists) become JSON strings,
    float16 becomes float32, integers beyond 32 bits become float64, object arrays strings,
    multi-indexes plain coordinates. Encodings are dropped."""
    out = ds.copy()
    for name in list(out.indexes):
        if isinstance(out.indexes[name], pd.MultiIndex):
            out = out.reset_index(name)
    out.attrs = _ready_attrs(out.attrs)
    for name in list(out.variables):
        var = out.variables[name]
        new = _ready_values(var)
        new.attrs = _ready_attrs(var.attrs)
        new.encoding = {}
        if name in out.coords:
            out = out.assign_coords({name: new})
        else:
            out[name] = new
    return out


def dataset_tables(ds: xr.Dataset, name: str) -> dict[str, pd.DataFrame]:
    """``ds``'s 1-D and 2-D data variables as long tables: one per set of dimensions (named
    ``name`` when there is one set, else ``name_<dims>``), a row per cell, coordinates as
    columns. Variables of more cells than a CSV stays readable with are left out."""
    groups: dict[tuple, list[str]] = {}
    for var, da in ds.data_vars.items():
        if 1 <= da.ndim <= 2 and da.size <= _TABLE_CELLS:
            groups.setdefault(tuple(sorted(da.dims)), []).append(str(var))
    out = {}
    for dims, names in groups.items():
        key = name if len(groups) == 1 else f"{name}_{'_'.join(map(str, dims))}"
        sub = ds[names]
        sub = sub.drop_vars([c for c in sub.coords if not set(sub[c].dims) <= set(dims)])
        out[key] = sub.to_dataframe().reset_index()
    return out


def _zarr_into(zf: zipfile.ZipFile, ds: xr.Dataset, prefix: str) -> None:
    """Write ``ds`` as a zarr store under ``prefix/`` inside ``zf``.

    Zarr format 2, as the activation store and ``explorer trace --out`` write: its
    specification covers the fixed-width unicode arrays that token and component labels
    are, so other zarr readers open the file (format 3 has no stable data type for them)."""
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "store.zarr"
        ds.to_zarr(path, mode="w", zarr_format=2)
        for f in sorted(path.rglob("*")):
            if f.is_file():
                zf.write(f, f"{prefix}/{f.relative_to(path).as_posix()}")


# -- the standalone page ------------------------------------------------------------------------

def serve(module: str, factory: Callable[[Any], pn.viewable.Viewable], *, title: str,
          model: bool = True, argv: list[str] | None = None, intro: str | None = None) -> None:
    """The footer of a page module: serve the page on its own.

    Call it at the end of the module with its ``__name__``. Under ``panel serve apps/X.py`` the
    page is made servable; under ``python -m apps.X [PORT]`` a server on 127.0.0.1:PORT (default
    5006) serves it until interrupted; on a plain import nothing happens. ``factory(model)``
    builds the view; ``model=True`` passes it the model named by ``$EXPLORER_MODEL`` (default
    smollm2-135m), else None. ``intro`` is the page's slug in `apps._intros.INTROS`: its few
    lines open the page, as they do in the gallery.
    """
    served = module.startswith("bokeh_app_")
    if not served and module != "__main__":
        return

    def page() -> pn.template.FastListTemplate:
        from apps._session import get_model

        theme.enable_extension()
        from apps._intros import intro_pane

        m = get_model(os.environ.get("EXPLORER_MODEL", DEFAULT_MODEL)) if model else None
        head = [intro_pane(intro)] if intro else []
        view = factory(m)
        if callable(getattr(view, "scope_pane", None)):
            head.append(view.scope_pane())
        return theme.page([*head, view], title=title)

    if served:
        page().servable()
        return
    args = sys.argv[1:] if argv is None else argv
    port = int(args[0]) if args else 5006
    pn.serve(page, port=port, address="127.0.0.1", show=False, title=title,
             websocket_origin=[f"127.0.0.1:{port}", f"localhost:{port}"], threaded=False)
