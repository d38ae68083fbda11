"""Flags, parsing and printing shared by the ``explorer`` commands.

`add_model_option` / `load_cli_model` (``--model`` and ``--remote``), `add_scheduler_option`,
`read_prompts`, `load_edits`, `parse_int_list`, `print_json` (the one JSON printer: NaN
becomes null, numpy values become plain ones) and `torch_threads` (the thread count the CLI's
``--threads`` sets for a command, restored afterwards). Imported by `explorer.cli` and the
command modules only; nothing here imports torch or an analysis at import time.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from explorer._checks import InputError

__all__ = [
    "DEFAULT_MODEL",
    "add_model_option",
    "load_cli_model",
    "add_scheduler_option",
    "parse_int_list",
    "read_prompts",
    "load_edits",
    "print_json",
    "print_summary",
    "json_safe",
    "torch_threads",
]

DEFAULT_MODEL = "smollm2-135m"  # explorer.models.DEFAULT_MODEL; not imported here (torch is slow)
_DEFAULT_MODEL = DEFAULT_MODEL


def print_json(obj: Any) -> None:
    """Print ``obj`` as indented JSON on stdout (NaN becomes null)."""
    print(json.dumps(_json_safe(obj), indent=2, ensure_ascii=False))


def print_summary(summary: dict[str, Any], *, as_json: bool) -> None:
    """Print a command's result: indented JSON with ``as_json``, else one ``key: value`` line
    per entry (dicts and lists as compact JSON). The one printer every command uses."""
    if as_json:
        print_json(summary)
        return
    for key, value in summary.items():
        if isinstance(value, (dict, list, tuple)):
            value = json.dumps(_json_safe(value), ensure_ascii=False)
        print(f"{key}: {value}")


def add_model_option(parser: argparse.ArgumentParser) -> None:
    """Add ``--model NAME`` (a known name, a local folder or a hub id; default the packaged
    model) and ``--remote`` (run it on NDIF); `load_cli_model` loads what they name."""
    parser.add_argument("--model", default=_DEFAULT_MODEL, metavar="NAME",
                        help=f"known name (see 'explorer models'), local folder or hub id "
                             f"(default: {_DEFAULT_MODEL})")
    parser.add_argument("--remote", action="store_true",
                        help="run the model on NDIF (host and key from NDIF_HOST / NDIF_API_KEY)")


def load_cli_model(args: argparse.Namespace):
    """The model that ``--model`` and ``--remote`` name."""
    from explorer.models import load_model

    return load_model(args.model, remote=bool(getattr(args, "remote", False)))


def add_serve_options(parser: argparse.ArgumentParser, *, port: int) -> None:
    """Add what a command that serves pages takes: ``--port``, ``--address`` (default
    127.0.0.1: this machine only), ``--show`` and ``--allow-websocket-origin``."""
    parser.add_argument("--port", type=int, default=port, help=f"port (default: {port})")
    parser.add_argument("--address", default="127.0.0.1",
                        help="address to bind (default: 127.0.0.1, this machine only)")
    parser.add_argument("--show", action="store_true", help="open a browser")
    parser.add_argument("--allow-websocket-origin", action="append", metavar="HOST",
                        help="host[:port] allowed to connect (repeatable)")


def served_url(args: argparse.Namespace, path: str = "") -> tuple[int, str]:
    """The checked ``--port`` and the URL ``--address`` and it give (``path`` appended);
    a bad port or an empty address is an InputError."""
    from explorer._checks import check_int

    port = check_int("--port", args.port, low=1, high=65535)
    if not args.address.strip():
        raise InputError("`--address` must be a host name or IP address; got ''.")
    host = f"[{args.address}]" if ":" in args.address else args.address
    return port, f"http://{host}:{port}/{path}"


ICL_TASKS = "antonym,country-capital,english-french,present-past"


def add_tasks_option(parser: argparse.ArgumentParser, what: str) -> None:
    """Add ``--tasks`` (comma-separated ICL task names, default `ICL_TASKS`)."""
    parser.add_argument("--tasks", default=ICL_TASKS,
                        help=f"comma-separated tasks{what} (default: %(default)s)")


def add_scheduler_option(parser: argparse.ArgumentParser) -> None:
    """Add ``--scheduler`` (where dask work runs; see `explorer.distributed.dask_scheduler`)."""
    parser.add_argument("--scheduler", default="threads", metavar="WHERE",
                        help="dask scheduler: threads (default), synchronous, local (a "
                             "LocalCluster on 127.0.0.1) or a scheduler address tcp://HOST:PORT")


def parse_int_list(flag: str, text: str, *, ranges: bool = False) -> list[int]:
    """Parse ``"0,5,10"`` (and with ``ranges``, ``"0-5"`` inclusive) into a list of ints.

    Raises InputError naming ``flag`` for anything else.
    """
    allowed = "comma-separated ints" + (" or ranges like 0-5" if ranges else "")
    out: list[int] = []
    items = [item.strip() for item in str(text).split(",")]
    if not any(items):
        raise InputError(f"`{flag}` must be {allowed}; got {text!r}.")
    for item in items:
        if re.fullmatch(r"[+-]?\d+", item):
            out.append(int(item))
            continue
        match = re.fullmatch(r"(\d+)\s*-\s*(\d+)", item) if ranges else None
        if match is None:
            raise InputError(f"`{flag}` must be {allowed}; got {item!r} in {text!r}.")
        start, stop = int(match[1]), int(match[2])
        if start > stop:
            raise InputError(f"`{flag}` range {item!r} runs backwards; write {stop}-{start}.")
        out.extend(range(start, stop + 1))
    return out


def read_prompts(source: str) -> list[str]:
    """Prompts from a UTF-8 text file, one per line, or from stdin when ``source`` is ``-``.

    Line ends are stripped and blank lines skipped; the rest of each line is kept as is
    (leading spaces matter to a tokenizer). InputError if the file is missing, unreadable
    or holds no prompt.
    """
    where = "stdin" if source == "-" else f"prompts file {source!r}"
    try:
        text = sys.stdin.read() if source == "-" else Path(source).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputError(f"{where} does not exist.") from None
    except UnicodeDecodeError as err:
        raise InputError(f"{where} is not UTF-8 text ({err.reason} at byte {err.start}).") from None
    except OSError as err:
        raise InputError(f"cannot read {where} ({err.strerror or err}).") from None
    prompts = [line for line in text.splitlines() if line.strip()]
    if not prompts:
        raise InputError(f"{where} holds no prompts; write one prompt per line.")
    return prompts


def load_edits(source: str | None) -> list[Any]:
    """Intervention records from a JSON file (see `explorer.interventions.edits_from_json`)."""
    if source is None:
        return []
    from explorer.interventions import edits_from_json

    try:
        text = Path(source).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputError(f"edits file {source!r} does not exist.") from None
    except (OSError, UnicodeDecodeError) as err:
        raise InputError(f"cannot read edits file {source!r} ({err}).") from None
    try:
        return edits_from_json(text)
    except json.JSONDecodeError as err:
        raise InputError(f"edits file {source!r} is not valid JSON ({err}).") from None


def _json_safe(x: Any) -> Any:
    """A copy of ``x`` made of plain JSON values (numpy scalars/arrays, tuples, paths converted)."""
    if isinstance(x, dict):
        return {str(k): _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple, set, frozenset)):
        return [_json_safe(v) for v in x]
    if isinstance(x, Path):
        return str(x)
    if hasattr(x, "tolist") and type(x).__module__ == "numpy":  # numpy scalar or array
        return _json_safe(x.tolist())
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


json_safe = _json_safe


@contextlib.contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    """Run the body with torch at ``n`` CPU threads (``None``: leave the count alone), then
    restore the count it had before."""
    if n is None:
        yield
        return
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
