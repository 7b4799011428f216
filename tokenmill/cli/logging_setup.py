"""Console logging for the `tokenmill` command: the `--log-level` / `-v` flags and each subcommand's default.

Interactive subcommands (`chat`, `generate`) show warnings and errors only, so the engine's periodic
INFO stats line never lands in the conversation; `-v` or `--log-level INFO` brings it back.
Long-running subcommands (`serve`, `bench`, `plan`) log at INFO.
"""
from __future__ import annotations

import argparse
import logging

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
INTERACTIVE_COMMANDS = frozenset({"chat", "generate"})


def add_logging_args(parser: argparse.ArgumentParser, top_level: bool = False) -> None:
    """Add ``--log-level`` and ``-v/--verbose`` to ``parser``.

    On subcommand parsers (``top_level=False``) the defaults are suppressed, so a flag given before
    the subcommand (``tokenmill --log-level INFO chat``) is not overwritten by the subcommand's default.
    """
    default_level = None if top_level else argparse.SUPPRESS
    default_verbose = 0 if top_level else argparse.SUPPRESS
    parser.add_argument("--log-level", type=str.upper, choices=LEVELS, default=default_level,
                        help="console log level (default: WARNING for chat and generate, INFO otherwise)")
    parser.add_argument("-v", "--verbose", action="count", default=default_verbose,
                        help="log at INFO (-vv: DEBUG), e.g. the engine's periodic stats line in chat and generate")


def add_logging_args_to_subcommands(parser: argparse.ArgumentParser) -> None:
    """Add the logging flags to every subcommand parser below ``parser``, nested ones (``bench serve``) included."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for subparser in set(action.choices.values()):
                add_logging_args(subparser)
                add_logging_args_to_subcommands(subparser)


def log_level(command: str, log_level_flag: str | None, verbose: int) -> int:
    """The console level: ``--log-level`` if given, else INFO for ``-v`` and DEBUG for ``-vv``,
    else WARNING for the interactive commands and INFO for the others."""
    if log_level_flag is not None:
        return logging.getLevelName(log_level_flag)
    if verbose >= 2:
        return logging.DEBUG
    if verbose == 1:
        return logging.INFO
    return logging.WARNING if command in INTERACTIVE_COMMANDS else logging.INFO


def configure_logging(args: argparse.Namespace) -> None:
    """Set up the root logger on stderr at the level ``args`` ask for (see ``log_level``)."""
    level = log_level(args.command, args.log_level, args.verbose)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
