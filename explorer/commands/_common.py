"""Flags, parsing and printing shared by the ``explorer`` commands.

`add_command` (a subcommand with ``--model``, ``--json`` and ``--paper``), `parse_command_line`
(the parse that keeps the line for ``--paper``), `add_model_option` / `load_cli_model` (``--model`` and ``--remote``), `add_scheduler_option`,
`read_prompts`, `load_edits`, `parse_int_list`, `print_json` (the one JSON printer: NaN
becomes null, numpy values become plain ones) and `torch_threads` (the thread count the CLI's
``--threads`` sets for a command, restored afterwards). Imported by `explorer.cli` and the
command modules only; nothing here imports torch or an analysis at import time.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from explorer._checks import ExplorerError, InputError
from explorer.defaults import DEFAULT_MODEL

__all__ = [
    "DEFAULT_MODEL",
    "add_command",
    "add_model_option",
    "add_number_options",
    "load_cli_model",
    "add_scheduler_option",
    "parse_int_list",
    "parse_command_line",
    "read_prompts",
    "load_edits",
    "print_json",
    "print_summary",
    "json_safe",
    "torch_threads",
]



def print_json(obj: Any) -> None:
    """Print ``obj`` as indented JSON on stdout (NaN becomes null)."""
    print(json.dumps(json_safe(obj), indent=2, ensure_ascii=False))


def print_summary(summary: dict[str, Any], *, as_json: bool) -> None:
    """Print a command's result: indented JSON with ``as_json``, else one ``key: value`` line
    per entry (dicts and lists as compact JSON). The one printer every command uses."""
    if as_json:
        print_json(summary)
        return
    for key, value in summary.items():
        if isinstance(value, (dict, list, tuple)):
            value = json.dumps(json_safe(value), ensure_ascii=False)
        print(f"{key}: {value}")


def add_command(subparsers: Any, name: str, func: Callable[[argparse.Namespace], int | None], *,
                help: str, description: str, model: bool = True, paper: str | None = None,
                threads: int | None = None,
                json_help: str = "print the result as JSON") -> argparse.ArgumentParser:
    """Add the subcommand ``name`` run by ``func(args)``, with what every method command takes:
    ``--model`` and ``--remote`` (unless ``model`` is false: a command that trains its own
    model), ``--json``, with ``paper`` that method's ``--paper`` flag (applied to ``args``
    before ``func`` runs) and with ``threads`` its default torch thread count (``--threads``
    overrides it). Returns the parser, for the command's own options."""
    parser = subparsers.add_parser(name, help=help, description=description)
    if model:
        add_model_option(parser)
    parser.add_argument("--json", action="store_true", help=json_help)
    run = func
    if paper is not None:
        add_paper_option(parser, paper, command=name)

        @functools.wraps(func)
        def run(args: argparse.Namespace) -> int | None:
            apply_paper_option(args, paper)
            return func(args)
    parser.set_defaults(func=run)
    if threads is not None:
        parser.set_defaults(default_threads=threads)
    return parser


def add_model_option(parser: argparse.ArgumentParser) -> None:
    """Add ``--model NAME`` (a known name, a local folder or a hub id; default the packaged
    model) and ``--remote`` (run it on NDIF); `load_cli_model` loads what they name."""
    parser.add_argument("--model", default=DEFAULT_MODEL, metavar="NAME",
                        help=f"known name (see 'explorer models'), local folder or hub id "
                             f"(default: {DEFAULT_MODEL})")
    parser.add_argument("--remote", action="store_true",
                        help="run the model on NDIF (host and key from NDIF_HOST / NDIF_API_KEY)")


def load_cli_model(args: argparse.Namespace):
    """The model that ``--model`` and ``--remote`` name."""
    from explorer.models import load_model

    return load_model(args.model, remote=bool(getattr(args, "remote", False)))


def add_serve_options(parser: argparse.ArgumentParser, *, port: int) -> None:
    """Add what a command that serves pages takes: ``--port``, ``--address`` (default
    127.0.0.1: this machine only), ``--show``, ``--allow-websocket-origin`` and the sign-in
    (``--password-file``, ``--oauth-provider``, ``--no-auth``; see `server_sign_in`).
    Flags are not abbreviated here, so ``--password SECRET`` is an error, never a file name."""
    parser.allow_abbrev = False
    parser.add_argument("--port", type=int, default=port, help=f"port (default: {port})")
    parser.add_argument("--address", default="127.0.0.1",
                        help="address to bind (default: 127.0.0.1, this machine only); any "
                             "other address needs a sign-in")
    parser.add_argument("--show", action="store_true", help="open a browser")
    parser.add_argument("--allow-websocket-origin", action="append", metavar="HOST",
                        help="host[:port] allowed to connect (repeatable; default: the "
                             "served address, this machine's names, 127.0.0.1 and localhost)")
    auth = parser.add_argument_group("sign-in (required off 127.0.0.1)")
    auth.add_argument("--password-file", metavar="FILE",
                      help=f"password sign-in: FILE holds the password (one line) or JSON "
                           f"{{\"user\": \"password\", ...}}; or set {PASSWORD_ENV}")
    auth.add_argument("--oauth-provider", metavar="NAME",
                      help="sign in with an OAuth provider from Panel's list (github, google, "
                           "gitlab, azure, okta, auth0, generic, ...); key and secret from "
                           "PANEL_OAUTH_KEY / PANEL_OAUTH_SECRET")
    auth.add_argument("--no-auth", action="store_true",
                      help="serve off 127.0.0.1 with no sign-in: anyone who reaches the port "
                           "can run the model")


AUTH_PROVIDERS = ("auth0", "auth_code", "azure", "azurev2", "bitbucket", "generic", "github",
                  "gitlab", "google", "okta", "pam", "password")
"""Panel's OAuth providers (``panel.auth.AUTH_PROVIDERS``; named here so the command layer
imports no UI library; tests/test_serve_auth.py checks the two agree)."""

PASSWORD_ENV = "EXPLORER_PASSWORD"
"""Environment variable with the server's password (`server_sign_in`)."""

COOKIE_SECRET_ENV = "EXPLORER_COOKIE_SECRET"
"""Environment variable with the secret that signs the sign-in cookies (`server_sign_in`)."""


def is_loopback(address: str) -> bool:
    """Whether ``address`` is reachable from this machine only (127.0.0.0/8, ::1, localhost)."""
    import ipaddress

    if address.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(address.strip().strip("[]")).is_loopback
    except ValueError:
        return False


def server_sign_in(args: argparse.Namespace, env: dict[str, str] | None = None
                   ) -> tuple[dict[str, Any], str]:
    """The sign-in the serve flags ask for, as keyword arguments of `panel.serve`, and one line
    that describes it (never the password or a secret).

    Off loopback a method is required: a password (``--password-file`` or the
    ``EXPLORER_PASSWORD`` environment variable; never a command-line value), an OAuth provider
    (``--oauth-provider``, key and secret from ``PANEL_OAUTH_KEY`` / ``PANEL_OAUTH_SECRET``), or
    an explicit ``--no-auth``. The cookie secret comes from ``EXPLORER_COOKIE_SECRET`` (or
    ``PANEL_COOKIE_SECRET``); without one a random secret is made, so sign-ins last as long as
    the server. Any problem is an InputError naming the flag.
    """
    import os
    import secrets

    env = dict(os.environ) if env is None else env
    password_file = getattr(args, "password_file", None)
    password_env = env.get(PASSWORD_ENV) or None
    provider = getattr(args, "oauth_provider", None)
    no_auth = bool(getattr(args, "no_auth", False))
    chosen = [name for name, on in (("--password-file", password_file),
                                    (PASSWORD_ENV, password_env),
                                    ("--oauth-provider", provider), ("--no-auth", no_auth)) if on]
    if len(chosen) > 1:
        raise InputError(f"choose one sign-in; got {' and '.join(chosen)}.")
    loopback = is_loopback(args.address)
    if not chosen:
        if loopback:
            return {}, "no sign-in (this machine only)"
        raise InputError(
            f"`--address {args.address}` can be reached from other machines, so the server needs "
            f"a sign-in: --password-file FILE (or set {PASSWORD_ENV}), --oauth-provider NAME "
            f"(key and secret in PANEL_OAUTH_KEY / PANEL_OAUTH_SECRET), or, to serve anyone who "
            f"reaches the port, --no-auth.")
    if no_auth:
        return {}, "NO SIGN-IN: anyone who can reach the port can run the model"
    cookie = env.get(COOKIE_SECRET_ENV) or env.get("PANEL_COOKIE_SECRET") or secrets.token_urlsafe(32)
    kwargs: dict[str, Any] = {"cookie_secret": cookie}
    if password_file or password_env:
        if password_file:
            path = Path(password_file)
            if not path.is_file():
                raise InputError(f"`--password-file` must be a readable file; got {password_file!r}.")
            text = path.read_text(encoding="utf-8").strip()
            if not text:
                raise InputError(f"`--password-file` {password_file!r} is empty.")
            if text.startswith("{"):
                try:
                    users = json.loads(text)
                except json.JSONDecodeError as exc:
                    raise InputError(f"`--password-file` {password_file!r} is not valid JSON: "
                                     f"{exc.msg} (line {exc.lineno}).") from None
                if (not isinstance(users, dict) or not users
                        or not all(isinstance(k, str) and isinstance(v, str) and v
                                   for k, v in users.items())):
                    raise InputError(f"`--password-file` {password_file!r} must map user names "
                                     "to non-empty passwords.")
                kwargs["basic_auth"] = str(path.resolve())
                what = f"password per user ({len(users)} user{'s' if len(users) > 1 else ''})"
            else:
                kwargs["basic_auth"] = text.splitlines()[0]
                what = "password (from --password-file)"
        else:
            kwargs["basic_auth"] = password_env
            what = f"password (from {PASSWORD_ENV})"
        return kwargs, f"sign-in: {what}"
    if provider not in AUTH_PROVIDERS:
        import difflib

        near = difflib.get_close_matches(str(provider), list(AUTH_PROVIDERS), n=1)
        hint = f" Did you mean {near[0]!r}?" if near else ""
        raise InputError(f"`--oauth-provider` must be one of {', '.join(sorted(AUTH_PROVIDERS))}; "
                         f"got {provider!r}.{hint}")
    missing = [name for name in ("PANEL_OAUTH_KEY", "PANEL_OAUTH_SECRET") if not env.get(name)]
    if missing and provider not in ("password", "pam"):
        raise InputError(f"`--oauth-provider {provider}` needs {' and '.join(missing)} in the "
                         "environment.")
    kwargs.update(oauth_provider=provider, oauth_key=env.get("PANEL_OAUTH_KEY"),
                  oauth_secret=env.get("PANEL_OAUTH_SECRET"),
                  oauth_redirect_uri=env.get("PANEL_OAUTH_REDIRECT_URI"),
                  oauth_encryption_key=env.get("PANEL_OAUTH_ENCRYPTION"))
    return {k: v for k, v in kwargs.items() if v is not None}, f"sign-in: OAuth ({provider})"


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


def add_number_options(parser: argparse.ArgumentParser, **defaults: int | float) -> None:
    """Add one ``--name`` option per keyword, typed and defaulted by its value
    (``n_prompts=20``: ``--n-prompts``, an int, default 20)."""
    for name, default in defaults.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(default), default=default)


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


def json_safe(x: Any) -> Any:
    """A copy of ``x`` made of plain JSON values (numpy scalars/arrays, tuples, paths converted)."""
    if isinstance(x, dict):
        return {str(k): json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple, set, frozenset)):
        return [json_safe(v) for v in x]
    if isinstance(x, Path):
        return str(x)
    if hasattr(x, "tolist") and type(x).__module__ == "numpy":  # numpy scalar or array
        return json_safe(x.tolist())
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x



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


def add_paper_option(parser: argparse.ArgumentParser, method: str, *, command: str) -> None:
    """Add ``--paper`` to ``command``'s ``parser``: set every option the paper's setting names
    to the paper's value (`explorer.paper_settings.PAPER_SETTINGS`); an option given on the
    same line keeps its value, the default's value included (`apply_paper_option`)."""
    from explorer.paper_settings import flag_values, paper_setting

    setting = paper_setting(method)
    values = ", ".join(f"--{flag.replace('_', '-')} {value}"
                       for flag, value in flag_values(method).items())
    parser.add_argument("--paper", action="store_true",
                        help=f"the paper's setting ({setting.paper}; read from {setting.code}): "
                             f"{values} (an option given on the line keeps its value)")
    parser.set_defaults(_paper_parser=parser, _paper_command=command)


def parse_command_line(parser: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.Namespace:
    """``parser.parse_args(argv)`` with ``argv`` kept on the result (``args.argv``): the
    ``--paper`` step parses it again to tell the options given on the line from defaults."""
    args = parser.parse_args(list(argv))
    args.argv = list(argv)
    return args


_UNSET = object()


def _given_options(parser: argparse.ArgumentParser, command: str,
                   argv: Sequence[str]) -> set[str] | None:
    """The destinations of the options that ``argv`` (a whole command line) gives
    ``command``, whose parser is ``parser``: the arguments after the command's name, parsed
    again with no defaults. None if ``argv`` does not name the command or does not parse.

    The command's arguments follow its name's first place on the line that leaves them
    parsing: a value of an option before the command (``--cache DIR``) may spell its name.
    """
    argv = list(argv)
    dests = [*(a.dest for a in parser._actions if a.dest != argparse.SUPPRESS),
             *parser._defaults]
    for at in (i for i, arg in enumerate(argv) if arg == command):
        probe = argparse.Namespace(**dict.fromkeys(dests, _UNSET))
        try:      # a dest already on the namespace gets no default
            parser.parse_known_args(argv[at + 1:], probe)
        except (SystemExit, ExplorerError):
            continue
        return {dest for dest, value in vars(probe).items() if value is not _UNSET}
    return None


def apply_paper_option(args: argparse.Namespace, method: str) -> None:
    """With ``--paper``, set the paper's values on ``args`` and say so on stderr (stdout
    stays the result, JSON included).

    An option given on the line keeps its value: where ``args`` carries the line
    (`parse_command_line`), the command's arguments parsed again with no defaults name the
    options given; otherwise an option counts as given where its value is not its default's.
    """
    if not getattr(args, "paper", False):
        return
    from explorer.paper_settings import apply_paper_flags, paper_setting

    parser = getattr(args, "_paper_parser", None)
    argv = getattr(args, "argv", None)             # kept by `parse_command_line`
    kept = (_given_options(parser, args._paper_command, argv)
            if parser is not None and argv is not None else None)
    if kept is None:       # the line not kept: an option other than its default was given
        kept = {flag for flag in vars(args)
                if parser is not None and getattr(args, flag) != parser.get_default(flag)}
    done = apply_paper_flags(args, method, keep=kept)
    setting = paper_setting(method)
    beyond = f"; not set here: {setting.beyond}" if setting.beyond else ""
    print(f"--paper ({setting.paper}): {', '.join(done)}{beyond}", file=sys.stderr)
