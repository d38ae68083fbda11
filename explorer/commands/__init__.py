"""The command layer: each module holds one method's ``explorer`` subcommands.

A module here defines ``register_cli(subparsers)`` (see `explorer.cli`, which lists these
modules in ``COMMAND_MODULES``) and its ``_cmd_*`` handlers; it parses flags, calls the
analysis library (`explorer.analyses`, `explorer.studies`) and prints. Analyses never import
this layer, `explorer.cli` or `apps`; only this layer (and `explorer.cli`) may load a page of
`apps` (with ``importlib``), for the page-latency benches.
"""
