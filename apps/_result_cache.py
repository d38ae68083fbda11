"""The pages' result cache on disk: a job's result kept between sessions, keyed by its inputs.

A page job whose result is a deterministic function of its inputs stores that result under a
key made of the page's input record (`apps._provenance.Provenance`: model, prompts, edits,
method, request, settings), the model's identity (`explorer.ModelSpec.provenance`: name,
weights fingerprint, dtype, library versions), what else the page passes in ``extra`` (e.g.
the edits' full values, a seed), and the code's version (`code_version`: the package version
and a digest of the source of ``explorer`` and ``apps``, so a code change never serves an
old result). The next page opened on the same inputs shows the stored result at once
(`cached_note` says so) instead of running the job.

An entry is a folder ``<cache folder>/page-results/<key>/`` holding one NetCDF file per
Dataset (the page exports' writer, `apps._view.netcdf_ready`) and ``entry.json``: the key's
parts, small JSON values, when it was computed, and each file's size and BLAKE2b hash.
Nothing is pickled. Writes go to a temporary folder renamed into place; an entry that cannot
be read (damaged, truncated, an older layout) is logged as a warning, deleted and computed
again. The folder is bounded: after each write the entries used longest ago are deleted
until the rest fit in ``max_bytes`` (a read marks an entry used).

Environment: ``EXPLORER_RESULT_CACHE=off`` turns the cache off; ``EXPLORER_RESULT_CACHE_MB``
sets its size bound (default 512); the folder is under `explorer.models.cache_dir`.

`start_warmup` starts the warm-up child (`apps._result_warmup`) that fills the cache for the
cached pages' default inputs; ``explorer serve`` calls it once its server listens.
``EXPLORER_WARM_CACHE=off`` (or the cache off) keeps it from starting.
"""
from __future__ import annotations

import atexit
import functools
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

import xarray as xr

from apps._provenance import Provenance
from apps._view import NETCDF_ENGINE, _restore_attrs, netcdf_ready
from explorer._version import __version__
from explorer.models import cache_dir

__all__ = ["ResultCache", "Stored", "code_version", "cached_note", "ENV_VAR", "SIZE_ENV_VAR",
           "DEFAULT_MB", "result_cache", "DiskResults", "WARM_ENV_VAR", "warmup_wanted",
           "start_warmup"]

log = logging.getLogger(__name__)

ENV_VAR = "EXPLORER_RESULT_CACHE"
"""``off`` (or ``0``, ``no``, ``false``) turns the pages' result cache off."""
SIZE_ENV_VAR = "EXPLORER_RESULT_CACHE_MB"
"""The result cache's size bound in MiB (default `DEFAULT_MB`)."""
DEFAULT_MB = 512
WARM_ENV_VAR = "EXPLORER_WARM_CACHE"
"""``off`` (or ``0``, ``no``, ``false``) keeps ``explorer serve`` from warming the cache up."""

_FOLDER = "page-results"
_ENTRY = "entry.json"
_FORMAT = 1          # bump when an entry's layout changes; older entries then read as damaged
_TMP = ".tmp-"
_OFF = {"off", "0", "no", "false"}
_UNKEYED = ("computed_at", "metrics", "positions")   # a record's fields that are not inputs


class Stored(NamedTuple):
    """A stored result: its Datasets by name, its small JSON values, when it was computed
    (ISO 8601 UTC)."""

    datasets: dict[str, xr.Dataset]
    values: dict[str, Any]
    computed_at: str


@functools.lru_cache(maxsize=1)
def code_version() -> str:
    """The package version and a digest of every ``.py`` file of ``explorer`` and ``apps``
    (their paths and contents): any change of the code gives another version."""
    h = hashlib.blake2b(digest_size=12)
    root = Path(__file__).resolve().parent.parent
    for package in ("explorer", "apps"):
        for path in sorted((root / package).rglob("*.py")):
            h.update(str(path.relative_to(root)).encode())
            h.update(path.read_bytes())
    return f"{__version__}+{h.hexdigest()}"


def cached_note(computed_at: str) -> str:
    """The line a page shows over a result it read from the cache."""
    when = computed_at.replace("T", " ").rstrip("Z")[:16]
    return f"Shown from the result cache (computed {when} UTC on this machine)"


def _size_bound() -> int:
    text = os.environ.get(SIZE_ENV_VAR, "").strip()
    if not text:
        return DEFAULT_MB * 2**20
    try:
        mb = float(text)
    except ValueError:
        mb = -1.0
    if not mb > 0:
        raise ValueError(f"{SIZE_ENV_VAR}={text!r} is not a size; set it to a positive number "
                         "of MiB (e.g. 512) or unset it.")
    return int(mb * 2**20)


def result_cache() -> ResultCache | None:
    """The pages' result cache (`ResultCache` in the user's cache folder), or None when
    ``EXPLORER_RESULT_CACHE`` turns it off or the folder cannot be written."""
    if os.environ.get(ENV_VAR, "").strip().lower() in _OFF:
        return None
    try:
        return ResultCache(cache_dir() / _FOLDER, max_bytes=_size_bound())
    except OSError as err:
        log.warning("the result cache is off: %s", err)
        return None


def _file_hash(path: Path) -> str:
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(2**20), b""):
            h.update(block)
    return h.hexdigest()


def _json_value(value: Any) -> Any:
    """``value`` as the JSON a key is made from (tuples as lists; other types refused)."""
    return json.loads(json.dumps(value, sort_keys=True))


class ResultCache:
    """Results of page jobs on disk, one folder an entry (any thread or process).

    Parameters
    ----------
    folder : str or os.PathLike
        Where the entries live (made if missing).
    max_bytes : int
        Size bound: after a write, the entries used longest ago go until the rest fit.
    version : str, optional
        The code's version in every key (default `code_version`).
    """

    def __init__(self, folder: str | os.PathLike[str], *, max_bytes: int = DEFAULT_MB * 2**20,
                 version: str | None = None):
        if not max_bytes > 0:
            raise ValueError(f"max_bytes must be positive; got {max_bytes!r}.")
        self.folder = Path(folder).expanduser()
        self.folder.mkdir(parents=True, exist_ok=True)
        self.max_bytes = int(max_bytes)
        self.version = code_version() if version is None else str(version)

    def __repr__(self) -> str:
        return f"ResultCache({str(self.folder)!r}, max_bytes={self.max_bytes})"

    # -- keys ---------------------------------------------------------------------------------
    def parts(self, job: str, record: Provenance, model: Any,
              extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """What a key is made of: the job's name, its input ``record`` (without the time,
        metrics and outlined positions), ``model``'s identity, ``extra`` and the code's
        version."""
        rec = {k: v for k, v in record.to_dict().items() if k not in _UNKEYED}
        spec = getattr(model, "spec", model)
        return _json_value({"job": job, "record": rec, "model": spec.provenance(),
                            "extra": dict(extra or {}), "version": self.version})

    @staticmethod
    def key(parts: Mapping[str, Any]) -> str:
        text = json.dumps(parts, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:32]

    # -- read and write -------------------------------------------------------------------
    def get(self, parts: Mapping[str, Any]) -> Stored | None:
        """The entry of ``parts``, read into memory, or None (none stored; a damaged one is
        logged, deleted and read as none)."""
        entry = self.folder / self.key(parts)
        if not entry.exists():
            return None
        try:
            meta = json.loads((entry / _ENTRY).read_text())
            if meta.get("format") != _FORMAT or meta.get("parts") != parts:
                raise ValueError("its record is of another layout or other inputs")
            datasets = {}
            for name, info in meta["files"].items():
                path = entry / info["file"]
                if path.stat().st_size != info["size"] or _file_hash(path) != info["blake2b"]:
                    raise ValueError(f"{info['file']} does not match its size or hash")
                with xr.open_dataset(path, engine=NETCDF_ENGINE) as ds:
                    ds = ds.load()
                ds.attrs = _restore_attrs(ds.attrs)
                for var in ds.variables.values():
                    var.attrs = _restore_attrs(var.attrs)
                datasets[name] = ds
            stored = Stored(datasets, dict(meta.get("values", {})), str(meta["computed_at"]))
        except (OSError, ValueError, KeyError, TypeError) as err:
            log.warning("result cache entry %s cannot be read (%s); deleted, to be computed "
                        "again", entry.name, err)
            shutil.rmtree(entry, ignore_errors=True)
            return None
        os.utime(entry / _ENTRY)          # used now: the last to go when the cache is full
        return stored

    def put(self, parts: Mapping[str, Any], datasets: Mapping[str, xr.Dataset | None],
            values: Mapping[str, Any] | None = None, *, computed_at: str) -> bool:
        """Store ``datasets`` (None values skipped) and the JSON ``values`` under ``parts``;
        then delete the entries used longest ago until the cache fits its bound. False
        (logged) when it cannot be written: the page goes on without it."""
        key = self.key(parts)
        tmp = self.folder / f"{_TMP}{key}-{uuid.uuid4().hex[:8]}"
        try:
            tmp.mkdir()
            files = {}
            for i, (name, ds) in enumerate(datasets.items()):
                if ds is None:
                    continue
                file = f"{i}.nc"
                netcdf_ready(ds).to_netcdf(tmp / file, engine=NETCDF_ENGINE)
                files[name] = {"file": file, "size": (tmp / file).stat().st_size,
                               "blake2b": _file_hash(tmp / file)}
            meta = {"format": _FORMAT, "parts": parts, "files": files,
                    "values": _json_value(dict(values or {})), "computed_at": computed_at}
            (tmp / _ENTRY).write_text(json.dumps(meta, sort_keys=True))
            final = self.folder / key
            if final.exists():
                shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
        except (OSError, ValueError, TypeError) as err:
            log.warning("result cache: could not store entry %s (%s)", key, err)
            shutil.rmtree(tmp, ignore_errors=True)
            return False
        self.evict(keep=key)
        return True

    # -- bound --------------------------------------------------------------------------------
    def entries(self) -> list[tuple[float, int, Path]]:
        """(last used, bytes, folder) of every entry, used longest ago first."""
        out = []
        for entry in self.folder.iterdir():
            if entry.name.startswith(_TMP) or not entry.is_dir():
                continue
            try:
                used = (entry / _ENTRY).stat().st_mtime
                size = sum(f.stat().st_size for f in entry.iterdir())
            except OSError:
                used, size = 0.0, 0
            out.append((used, size, entry))
        return sorted(out, key=lambda e: (e[0], e[2].name))

    def evict(self, *, keep: str | None = None) -> int:
        """Delete the entries used longest ago (never ``keep``) until the rest fit in
        ``max_bytes``; the number deleted."""
        rows = self.entries()
        total = sum(size for _, size, _ in rows)
        gone = 0
        for _, size, entry in rows:
            if total <= self.max_bytes:
                break
            if entry.name == keep:
                continue
            shutil.rmtree(entry, ignore_errors=True)
            total -= size
            gone += 1
        return gone


class DiskResults:
    """A page's use of the result cache (a base class of the pages that keep their results
    there): `stored_result` on open or on a new request, `store_result` from the job."""

    _result_cache: Any = None
    _result_cache_read = False

    def result_cache(self) -> ResultCache | None:
        """The page's result cache (`result_cache`, made on first use; None: off)."""
        if not self._result_cache_read:
            self._result_cache = result_cache()
            self._result_cache_read = True
        return self._result_cache

    def stored_result(self, job: str, record: Provenance, extra: Mapping[str, Any] | None = None
                      ) -> tuple[dict[str, Any] | None, Stored | None]:
        """(the key's parts, the stored result or None) of job ``job`` on the inputs
        ``record`` (and ``extra``) with the page's model (``_model``); (None, None) with the cache
        off."""
        cache = self.result_cache()
        if cache is None:
            return None, None
        parts = cache.parts(job, record, self._model, extra)
        return parts, cache.get(parts)

    def store_result(self, parts: dict[str, Any] | None,
                     datasets: Mapping[str, xr.Dataset | None],
                     values: Mapping[str, Any] | None = None, *, computed_at: str) -> None:
        """Keep a job's result under ``parts`` (from `stored_result`; None: the cache is off)."""
        cache = self.result_cache()
        if parts is not None and cache is not None:
            cache.put(parts, datasets, values, computed_at=computed_at)


# -- warm-up -----------------------------------------------------------------------------------

def warmup_wanted() -> bool:
    """Whether the warm-up may run: the cache on and ``EXPLORER_WARM_CACHE`` not off."""
    return (os.environ.get(ENV_VAR, "").strip().lower() not in _OFF
            and os.environ.get(WARM_ENV_VAR, "").strip().lower() not in _OFF)


def start_warmup(model_name: str) -> subprocess.Popen | None:
    """Start ``python -m apps._result_warmup --model model_name`` (a child process at low
    priority, torch on one thread) and return it at once; it is stopped when this process
    exits, and stops itself when this process is gone. None when `warmup_wanted` says no or
    the child cannot start (logged)."""
    if not warmup_wanted():
        return None
    root = str(Path(__file__).resolve().parent.parent)
    path = os.environ.get("PYTHONPATH", "")
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": root + (os.pathsep + path if path else "")}
    try:
        argv = [sys.executable, "-m", "apps._result_warmup", "--model", str(model_name),
                "--parent", str(os.getpid())]
        child = subprocess.Popen(argv, cwd=root, env=env, stdin=subprocess.DEVNULL,
                                 stdout=subprocess.DEVNULL)
    except OSError as err:
        log.warning("the result cache warm-up did not start: %s", err)
        return None
    atexit.register(_stop_child, child)
    return child


def _stop_child(child: subprocess.Popen) -> None:
    if child.poll() is None:
        child.terminate()
        try:
            child.wait(timeout=5)
        except subprocess.TimeoutExpired:
            child.kill()
