"""Running one command module of the command line in a test: through `explorer.cli.main`
with only that module registered (`OneCommand`), or through a parser that holds only its
subcommands (`parse_and_run`)."""
from __future__ import annotations

import argparse
import importlib
import json
from collections.abc import Sequence
from typing import Any


class OneCommand:
    """`explorer.cli.main` with ``explorer.commands.<module>`` the only command module it
    imports (for the test: ``monkeypatch`` puts the list back); what it prints is read from
    ``capsys``. Calling it runs ``argv`` and gives the exit status."""

    def __init__(self, module: str, monkeypatch: Any, capsys: Any):
        from explorer import cli

        monkeypatch.setattr(cli, "COMMAND_MODULES", (f"explorer.commands.{module}",))
        self._main = cli.main
        self._capsys = capsys

    def __call__(self, argv: list[str]) -> int:
        return self._main(argv)

    def json(self, argv: list[str]) -> Any:
        """What ``argv`` (a command asked for ``--json``) printed, parsed; it must exit with 0."""
        status = self(argv)
        if status != 0:
            raise AssertionError(f"{argv} exited with {status}, not 0")
        return json.loads(self._capsys.readouterr().out)


def parse_and_run(module: str, argv: Sequence[str]) -> Any:
    """Parse ``argv`` with a parser that holds only the subcommands of
    ``explorer.commands.<module>`` (its `register_cli`) and run the handler they pick;
    what the handler returns. ``argv`` is parsed as `explorer.cli.main` parses it (the line
    kept for ``--paper``)."""
    from explorer.commands._common import parse_command_line

    parser = argparse.ArgumentParser()
    importlib.import_module(f"explorer.commands.{module}").register_cli(parser.add_subparsers())
    args = parse_command_line(parser, argv)
    return args.func(args)
