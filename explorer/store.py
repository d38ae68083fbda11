"""Content-addressed cache of activation Datasets, stored on disk as zarr.

An :class:`ActivationStore` keeps one entry per key, where the key is a hash of
everything that determines the result (model provenance, prompts, sites, edits,
dtype, ...). Each entry is a folder ``<folder>/activations/<key>/`` holding the
data as a zarr store (``data.zarr``, zarr format 2, compressed) and a
``manifest.json`` that lists every file with its size and BLAKE2b hash.

Writes are atomic: an entry is written into a temporary folder next to the
entries, the manifest is written last, and the folder is renamed into place.
A write killed mid-way leaves only a temporary folder, which reads ignore and
:meth:`ActivationStore.clean` removes. Reads are lazy (dask-backed) and, by
default, check every file against the manifest first, so a damaged entry is
reported and removed instead of being returned.

No pickles are written or read: numpy object arrays are rejected, and attrs
that zarr cannot hold natively (nested dicts, tuples, numpy values) are stored
as one JSON string per variable and decoded on read, so the round trip is exact.
"""
from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import math
import os
import re
import shutil
import sys
import tempfile
import uuid
import warnings
from collections.abc import Callable, Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import xarray as xr
import zarr

from explorer._checks import InputError, StoreError, suggest

try:  # POSIX advisory locks keep clean() away from writes still in progress
    import fcntl
except ImportError:  # pragma: no cover - Windows: clean() cannot tell live writes apart
    fcntl = None

__all__ = ["ActivationStore", "CacheWarning", "CACHE_ENV_VAR"]

#: Environment variable naming the cache folder when ``path`` is not given.
CACHE_ENV_VAR = "EXPLORER_CACHE"

_DEFAULT_FOLDER = "~/.cache/explorer"
_ACTIVATIONS = "activations"
_MANIFEST = "manifest.json"
_DATA = "data.zarr"
_STORE_FORMAT = 1  # bump when the entry layout changes; older entries then read as corrupt
_ZARR_FORMAT = 2  # format 3 has no stable spec yet for fixed-width strings (token coords)
_TARGET_CHUNK_BYTES = 32 * 2**20
_HASH_BLOCK_BYTES = 2**20

_TMP_PREFIX = ".tmp-"  # a write in progress, or one that was killed
_LOCK_PREFIX = ".lock-"  # held (flock) by the process writing the matching .tmp- folder
_TRASH_PREFIX = ".trash-"  # an entry being removed
_KEY_PATTERN = re.compile(r"[0-9A-Za-z_-]{1,128}")

# Dtype kinds zarr stores without pickling: bool, ints, floats, complex,
# fixed-width str/bytes, datetime64, timedelta64.
_STORABLE_KINDS = "biufcUSMm"

# Attrs that could not be stored natively go into this one JSON string attr.
_ATTRS_JSON = "_explorer_attrs_json"
_TYPE_TAG = "__explorer_type__"
# Attr names xarray's CF decoding acts on when reading (e.g. ``units`` with
# "since" turns numbers into dates); they are kept in the JSON attr instead.
_CF_ATTR_NAMES = frozenset(
    {"units", "calendar", "missing_value", "scale_factor", "add_offset", "dtype",
     "coordinates", "bounds", "compress", "grid_mapping"}
)
_JSON_SAFE_INT = 2**53
_ATTR_ARRAY_KINDS = "biufU"

_SUMMARY_PARTS = ("model", "revision", "method", "sites", "dtype")


class CacheWarning(UserWarning):
    """A cache entry could not be used (for example it was corrupt) and was recomputed."""


class _CorruptEntry(Exception):
    """Internal: an entry failed its checks; ``args[0]`` says why."""


class ActivationStore:
    """A content-addressed on-disk cache of ``xarray.Dataset`` results, stored as zarr.

    Parameters
    ----------
    path : str or os.PathLike, optional
        Cache folder. Defaults to the ``EXPLORER_CACHE`` environment variable,
        else ``~/.cache/explorer``. Entries live under ``<path>/activations/``.

    Raises
    ------
    StoreError
        If the activations folder cannot be created or written to.

    Notes
    -----
    Data are stored with the dtype they have: float32 and float16 stay as
    given. numpy has no bfloat16, so callers convert bfloat16 tensors (to
    float32, or float16 if the range allows) before building the Dataset.

    Examples
    --------
    >>> store = ActivationStore(tmp_folder)                          # doctest: +SKIP
    >>> parts = {"model": "SmolLM2-135M", "prompts": ["Hi"], "sites": ["resid_post"]}
    >>> ds = store.get_or_compute(parts, lambda: run_trace(...))     # doctest: +SKIP
    """

    def __init__(self, path: str | os.PathLike[str] | None = None) -> None:
        if path is not None:
            if not isinstance(path, (str, os.PathLike)):
                raise TypeError(f"`path` must be a str or path-like; got {type(path).__name__} {path!r}.")
            folder, origin = path, "from `path`"
        elif os.environ.get(CACHE_ENV_VAR):
            folder, origin = os.environ[CACHE_ENV_VAR], f"from ${CACHE_ENV_VAR}"
        else:
            folder, origin = _DEFAULT_FOLDER, "the default"
        self.path = Path(folder).expanduser()
        self.activations_path = self.path / _ACTIVATIONS
        _check_writable(self.activations_path, origin)

    def __repr__(self) -> str:
        return f"ActivationStore(path={str(self.path)!r})"

    # ------------------------------------------------------------------ keys

    @staticmethod
    def key(parts: dict[str, Any]) -> str:
        """Return the cache key for ``parts``: a hash of their canonical JSON.

        Parameters
        ----------
        parts : dict
            Everything that determines the result: model provenance, prompts,
            sites, edits, dtype, ... Values must be JSON values (dicts with str
            keys, lists, tuples, str, int, float, bool, None). Tuples hash like
            lists; ``1`` and ``1.0`` hash differently.

        Returns
        -------
        str
            The first 32 hex digits of the SHA-256 of the canonical JSON
            (sorted keys, no spaces).

        Raises
        ------
        TypeError
            If ``parts`` is not a dict or holds a value that is not JSON-able;
            the message names where.
        """
        if not isinstance(parts, dict):
            raise TypeError(f"`parts` must be a dict; got {type(parts).__name__}.")
        _check_json_value("parts", parts)
        text = json.dumps(parts, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
        return hashlib.sha256(text.encode("ascii")).hexdigest()[:32]

    # ------------------------------------------------------------ read/write

    def put(self, key: str, ds: xr.Dataset, *, parts: dict[str, Any] | None = None) -> str:
        """Store ``ds`` under ``key``, atomically, replacing any entry with that key.

        Variables are chunked along their first dimension (about 32 MiB a
        chunk) and compressed with zarr's default codec. Dask-backed data are
        written chunk by chunk, without loading the whole Dataset.

        Parameters
        ----------
        key : str
            Entry name, usually from :meth:`key`; letters, digits, ``_`` and ``-``.
        ds : xarray.Dataset
            Data to store. Attrs must be JSON-able (numpy scalars and arrays of
            bool/int/float/str are allowed too) and survive exactly.
        parts : dict, optional
            The parts the key was made from; recorded in the manifest and
            summarised by :meth:`ls`.

        Returns
        -------
        str
            ``key``.

        Raises
        ------
        TypeError
            If ``ds`` is not a Dataset, a variable has object (or another
            unstorable) dtype, or an attr or part is not JSON-able.
        InputError
            If ``key`` has characters other than letters, digits, ``_`` and ``-``.
        StoreError
            If writing to the cache folder fails (disk full, permissions).
        """
        _check_key(key)
        if not isinstance(ds, xr.Dataset):
            raise TypeError(f"`ds` must be an xarray.Dataset; got {type(ds).__name__}.")
        if parts is not None:
            if not isinstance(parts, dict):
                raise TypeError(f"`parts` must be a dict or None; got {type(parts).__name__}.")
            _check_json_value("parts", parts)
        prepared = _prepare_for_zarr(ds)
        final = self.activations_path / key
        try:
            with self._temp_entry(key) as tmp:
                prepared.to_zarr(tmp / _DATA, mode="w-", zarr_format=_ZARR_FORMAT, consolidated=False)
                _write_manifest(tmp, key, parts)
                if final.exists():
                    self._discard(final)
                try:
                    os.replace(tmp, final)
                except OSError:
                    if not final.is_dir():
                        raise
                    # Another process stored the same key meanwhile; same key, same content.
        except OSError as err:
            raise StoreError(
                f"could not write cache entry {key} to '{self.activations_path}' "
                f"({err.strerror or err}). Free some space or set {CACHE_ENV_VAR} to another folder."
            ) from err
        return key

    def get(self, key: str, *, verify: bool = True) -> xr.Dataset | None:
        """Return the entry stored under ``key`` as a lazy, dask-backed Dataset, or None.

        Parameters
        ----------
        key : str
            Entry name.
        verify : bool, default=True
            Check every file's BLAKE2b hash against the manifest before opening
            (reads the whole entry once). With False, only the manifest, the
            file list and the file sizes are checked; damage inside a chunk
            then shows up as an error when that chunk is computed.

        Returns
        -------
        xarray.Dataset or None
            The stored Dataset (data not yet loaded), or None if there is no
            entry under ``key``.

        Raises
        ------
        StoreError
            If the entry is corrupt (missing or mismatched manifest, changed
            or missing files, unreadable zarr). The entry is removed first.
        InputError
            If ``key`` is malformed.
        """
        _check_key(key)
        try:
            return self._open_entry(key, verify=verify)
        except _CorruptEntry as err:
            raise StoreError(
                f"cache entry {key} is corrupt ({err.args[0]}); it was removed. "
                "Compute it again, e.g. with get_or_compute()."
            ) from None

    def get_or_compute(
        self,
        parts: dict[str, Any],
        compute: Callable[[], xr.Dataset],
        *,
        verify: bool = True,
    ) -> xr.Dataset:
        """Return the cached result for ``parts``, computing and storing it if needed.

        A corrupt entry is removed and recomputed, with a :class:`CacheWarning`.

        Parameters
        ----------
        parts : dict
            What determines the result; hashed by :meth:`key` and recorded in
            the manifest.
        compute : callable
            Called with no arguments on a miss; must return an xarray.Dataset.
        verify : bool, default=True
            Check file hashes of an existing entry before using it (see :meth:`get`).

        Returns
        -------
        xarray.Dataset
            The stored result, lazy and dask-backed (also right after computing).

        Raises
        ------
        TypeError
            If ``compute`` is not callable or does not return a Dataset, or
            ``parts`` is not JSON-able.
        StoreError
            If the result cannot be written.
        """
        key = self.key(parts)
        if not callable(compute):
            raise TypeError(f"`compute` must be callable; got {type(compute).__name__}.")
        try:
            cached = self._open_entry(key, verify=verify)
        except _CorruptEntry as err:
            warnings.warn(
                f"cache entry {key} was corrupt ({err.args[0]}); it was removed and is being recomputed.",
                CacheWarning,
                stacklevel=2,
            )
            cached = None
        if cached is not None:
            return cached
        result = compute()
        if not isinstance(result, xr.Dataset):
            raise TypeError(f"`compute` must return an xarray.Dataset; got {type(result).__name__}.")
        self.put(key, result, parts=parts)
        try:
            stored = self._open_entry(key, verify=False)  # just written and hashed
        except _CorruptEntry:  # removed or replaced by another process meanwhile
            stored = None
        return result if stored is None else stored

    # ------------------------------------------------------------ housekeeping

    def ls(self) -> list[dict[str, Any]]:
        """List the entries, newest first.

        Returns
        -------
        list of dict
            One dict per entry with ``key``, ``size`` (bytes on disk),
            ``created`` (ISO 8601 UTC string, None if unknown), ``parts`` (a
            summary: model, revision, method, sites, dtype and ``n_prompts``
            where recorded) and ``problem`` (None, or why the entry would read
            as corrupt, from a quick check without hashing). Leftovers of
            killed writes are not listed.
        """
        rows = []
        for entry in self._entry_folders():
            manifest, problem = None, None
            try:
                manifest = _read_manifest(entry)
                _check_files(entry, manifest, hashes=False)
            except _CorruptEntry as err:
                problem = err.args[0]
            parts = manifest.get("parts") if manifest else None
            rows.append({
                "key": entry.name,
                "size": _folder_size(entry),
                "created": manifest.get("created") if manifest else None,
                "parts": _summarise_parts(parts),
                "problem": problem,
            })
        rows.sort(key=lambda row: row["key"])
        rows.sort(key=lambda row: row["created"] or "", reverse=True)
        return rows

    def du(self) -> int:
        """Return the bytes used under the activations folder, leftovers of killed writes included."""
        return _folder_size(self.activations_path)

    def rm(self, key: str | None = None) -> int:
        """Remove the entry under ``key``, or every entry (and all leftovers) when ``key`` is None.

        Parameters
        ----------
        key : str, optional
            Entry to remove. None removes all entries and runs :meth:`clean`.

        Returns
        -------
        int
            Number of entries removed.

        Raises
        ------
        StoreError
            If there is no entry under ``key``; the message suggests a close key.
        """
        if key is None:
            entries = self._entry_folders()
            for entry in entries:
                self._discard(entry)
            self.clean()
            return len(entries)
        _check_key(key)
        entry = self.activations_path / key
        if not entry.is_dir():
            known = [e.name for e in self._entry_folders()]
            starting = [k for k in known if k.startswith(key)]
            hint = f" Did you mean {starting[0]!r}?" if len(starting) == 1 else suggest(key, known)
            raise StoreError(
                f"no cache entry {key!r} in '{self.activations_path}'.{hint} "
                f"ls() lists the {len(known)} entries."
            )
        self._discard(entry)
        return 1

    def clean(self) -> int:
        """Remove leftovers of killed writes and interrupted removals.

        Writes still in progress (in this or another process) are left alone.

        Returns
        -------
        int
            Number of leftover folders removed.
        """
        removed = 0
        for child in sorted(self.activations_path.iterdir()):
            name = child.name
            if name.startswith(_TRASH_PREFIX):
                shutil.rmtree(child, ignore_errors=True)
                removed += 1
            elif name.startswith(_TMP_PREFIX):
                lock_path = self.activations_path / (_LOCK_PREFIX + name[len(_TMP_PREFIX):])
                with _lock_if_free(lock_path) as free:
                    if free and child.exists():
                        shutil.rmtree(child, ignore_errors=True)
                        lock_path.unlink(missing_ok=True)
                        removed += 1
        for child in self.activations_path.glob(_LOCK_PREFIX + "*"):
            tmp = self.activations_path / (_TMP_PREFIX + child.name[len(_LOCK_PREFIX):])
            with _lock_if_free(child) as free:
                if free and not tmp.exists():
                    child.unlink(missing_ok=True)
        return removed

    # ------------------------------------------------------------- internals

    def _entry_folders(self) -> list[Path]:
        """Entry folders (not leftovers), sorted by key."""
        return sorted(
            child for child in self.activations_path.iterdir()
            if _KEY_PATTERN.fullmatch(child.name) and child.is_dir()
        )

    def _open_entry(self, key: str, *, verify: bool) -> xr.Dataset | None:
        """Open a checked entry lazily; None if absent; _CorruptEntry (after removal) if damaged."""
        entry = self.activations_path / key
        if not entry.exists():
            return None
        try:
            if not entry.is_dir():
                raise _CorruptEntry("it is a file, not a folder")
            manifest = _read_manifest(entry)
            if manifest.get("key") != key:
                raise _CorruptEntry(f"its manifest is for key {manifest.get('key')!r}")
            _check_files(entry, manifest, hashes=verify)
            ds = _open_zarr(entry / _DATA)
        except _CorruptEntry:
            self._discard(entry)
            raise
        return ds

    def _discard(self, entry: Path) -> None:
        """Remove an entry: rename it aside first, so it vanishes at once, then delete it."""
        trash = self.activations_path / f"{_TRASH_PREFIX}{entry.name}-{uuid.uuid4().hex[:12]}"
        try:
            os.replace(entry, trash)
        except FileNotFoundError:
            return
        if trash.is_dir():
            shutil.rmtree(trash, ignore_errors=True)
        else:
            trash.unlink(missing_ok=True)

    @contextlib.contextmanager
    def _temp_entry(self, key: str) -> Iterator[Path]:
        """Yield a fresh temporary folder for writing ``key``, locked against clean()."""
        for _ in range(3):
            token = f"{key}-{uuid.uuid4().hex[:12]}"
            lock_path = self.activations_path / (_LOCK_PREFIX + token)
            lock_file = open(lock_path, "a+b")  # noqa: SIM115 - closed in the finally below
            if fcntl is not None:
                fcntl.flock(lock_file.fileno(), fcntl.LOCK_EX)
                if os.fstat(lock_file.fileno()).st_nlink == 0:  # clean() unlinked it first
                    lock_file.close()
                    continue
            break
        else:  # pragma: no cover - needs clean() to win three races in a row
            raise StoreError(f"could not lock a temporary folder in '{self.activations_path}'.")
        tmp = self.activations_path / (_TMP_PREFIX + token)
        try:
            tmp.mkdir()
            yield tmp
        finally:
            shutil.rmtree(tmp, ignore_errors=True)  # nothing left if it was renamed into place
            lock_path.unlink(missing_ok=True)
            lock_file.close()


# ---------------------------------------------------------------- helpers


def _check_writable(folder: Path, origin: str) -> None:
    """Create ``folder`` and prove it writable with a probe file; StoreError if not."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".probe-", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        raise StoreError(
            f"the activation store folder '{folder}' ({origin}) is not writable "
            f"({err.strerror or err}). Set {CACHE_ENV_VAR} to a writable folder, or pass `path=`."
        ) from err


def _check_key(key: Any) -> None:
    """TypeError unless ``key`` is a str; InputError unless it is a safe entry name."""
    if not isinstance(key, str):
        raise TypeError(f"`key` must be a str; got {type(key).__name__} {key!r}.")
    if not _KEY_PATTERN.fullmatch(key):
        raise InputError(
            f"`key` must be 1-128 letters, digits, '_' or '-' (as made by ActivationStore.key); got {key!r}."
        )


def _check_json_value(where: str, value: Any) -> None:
    """TypeError naming ``where`` unless ``value`` is made only of JSON values."""
    if value is None or isinstance(value, (str, bool, int, float)):
        return
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _check_json_value(f"{where}[{i}]", item)
        return
    if isinstance(value, dict):
        for k, item in value.items():
            if not isinstance(k, str):
                raise TypeError(f"`{where}` must have str keys; got key {k!r} ({type(k).__name__}).")
            _check_json_value(f"{where}[{k!r}]", item)
        return
    raise TypeError(
        f"`{where}` must be a JSON value (dict with str keys, list, tuple, str, int, float, "
        f"bool or None); got {type(value).__name__}. Convert it first, e.g. with .tolist() or str()."
    )


def _prepare_for_zarr(ds: xr.Dataset) -> xr.Dataset:
    """Copy of ``ds`` ready for ``to_zarr``: dtypes checked, attrs encoded, chunks set."""
    for name, var in ds.variables.items():
        if var.dtype.kind not in _STORABLE_KINDS:
            hint = " Convert strings with .astype(str)." if var.dtype.kind == "O" else ""
            raise TypeError(
                f"variable {name!r} has dtype {var.dtype}, which the store cannot save without "
                f"pickling; allowed are bool, int, float, complex, fixed-width str/bytes and "
                f"datetime64/timedelta64.{hint}"
            )
    out = ds.copy(deep=False)  # new Variable objects: attrs/encoding edits stay off ``ds``
    out.attrs = _encode_attrs(ds.attrs, "ds.attrs")
    out.encoding = {}
    for name, var in out.variables.items():
        var.attrs = _encode_attrs(ds.variables[name].attrs, f"ds[{name!r}].attrs")
        var.encoding = {}  # stale chunks/codecs from an earlier source would clash
        if var.ndim == 0 or isinstance(var, xr.IndexVariable):
            continue  # scalars and indexes are small and in memory; zarr picks their chunks
        chunks = _first_dim_chunks(var.shape, var.dtype.itemsize)
        if _is_dask(var.data):
            var.data = var.data.rechunk(chunks)  # dask chunks must match zarr chunks
        var.encoding["chunks"] = chunks
    return out


def _first_dim_chunks(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    """Chunk shape splitting only the first dim, about _TARGET_CHUNK_BYTES each."""
    rest = tuple(max(1, n) for n in shape[1:])
    row_bytes = max(1, itemsize) * math.prod(rest)
    rows = max(1, min(max(1, shape[0]), _TARGET_CHUNK_BYTES // row_bytes))
    return (rows, *rest)


def _is_dask(data: Any) -> bool:
    """Whether ``data`` is a dask array (without importing dask when it is not)."""
    return type(data).__module__.startswith("dask")


def _encode_attrs(attrs: dict[Any, Any], where: str) -> dict[str, Any]:
    """Attrs zarr can store: plain values kept, the rest in one JSON string attr."""
    plain: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    for name, value in attrs.items():
        if not isinstance(name, str):
            raise TypeError(f"`{where}` must have str keys; got key {name!r} ({type(name).__name__}).")
        if _is_plain_attr(name, value):
            plain[name] = value
        else:
            extra[name] = _encode_attr_value(value, f"{where}[{name!r}]")
    if extra:
        plain[_ATTRS_JSON] = json.dumps({"order": list(attrs), "values": extra})
    return plain


def _is_plain_attr(name: str, value: Any) -> bool:
    """Whether zarr's JSON attrs and xarray's decoding return ``value`` unchanged."""
    if name.startswith("_") or name in _CF_ATTR_NAMES:
        return False
    if type(value) in (str, bool):
        return True
    if type(value) is int:
        return -_JSON_SAFE_INT <= value <= _JSON_SAFE_INT
    return type(value) is float and math.isfinite(value)


def _encode_attr_value(value: Any, where: str) -> Any:
    """JSON form of an attr value; tuples and numpy values are tagged to decode exactly."""
    if isinstance(value, np.generic):
        if value.dtype.kind not in _ATTR_ARRAY_KINDS:
            raise TypeError(
                f"`{where}` has numpy dtype {value.dtype}; only bool/int/float/str are storable."
            )
        return {_TYPE_TAG: "numpy", "dtype": value.dtype.str, "value": value.item()}
    if isinstance(value, np.ndarray):
        if value.dtype.kind not in _ATTR_ARRAY_KINDS:
            raise TypeError(
                f"`{where}` is an array of dtype {value.dtype}; only bool/int/float/str are storable."
            )
        return {_TYPE_TAG: "ndarray", "dtype": value.dtype.str, "shape": list(value.shape),
                "data": value.ravel().tolist()}
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    if isinstance(value, list):
        return [_encode_attr_value(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, tuple):
        items = [_encode_attr_value(v, f"{where}[{i}]") for i, v in enumerate(value)]
        return {_TYPE_TAG: "tuple", "items": items}
    if isinstance(value, dict):
        items = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise TypeError(f"`{where}` must have str keys; got key {k!r} ({type(k).__name__}).")
            items[k] = _encode_attr_value(v, f"{where}[{k!r}]")
        return {_TYPE_TAG: "dict", "items": items} if _TYPE_TAG in items else items
    raise TypeError(
        f"`{where}` must be JSON-able (dict, list, tuple, str, int, float, bool, None, or a numpy "
        f"bool/int/float/str scalar or array); got {type(value).__name__}."
    )


def _decode_attrs(attrs: dict[str, Any]) -> dict[str, Any]:
    """Inverse of _encode_attrs, restoring the original order."""
    if _ATTRS_JSON not in attrs:
        return dict(attrs)
    plain = {k: v for k, v in attrs.items() if k != _ATTRS_JSON}
    blob = json.loads(attrs[_ATTRS_JSON])
    extra = {k: _decode_attr_value(v) for k, v in blob["values"].items()}
    merged = {**plain, **extra}
    return {name: merged[name] for name in blob["order"]}


def _decode_attr_value(value: Any) -> Any:
    """Inverse of _encode_attr_value."""
    if isinstance(value, list):
        return [_decode_attr_value(v) for v in value]
    if not isinstance(value, dict):
        return value
    tag = value.get(_TYPE_TAG)
    if tag is None:
        return {k: _decode_attr_value(v) for k, v in value.items()}
    if tag == "tuple":
        return tuple(_decode_attr_value(v) for v in value["items"])
    if tag == "dict":
        return {k: _decode_attr_value(v) for k, v in value["items"].items()}
    if tag == "numpy":
        return np.array(value["value"], dtype=value["dtype"])[()]
    if tag == "ndarray":
        return np.array(value["data"], dtype=value["dtype"]).reshape(value["shape"])
    raise ValueError(f"unknown attr type tag {tag!r}")


def _open_zarr(path: Path) -> xr.Dataset:
    """Open a stored zarr lazily with decoded attrs; _CorruptEntry if it cannot be read."""
    try:
        ds = xr.open_zarr(path, chunks={}, zarr_format=_ZARR_FORMAT, consolidated=False)
        ds.attrs = _decode_attrs(ds.attrs)
        for var in ds.variables.values():
            var.attrs = _decode_attrs(var.attrs)
    # Whatever a damaged store makes zarr, numcodecs or json raise; all mean "unreadable".
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError, RuntimeError) as err:
        raise _CorruptEntry(f"unreadable zarr: {type(err).__name__}: {err}") from err
    return ds


def _write_manifest(entry: Path, key: str, parts: dict[str, Any] | None) -> None:
    """Write manifest.json (last, fsynced) listing every file of ``entry`` with size and hash."""
    manifest = {
        "store_format": _STORE_FORMAT,
        "key": key,
        "parts": parts,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": _versions(),
        "zarr_format": _ZARR_FORMAT,
        "files": [
            {"path": rel, "size": (entry / rel).stat().st_size, "blake2b": _file_hash(entry / rel)}
            for rel in _relative_files(entry)
        ],
    }
    with open(entry / _MANIFEST, "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def _read_manifest(entry: Path) -> dict[str, Any]:
    """Parsed manifest of ``entry``; _CorruptEntry if missing, unreadable or of another format."""
    try:
        text = (entry / _MANIFEST).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise _CorruptEntry(f"{_MANIFEST} is missing") from None
    except OSError as err:
        raise _CorruptEntry(f"{_MANIFEST} is unreadable: {err.strerror or err}") from None
    try:
        manifest = json.loads(text)
    except ValueError as err:
        raise _CorruptEntry(f"{_MANIFEST} is not valid JSON: {err}") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), list):
        raise _CorruptEntry(f"{_MANIFEST} has no file list")
    if manifest.get("store_format") != _STORE_FORMAT:
        raise _CorruptEntry(
            f"store format {manifest.get('store_format')!r}, this version reads {_STORE_FORMAT}"
        )
    return manifest


def _check_files(entry: Path, manifest: dict[str, Any], *, hashes: bool) -> None:
    """_CorruptEntry unless the files of ``entry`` are exactly those in the manifest."""
    try:
        listed = {f["path"]: f for f in manifest["files"]}
    except (TypeError, KeyError):
        raise _CorruptEntry(f"{_MANIFEST} has a malformed file list") from None
    present = set(_relative_files(entry))
    missing = sorted(set(listed) - present)
    if missing:
        raise _CorruptEntry(f"file {missing[0]} is missing")
    unexpected = sorted(present - set(listed))
    if unexpected:
        raise _CorruptEntry(f"file {unexpected[0]} is not in the manifest")
    for rel, record in listed.items():
        size = (entry / rel).stat().st_size
        if size != record.get("size"):
            raise _CorruptEntry(f"file {rel} has {size} bytes, the manifest says {record.get('size')}")
    if hashes:
        for rel, record in listed.items():
            if _file_hash(entry / rel) != record.get("blake2b"):
                raise _CorruptEntry(f"file {rel} does not match its hash in the manifest")


def _relative_files(entry: Path) -> list[str]:
    """Every file under ``entry`` except the manifest, as sorted POSIX relative paths."""
    files = []
    for folder, _, names in os.walk(entry):
        for name in names:
            rel = Path(folder, name).relative_to(entry).as_posix()
            if rel != _MANIFEST:
                files.append(rel)
    return sorted(files)


def _file_hash(path: Path) -> str:
    """BLAKE2b (16-byte) hex digest of a file, read in blocks."""
    digest = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        while block := f.read(_HASH_BLOCK_BYTES):
            digest.update(block)
    return digest.hexdigest()


def _folder_size(folder: Path) -> int:
    """Total bytes of the files under ``folder`` (files vanishing meanwhile count 0)."""
    total = 0
    for parent, _, names in os.walk(folder):
        for name in names:
            with contextlib.suppress(FileNotFoundError):
                total += os.stat(os.path.join(parent, name)).st_size
    return total


def _summarise_parts(parts: Any) -> dict[str, Any]:
    """The parts worth showing in a listing: model, method, sites, ... and the prompt count."""
    if not isinstance(parts, dict):
        return {}
    summary = {name: parts[name] for name in _SUMMARY_PARTS if name in parts}
    if isinstance(parts.get("prompts"), list):
        summary["n_prompts"] = len(parts["prompts"])
    return summary


def _versions() -> dict[str, str]:
    """Versions recorded in each manifest, for provenance."""
    try:
        explorer_version = metadata.version("explorer")
    except metadata.PackageNotFoundError:
        explorer_version = getattr(sys.modules.get("explorer"), "__version__", "unknown")
    return {
        "explorer": str(explorer_version),
        "xarray": xr.__version__,
        "zarr": zarr.__version__,
        "numpy": np.__version__,
        "python": sys.version.split()[0],
    }


@contextlib.contextmanager
def _lock_if_free(lock_path: Path) -> Iterator[bool]:
    """Yield True while holding ``lock_path``'s flock, False if another writer holds it."""
    if fcntl is None:  # pragma: no cover - no advisory locks: treat every leftover as stale
        yield True
        return
    try:
        lock_file = open(lock_path, "a+b")  # noqa: SIM115 - closed below
    except OSError:
        yield True  # no lock file to hold: no live writer
        return
    try:
        try:
            fcntl.flock(lock_file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        lock_file.close()
