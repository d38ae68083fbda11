"""The ``explorer`` command line: list models, trace prompts to zarr, read the logit lens,
manage the activation cache, serve the app gallery and run benchmarks.

Every command is a thin layer over the Python API (`explorer.models`, `explorer.trace`,
`explorer.lens`, `explorer.store`); ``--json`` prints machine-readable output on stdout.
Errors a user can cause (an `ExplorerError`, a ``ValueError`` or ``TypeError`` from
validation, a missing prompts file) print ONE line ``explorer: error: <message>`` on
stderr and exit with 2; anything unexpected prints one line suggesting ``--debug``
(which re-raises, for the traceback) and exits with 1; Ctrl-C exits with 130.

Method subcommands
------------------
Each module path in `COMMAND_MODULES` (the command layer, `explorer.commands`) defines
``register_cli(subparsers)``, which adds one or more subcommands, the method commands with
`explorer.commands._common.add_command` (``--model``/``--remote``, ``--json``, ``--paper``,
the default thread count). Each subcommand must have a ``--json`` flag and
``set_defaults(func=handler)``, where ``handler(args)`` prints its output and returns an
exit code (``None`` means 0). The helpers of `explorer.commands._common`
(`add_command`, `read_prompts`, `load_edits`, `parse_int_list`, `print_json`, ...)
keep the flags and parsing the same across commands. Modules are imported when ``main``
builds its parser; an import error is a bug and is raised, never skipped.

Every subcommand takes ``--threads N``: torch's CPU thread count while the command runs,
restored when it ends. A command may set its own default with
``set_defaults(default_threads=N)`` (the small training commands use 1).
"""
from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import re
import shutil
import sys
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ._checks import ExplorerError, InputError, StoreError
from .commands._common import (
    json_safe,
    add_model_option,
    add_scheduler_option,
    add_serve_options,
    load_cli_model,
    load_edits,
    parse_command_line,
    parse_int_list,
    print_json,
    read_prompts,
    served_url,
    server_sign_in,
    torch_threads,
)

__all__ = [
    "COMMAND_MODULES",
    "main",
    "build_parser",
    "add_model_option",
    "add_scheduler_option",
    "read_prompts",
    "load_edits",
    "parse_int_list",
    "print_json",
    "lens_to_json",
]

#: Modules of the command layer that add their own subcommands (see the module docstring).
COMMAND_MODULES: tuple[str, ...] = (
    "explorer.commands.saturation",
    "explorer.commands.conflicts",
    "explorer.commands.icl_heads",
    "explorer.commands.task_vectors",
    "explorer.commands.icl_finetune",
    "explorer.commands.itda",
    "explorer.commands.neuron_eval",
    "explorer.commands.parity",
    "explorer.commands.linear_icl",
    "explorer.commands.task_emergence",
    "explorer.commands.circuits",
    "explorer.commands.circuit_lora",
    "explorer.commands.shattering",
    "explorer.commands.unlearning",
    "explorer.commands.studies",
    "explorer.commands.dla",
    "explorer.commands.features",
    "explorer.commands.patching",
    "explorer.commands.compare",
)

_PROG = "explorer"
_CACHE_ENV_VAR = "EXPLORER_CACHE"
_CHUNK_BYTES = 32 * 2**20  # zarr chunks of about this size, split along the first dim
# Flags whose values may start with "-" (negative positions): "--positions -2,-1" would
# otherwise read to argparse as an unknown option.
_NEGATIVE_VALUE_FLAGS = ("--positions",)


class _UsageError(ExplorerError):
    """A command line argparse rejected (unknown flag, missing argument)."""


class _ArgumentParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors become one line from `main`, not usage + exit."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise _UsageError(f"{message} (see '{self.prog} --help')")


# -- helpers ------------------------------------------------------------------------------

def _human_bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"  # pragma: no cover


def _folder_bytes(folder: Path) -> int:
    total = 0
    for parent, _, names in os.walk(folder):
        for name in names:
            try:
                total += os.stat(os.path.join(parent, name)).st_size
            except FileNotFoundError:
                pass
    return total


def _show_token(token: str) -> str:
    """A token as the model sees it: quotes make leading spaces visible, escapes newlines."""
    return repr(token)


# -- models -------------------------------------------------------------------------------

def _cmd_models(args: argparse.Namespace) -> int:
    from .models import DEFAULT_MODEL, TINY_MODELS, cache_dir, known_models

    root = cache_dir()
    rows = []
    for name, description in known_models().items():
        if name in TINY_MODELS:
            cached, path = None, None  # built in memory on every load
        else:
            folder = root / "models" / name
            cached = (folder / "explorer-source.json").exists()
            path = str(folder) if cached else None
        rows.append({"name": name, "description": description, "default": name == DEFAULT_MODEL,
                     "cached": cached, "path": path})
    if args.json:
        print_json({"cache_dir": str(root), "models": rows})
        return 0
    width = max(len(r["name"]) for r in rows)
    for r in rows:
        if r["cached"] is None:
            state = "built on load"
        elif r["cached"]:
            state = "converted"
        else:
            state = "not converted yet (converted on first load)"
        mark = "*" if r["default"] else " "
        print(f"{mark} {r['name']:<{width}}  {r['description']}  [{state}]")
    print(f"(* default; cache folder: {root}; set {_CACHE_ENV_VAR} or --cache to move it)")
    return 0


# -- trace --------------------------------------------------------------------------------

def _zarr_ready(ds: Any) -> Any:
    """Copy of ``ds`` for ``to_zarr`` (format 2, like ActivationStore): JSON attrs, chunks
    of about 32 MiB along the first dim so no chunk outgrows zarr's limits."""
    out = ds.copy(deep=False)
    out.attrs = json_safe(ds.attrs)
    for name, var in out.variables.items():
        var.attrs = json_safe(ds.variables[name].attrs)
        var.encoding = {}
        if var.ndim == 0 or name in out.indexes:
            continue
        row_bytes = max(1, var.dtype.itemsize) * math.prod(max(1, n) for n in var.shape[1:])
        rows = max(1, min(var.shape[0], _CHUNK_BYTES // row_bytes))
        var.encoding["chunks"] = (rows, *(max(1, n) for n in var.shape[1:]))
    return out


def _is_zarr_store(path: Path) -> bool:
    return path.is_dir() and any((path / f).exists() for f in (".zgroup", ".zattrs", "zarr.json"))


def _write_zarr(ds: Any, out: Path, *, force: bool) -> None:
    """Write ``ds`` to ``out`` atomically (temp folder, then rename); refuse to overwrite
    unless ``force``, and never delete a folder that is not a zarr store."""
    if out.exists() or out.is_symlink():
        if not force:
            raise InputError(f"`--out` {str(out)!r} already exists; pass --force to replace it.")
        if out.is_dir() and not _is_zarr_store(out):
            raise InputError(f"`--out` {str(out)!r} is a folder that is not a zarr store; "
                             "refusing to replace it even with --force.")
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:12]}"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        _zarr_ready(ds).to_zarr(tmp, mode="w-", zarr_format=2)
        if out.is_dir() and not out.is_symlink():
            shutil.rmtree(out)
        elif out.exists() or out.is_symlink():
            out.unlink()
        os.replace(tmp, out)
    except OSError as err:
        raise StoreError(f"could not write {str(out)!r} ({err.strerror or err}).") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _cmd_trace(args: argparse.Namespace) -> int:
    from .trace import trace

    prompts = read_prompts(args.prompts)
    sites = [s.strip() for s in args.sites.split(",") if s.strip()]
    layers = parse_int_list("--layers", args.layers, ranges=True) if args.layers else None
    positions = parse_int_list("--positions", args.positions) if args.positions else None
    edits = load_edits(args.edits)
    out = Path(args.out).expanduser()
    if (out.exists() or out.is_symlink()) and not args.force:  # fail before the slow part
        raise InputError(f"`--out` {str(out)!r} already exists; pass --force to replace it.")
    model = load_cli_model(args)
    ds = trace(model, prompts, sites=sites, layers=layers, positions=positions, edits=edits,
               batch_size=args.batch_size)
    _write_zarr(ds, out, force=args.force)
    size = _folder_bytes(out)
    summary = {
        "path": str(out),
        "model": model.spec.name,
        "n_prompts": len(prompts),
        "dims": {str(k): int(v) for k, v in ds.sizes.items()},
        "variables": {str(k): list(map(str, v.dims)) for k, v in ds.data_vars.items()},
        "bytes": size,
    }
    if args.json:
        print_json(summary)
    else:
        dims = ", ".join(f"{k} {v}" for k, v in summary["dims"].items())
        names = ", ".join(s for s in summary["variables"] if s != "mask")
        print(f"wrote {out}: {names} ({dims}); {_human_bytes(size)}")
    return 0


# -- lens ---------------------------------------------------------------------------------

def lens_to_json(ds: Any, n_tokens: int) -> dict[str, Any]:
    """The compact JSON form of a one-prompt `explorer.lens.logit_lens` Dataset.

    ``n_tokens`` is the prompt's length in tokens (turns negative positions into indices).

    Schema::

        {"model": str, "prompt": str, "k": int, "layers": [int, ...],
         "positions": [                         # one per position read
           {"pos": int,                         # as asked (negative counts from the end)
            "index": int,                       # token index in the prompt, from 0
            "token": str, "token_id": int,      # the input token there
            "output": [{"token": str, "token_id": int}, ...],   # the model's top-k
            "layers": [{"layer": int,
                        "top": [{"token": str, "token_id": int, "prob": float}, ...]},
                       ...]},                   # the lens's top-k after each layer
           ...]}
    """
    positions = []
    for j, pos in enumerate(ds["pos"].values.tolist()):
        sel = ds.isel(prompt=0, pos=j)
        layers = []
        for li, layer in enumerate(ds["layer"].values.tolist()):
            top = [{"token": str(sel["top_token"].values[li, r]),
                    "token_id": int(sel["top_token_id"].values[li, r]),
                    "prob": float(sel["top_prob"].values[li, r])}
                   for r in range(ds.sizes["rank"])]
            layers.append({"layer": int(layer), "top": top})
        output = [{"token": str(sel["final_token"].values[r]),
                   "token_id": int(sel["final_token_id"].values[r])}
                  for r in range(ds.sizes["rank"])]
        positions.append({"pos": int(pos), "index": int(pos) + n_tokens if pos < 0 else int(pos),
                          "token": str(sel["token"].values), "token_id": int(sel["token_id"].values),
                          "output": output, "layers": layers})
    return {"model": ds.attrs.get("model"), "prompt": ds.attrs["params"]["prompts"][0],
            "k": int(ds.sizes["rank"]), "layers": [int(x) for x in ds["layer"].values],
            "positions": positions}


def _cmd_lens(args: argparse.Namespace) -> int:
    from .lens import logit_lens

    layers = parse_int_list("--layers", args.layers, ranges=True) if args.layers else None
    positions = parse_int_list("--positions", args.positions) if args.positions else None
    edits = load_edits(args.edits)
    model = load_cli_model(args)
    ds = logit_lens(model, [args.prompt], k=args.k, positions=positions, layers=layers,
                    edits=edits)
    result = lens_to_json(ds, model.tokenize([args.prompt]).lengths[0])
    if args.json:
        print_json(result)
        return 0
    last = result["positions"][-1]
    where = f"{last['pos']}" + (f" (index {last['index']})" if last["pos"] < 0 else "")
    print(f"{result['model']}: logit lens at position {where}, token {_show_token(last['token'])}")
    rows = [(str(entry["layer"]), _show_token(entry["top"][0]["token"]),
             f"{entry['top'][0]['prob']:.4f}") for entry in last["layers"]]
    rows.append(("output", _show_token(last["output"][0]["token"]), ""))
    w0 = max(5, *(len(r[0]) for r in rows))
    w1 = max(5, *(len(r[1]) for r in rows))
    print(f"{'layer':<{w0}}  {'top-1':<{w1}}  prob")
    for a, b, c in rows:
        print(f"{a:<{w0}}  {b:<{w1}}  {c}".rstrip())
    return 0


# -- cache --------------------------------------------------------------------------------

def _cmd_cache(args: argparse.Namespace) -> int:
    from .store import ActivationStore

    store = ActivationStore()
    action = args.cache_action
    if action == "ls":
        rows = store.ls()
        if args.json:
            print_json({"path": str(store.activations_path), "entries": rows})
            return 0
        if not rows:
            print(f"no cache entries in {store.activations_path}")
            return 0
        for r in rows:
            parts = r["parts"]
            what = " ".join(f"{k}={','.join(map(str, v)) if isinstance(v, list) else v}"
                            for k, v in parts.items())
            problem = f"  PROBLEM: {r['problem']}" if r["problem"] else ""
            print(f"{r['key']}  {_human_bytes(r['size']):>10}  {r['created'] or '?':<25}  "
                  f"{what}{problem}".rstrip())
        print(f"{len(rows)} entries, {_human_bytes(sum(r['size'] for r in rows))} "
              f"in {store.activations_path}")
        return 0
    if action == "du":
        activations = store.du()
        models = _folder_bytes(store.path / "models")
        if args.json:
            print_json({"path": str(store.path), "activations": activations, "models": models,
                        "total": activations + models})
        else:
            print(f"{_human_bytes(activations):>10}  activations  {store.activations_path}")
            print(f"{_human_bytes(models):>10}  models       {store.path / 'models'}")
            print(f"{_human_bytes(activations + models):>10}  total")
        return 0
    if action == "stats":
        return _cache_stats(store, args)
    if action == "rm":
        if (args.key is None) == (not args.all):
            raise InputError("`cache rm` takes one entry KEY or --all (not both); "
                             "'explorer cache ls' lists the keys.")
        removed = store.rm(None if args.all else args.key)
    else:  # clean
        removed = store.clean()
    if args.json:
        print_json({"removed": removed})
    else:
        what = "entries" if action == "rm" else "leftover folders of interrupted writes"
        print(f"removed {removed} {what}")
    return 0


def _cache_stats(store: Any, args: argparse.Namespace) -> int:
    import numpy as np

    from .distributed import dask_scheduler, open_entry, site_statistics

    limit = None
    if args.memory_limit_mb is not None:
        from ._checks import check_float

        # a dask worker process needs ~200 MB of its own; a smaller limit pauses it for good
        limit = int(check_float("--memory-limit-mb", args.memory_limit_mb, low=256.0) * 2**20)
    with dask_scheduler(args.scheduler, memory_limit=limit):
        ds = open_entry(store, args.key, memory_limit=limit)
        stats = site_statistics(ds, args.site)
    norm = stats["norm_mean"]
    if args.json:
        print_json({"key": args.key, "site": args.site, "scheduler": args.scheduler,
                    "dims": list(norm.dims),
                    "norm_mean": np.asarray(norm.values).tolist(),
                    "mean_abs": float(np.abs(stats["mean"].values).mean()),
                    "var_mean": float(stats["var"].values.mean()),
                    "tokens": int(stats["count"].values.max())})
        return 0
    print(f"{args.site} of {args.key} on {args.scheduler}: {int(stats['count'].values.max())} "
          "real tokens")
    if "layer" in norm.dims:
        for layer, value in zip(norm["layer"].values.tolist(), norm.values.tolist()):
            print(f"  layer {layer:>3}  mean norm {value:12.4f}")
    else:
        print(f"  mean norm {float(norm.values):.4f}")
    return 0


# -- serve --------------------------------------------------------------------------------

def _cmd_serve(args: argparse.Namespace) -> int:
    port, url = served_url(args)
    sign_in, described = server_sign_in(args)
    heavy = args.heavy_jobs
    if heavy is not None:
        from explorer._checks import check_int

        check_int("--heavy-jobs", heavy, low=1, high=256)
    gallery = importlib.import_module("apps.gallery")
    print(f"serving the explorer gallery ({args.model}) at {url}", flush=True)
    if sign_in:
        print(f"{_PROG}: {described}", file=sys.stderr, flush=True)
    if args.no_auth:
        print(f"{_PROG}: warning: --no-auth on {args.address}: anyone who can reach the port can "
              "run the model and see what it computes.", file=sys.stderr, flush=True)
    gallery.serve(model=args.model, port=port, address=args.address, show=args.show,
                  allow_websocket_origin=args.allow_websocket_origin, remote=args.remote,
                  heavy_jobs=heavy, warm_cache=args.warm_cache, **sign_in)
    return 0


# -- bench --------------------------------------------------------------------------------

def _parse_options(items: Sequence[str]) -> dict[str, Any]:
    """``key=value`` pairs; values are JSON where they parse as JSON (3, 0.5, true), else strings."""
    options: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key.isidentifier():
            raise InputError(f"`--option` must be key=value with a Python name as key; got {item!r}.")
        if key in options:
            raise InputError(f"`--option` {key!r} is given twice.")
        try:
            options[key] = json.loads(value)
        except ValueError:
            options[key] = value
    return options


def _cmd_bench(args: argparse.Namespace) -> int:
    options = _parse_options(args.option or ())
    if "model" in options:
        raise InputError("pass the model with --model, not --option model=...")
    for name in ("pages", "runs"):          # the pages bench's own flags
        if getattr(args, name, None) is not None:
            if name in options:
                raise InputError(f"pass {name} with --{name} or --option {name}=..., not both.")
            options[name] = getattr(args, name)
    if args.name == "pages":   # the gallery's page slugs, for --pages lens,attention
        options.setdefault("titles", importlib.import_module("apps._page_titles").PAGE_TITLES)
    bench = importlib.import_module("explorer.bench")
    result = bench.run_bench(args.name, model=args.model, **options)
    if args.json:
        print_json(result)
        return 0
    if args.name == "pages":
        print(importlib.import_module("explorer.benches.pages").page_table(result))
        return 0
    if not isinstance(result, dict):
        print(json.dumps(json_safe(result)))
        return 0
    width = max((len(str(k)) for k in result), default=0)
    for key, value in result.items():
        shown = value if isinstance(value, str) else json.dumps(json_safe(value), ensure_ascii=False)
        print(f"{key!s:<{width}}  {shown}")
    return 0


# -- parser ---------------------------------------------------------------------------------

def _add_global_options(parser: argparse.ArgumentParser, *, suppress: bool) -> None:
    """--cache, --threads and --debug, accepted before the subcommand and after it."""
    default = argparse.SUPPRESS if suppress else None
    parser.add_argument("--cache", metavar="DIR", default=default,
                        help=f"cache folder for this run (sets {_CACHE_ENV_VAR})")
    if "--threads" not in parser._option_string_actions:
        parser.add_argument("--threads", type=int, metavar="N", default=default,
                            help="torch CPU threads while the command runs (restored "
                                 "afterwards; default: the command's own, else torch's)")
    parser.add_argument("--debug", action="store_true",
                        default=argparse.SUPPRESS if suppress else False,
                        help="show the full traceback of an error")


def _threads(args: argparse.Namespace) -> int | None:
    """The thread count for the command: ``--threads``, else its ``default_threads``."""
    from ._checks import check_int

    if args.threads is not None:
        return check_int("--threads", args.threads, low=1)
    default = getattr(args, "default_threads", None)
    return None if default is None else check_int("threads", default, low=1)


def build_parser() -> argparse.ArgumentParser:
    """The ``explorer`` parser, with every built-in and analysis subcommand."""
    from ._version import __version__

    parser = _ArgumentParser(
        prog=_PROG, description="Look inside language models: trace, logit lens, cache, apps.")
    parser.add_argument("--version", action="version", version=f"{_PROG} {__version__}")
    _add_global_options(parser, suppress=False)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("models", help="list the known models and what is cached")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_cmd_models)

    p = sub.add_parser("trace", help="read activations of prompts into a zarr store")
    add_model_option(p)
    p.add_argument("--prompts", required=True, metavar="FILE",
                   help="text file with one prompt per line (blank lines skipped), or - for stdin")
    p.add_argument("--sites", default="resid_post", metavar="SITES",
                   help="comma-separated sites: resid_pre, resid_post, attn_z, head_out, "
                        "attn_pattern, mlp_out, final_norm, unembed (default: resid_post)")
    p.add_argument("--layers", metavar="LAYERS",
                   help="layers, e.g. 0,5,10 or 0-5 (default: all)")
    p.add_argument("--positions", metavar="POS",
                   help="positions per prompt, e.g. -1 or 0,-1 (default: every token)")
    p.add_argument("--batch-size", type=int, default=8, metavar="N", help="prompts per forward (default: 8)")
    p.add_argument("--edits", metavar="FILE", help="JSON file of interventions applied during the run")
    p.add_argument("--out", required=True, metavar="PATH", help="zarr store to write, e.g. acts.zarr")
    p.add_argument("--force", action="store_true", help="replace an existing zarr store at --out")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=_cmd_trace)

    p = sub.add_parser("lens", help="logit lens of one prompt: top tokens after every layer")
    add_model_option(p)
    p.add_argument("--prompt", required=True, metavar="TEXT", help="the prompt")
    p.add_argument("--k", type=int, default=5, help="top tokens per layer (default: 5)")
    p.add_argument("--positions", metavar="POS",
                   help="positions, e.g. -1 or 0,-1 (default: every token)")
    p.add_argument("--layers", metavar="LAYERS", help="layers, e.g. 0,5,10 or 0-5 (default: all)")
    p.add_argument("--edits", metavar="FILE", help="JSON file of interventions applied first")
    p.add_argument("--json", action="store_true",
                   help="print every position and layer as JSON (schema: explorer.cli.lens_to_json)")
    p.set_defaults(func=_cmd_lens)

    p = sub.add_parser("cache", help="list, measure and clear the activation cache")
    cache_sub = p.add_subparsers(dest="cache_action", metavar="ACTION", required=True)
    c = cache_sub.add_parser("ls", help="list the entries, newest first")
    c.add_argument("--json", action="store_true", help="print JSON")
    c = cache_sub.add_parser("du", help="bytes used by activations and converted models")
    c.add_argument("--json", action="store_true", help="print JSON")
    c = cache_sub.add_parser("rm", help="remove one entry, or all with --all")
    c.add_argument("key", nargs="?", metavar="KEY", help="entry key (from 'explorer cache ls')")
    c.add_argument("--all", action="store_true", help="remove every entry")
    c.add_argument("--json", action="store_true", help="print JSON")
    c = cache_sub.add_parser("clean", help="remove leftovers of interrupted writes")
    c.add_argument("--json", action="store_true", help="print JSON")
    c = cache_sub.add_parser(
        "stats", help="mean, variance and mean norm of a cached site, out of core with dask")
    c.add_argument("key", metavar="KEY", help="entry key (from 'explorer cache ls')")
    c.add_argument("--site", default="resid_post", help="site to reduce (default: resid_post)")
    add_scheduler_option(c)
    c.add_argument("--memory-limit-mb", type=float, default=None, metavar="MB",
                   help="memory per worker, at least 256: chunks are sized to fit, and a "
                        "local cluster's workers get this limit (default: as stored)")
    c.add_argument("--json", action="store_true", help="print JSON")
    for c in cache_sub.choices.values():
        _add_global_options(c, suppress=True)
    p.set_defaults(func=_cmd_cache)

    p = sub.add_parser("serve", help="serve the app gallery in the browser")
    add_model_option(p)
    add_serve_options(p, port=5006)
    p.add_argument("--heavy-jobs", type=int, default=None, metavar="N",
                   help="heavy analyses (circuits, corpora, training) that run at once; the "
                        "rest wait in one queue (default: one per two cores, or "
                        "EXPLORER_HEAVY_JOBS)")
    p.add_argument("--no-warm-cache", dest="warm_cache", action="store_false",
                   help="do not fill the pages' result cache for their default inputs in a "
                        "low-priority child process once the server listens (also "
                        "EXPLORER_WARM_CACHE=off)")
    p.set_defaults(func=_cmd_serve)

    p = sub.add_parser("bench", help="run a benchmark and print its result")
    p.add_argument("name", metavar="NAME", help="benchmark name (see explorer.bench.BENCHES)")
    p.add_argument("--model", default=None, metavar="NAME", help="model (default: the bench's own)")
    p.add_argument("--option", action="append", metavar="KEY=VALUE",
                   help="bench option; values parse as JSON where they can (repeatable)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--pages", default=None, metavar="SLUGS",
                   help="pages bench: comma-separated page slugs (default: every page)")
    p.add_argument("--runs", type=int, default=None, metavar="N",
                   help="pages bench: fresh browser sessions, each opening every page")
    p.set_defaults(func=_cmd_bench)

    for path in COMMAND_MODULES:
        _register_commands(path, sub)
    for name, p in sub.choices.items():
        if name != "cache":  # its actions carry them instead
            _add_global_options(p, suppress=True)
    return parser


def _register_commands(path: str, sub: Any) -> None:
    """Import ``path`` and let it add its subcommands; check they follow the contract."""
    module = importlib.import_module(path)  # an ImportError here is a bug: let it raise
    register = getattr(module, "register_cli", None)
    if not callable(register):
        raise TypeError(f"command module {path} has no register_cli(subparsers) function.")
    before = set(sub.choices)
    register(sub)
    added = [name for name in sub.choices if name not in before]
    if not added:
        raise TypeError(f"{path}.register_cli added no subcommand.")
    for name in added:
        p = sub.choices[name]
        if "--json" not in p._option_string_actions:
            raise TypeError(f"subcommand {name!r} from {path} has no --json flag.")
        if not callable(p.get_default("func")):
            raise TypeError(f"subcommand {name!r} from {path} sets no func (set_defaults(func=...)).")


def _join_negative_values(argv: list[str]) -> list[str]:
    """``--positions -2,-1`` -> ``--positions=-2,-1``, so argparse does not take the value
    for an option."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if (arg in _NEGATIVE_VALUE_FLAGS and i + 1 < len(argv)
                and re.fullmatch(r"-\d[\d,\s+-]*", argv[i + 1])):
            out.append(f"{arg}={argv[i + 1]}")
            i += 2
            continue
        out.append(arg)
        i += 1
    return out


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return text if len(text) <= 500 else text[:497] + "..."


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``explorer`` command line; return the exit code.

    Parameters
    ----------
    argv : sequence of str, optional
        Arguments without the program name (default ``sys.argv[1:]``).

    Returns
    -------
    int
        0 on success, 2 for an error the user can fix, 1 for an unexpected error,
        130 when interrupted.
    """
    argv = _join_negative_values(list(sys.argv[1:] if argv is None else argv))
    parser = build_parser()  # an analysis module that fails to import raises here
    debug = "--debug" in argv
    saved_cache = os.environ.get(_CACHE_ENV_VAR)
    try:
        try:
            args = parse_command_line(parser, argv)  # keeps argv for --paper
        except SystemExit as done:  # --help, --version
            return done.code if isinstance(done.code, int) else 0
        debug = args.debug
        if args.cache is not None:
            os.environ[_CACHE_ENV_VAR] = str(Path(args.cache).expanduser())
        handler: Callable[[argparse.Namespace], int | None] = args.func
        with torch_threads(_threads(args)):
            code = handler(args)
        return 0 if code is None else int(code)
    except KeyboardInterrupt:
        if debug:
            raise
        return 130
    except BrokenPipeError:  # e.g. `explorer cache ls | head`
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError, AttributeError):
            pass
        return 1
    except (ExplorerError, ValueError, TypeError, FileNotFoundError) as err:
        if debug:
            raise
        print(f"{_PROG}: error: {_one_line(err)}", file=sys.stderr)
        return 2
    except Exception as err:  # noqa: BLE001 - the last line of defence: one line, not a traceback
        if debug:
            raise
        print(f"{_PROG}: error: unexpected {type(err).__name__}: {_one_line(err)} "
              f"(run again with --debug for the traceback)", file=sys.stderr)
        return 1
    finally:
        if saved_cache is None:
            os.environ.pop(_CACHE_ENV_VAR, None)
        else:
            os.environ[_CACHE_ENV_VAR] = saved_cache


if __name__ == "__main__":
    sys.exit(main())
