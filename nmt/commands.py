"""Typer commands generated from options dataclasses: one field, one command-line option.

``@command(app, OptionsClass)`` turns every field of the dataclass (nmt/options.py reads its
metadata) into an option or argument with its help, bounds, choices, panel and default, then
appends the command's own parameters and the logging options every command shares. The command
function receives only the options given on the command line, so the library can merge them over
a recipe's and the defaults (CLI > recipe > default).
"""

from __future__ import annotations

import inspect
import logging
import sys
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Callable, Literal, Optional

import typer
from typer.core import TyperCommand, TyperGroup

try:  # newer typer carries its own copy of click
    import typer._click as click
    from typer._click.exceptions import ClickException, NoArgsIsHelpError
except ImportError:
    import click
    from click.exceptions import ClickException, NoArgsIsHelpError

from nmt.errors import NmtError, Stopped
from nmt.log import logger, setup_logging, state
from nmt.options import Option, options_of, parse_overrides

COMMAND_OPTIONS: dict[str, type] = {}  # command name -> its options dataclass
KEYWORD = inspect.Parameter.KEYWORD_ONLY
COMMON = [  # every command's logging options
    inspect.Parameter("verbose", KEYWORD, default=0, annotation=Annotated[int, typer.Option(
        "--verbose", "-v", count=True, help="More detail; tracebacks on errors.")]),
    inspect.Parameter("quiet", KEYWORD, default=False, annotation=Annotated[bool, typer.Option(
        "--quiet", "-q", help="Only warnings and errors.")]),
    inspect.Parameter("log_format", KEYWORD, default="text", annotation=Annotated[Literal["text", "json"], typer.Option(
        "--log-format", help="Log lines as rich text or JSON lines.")]),
    inspect.Parameter("context", KEYWORD, annotation=typer.Context),
]


def without_flag_types(params: list) -> list:
    """A flag takes no value: typer would show it as <bool> (`--quiet <bool>`), inviting `--quiet true`,
    and a counter (`-vv`) as <int>, inviting `-v 2`."""
    for param in params:
        if getattr(param, "is_flag", False) or getattr(param, "count", False):
            param.metavar = ""
    return params


class Command(TyperCommand):
    def get_params(self, ctx: click.Context) -> list:
        return without_flag_types(super().get_params(ctx))


class Group(TyperGroup):
    """For ``typer.Typer(cls=Group)``: the group's own flags (--help, --version) shown without a type."""

    def get_params(self, ctx: click.Context) -> list:
        return without_flag_types(super().get_params(ctx))


def cli_type(option: Option) -> Any:
    """What typer parses; nmt.options.coerce then makes the field's type (tuples, KEY=VALUE mappings)."""
    kind = option.type
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        (kind,) = [arg for arg in typing.get_args(kind) if arg is not type(None)]
    if option.metadata.get("path"):  # shown as <path>; invoke gives the library text, as the recipes do
        return list[Path] if typing.get_origin(kind) is list else Path
    return {tuple: str, dict: list[str]}.get(typing.get_origin(kind), kind)


def as_text(value: Any) -> Any:
    """typer's Path values as the text the options dataclasses hold."""
    if isinstance(value, Path):
        return str(value)
    return [as_text(item) for item in value] if isinstance(value, (list, tuple)) else value


def parameter(option: Option) -> inspect.Parameter:
    """The typer parameter of one field: its flags, help with bounds, panel and (shown) default."""
    meta, kind, help = option.metadata, cli_type(option), option.help_with_bounds
    if meta.get("argument"):
        info = typer.Argument(metavar=meta.get("metavar"), help=help, show_default=False)
    else:
        flags = option.flags
        if kind is bool and "flags" not in meta:
            flags = (f"{flags[0]}/--no-{flags[0][2:]}",)
        info = typer.Option(*flags, help=help, rich_help_panel=meta.get("panel"), metavar=meta.get("metavar"))
    default = option.default
    if kind is str and isinstance(default, tuple):
        default = ",".join(map(str, default))
    elif isinstance(default, dict) or option.required:
        default = inspect.Parameter.empty if option.required else None
    return inspect.Parameter(option.name, KEYWORD, default=default, annotation=Annotated[Optional[kind], info])


def command(group: typer.Typer, options_class: type | None = None, name: str | None = None,
            prefix: str = "") -> Callable[[Callable], Callable]:
    """Register ``run`` as a command of ``group`` taking ``options_class``'s fields, then run's own parameters.

    ``run`` gets the options given on the command line as a dict (its first argument), then its own.
    """

    def register(run: Callable) -> Callable:
        own = list(inspect.signature(run, eval_str=True).parameters.values())[1 if options_class else 0:]
        fields = options_of(options_class) if options_class else {}
        params = [parameter(option) for option in fields.values()] + [p.replace(kind=KEYWORD) for p in own] + COMMON

        def invoke(**values: Any) -> None:
            context = values.pop("context")
            setup_logging(values.pop("verbose"), values.pop("quiet"), values.pop("log_format"))
            given = {name: as_text(values.pop(name)) for name in fields}
            given = {name: parse_overrides(value) if typing.get_origin(fields[name].type) is dict else value
                     for name, value in given.items() if context.get_parameter_source(name).name == "COMMANDLINE"}
            run(*([given] if options_class else []), **values)

        invoke.__signature__ = inspect.Signature(params)
        invoke.__doc__ = run.__doc__
        group.command(name or run.__name__, cls=Command)(invoke)
        if options_class:
            COMMAND_OPTIONS[prefix + (name or run.__name__)] = options_class
        return run

    return register


def sub_app(app: typer.Typer, name: str, help: str) -> typer.Typer:
    """A group of commands under ``nmt NAME`` (nmt plot attention, nmt export ctranslate2)."""
    group = typer.Typer(help=help, no_args_is_help=True, cls=Group)
    app.add_typer(group, name=name)
    return group


def run_app(app: typer.Typer) -> None:
    """Run the command line and exit: every error the user can cause ends in one `error:` line (-v: with
    its traceback); a run stopped by a signal ends with what was saved, and 128 + the signal."""
    try:
        code = app(standalone_mode=False)
    except NoArgsIsHelpError as exc:  # typer has printed the help already
        sys.exit(exc.exit_code)
    except ClickException as exc:  # a bad option or value, found by the parser: one line, not a box
        last_line(f"error: {exc.format_message().replace('Value error, ', '')}")  # typer's validator prefix
        sys.exit(exc.exit_code)
    except NmtError as exc:
        if state["verbose"]:
            logger.exception("error")
        last_line(f"error: {exc}")
        sys.exit(1)
    except Stopped as exc:
        last_line(str(exc) or "interrupted", logging.WARNING)  # where the run stopped, what was saved
        sys.exit(exc.exit_code)
    except (KeyboardInterrupt, typer.Abort):
        code = 130
    if code == 130:  # typer turns a Ctrl-C in a command into this exit code, without a word
        last_line("interrupted", logging.WARNING)
    sys.exit(code if isinstance(code, int) else 0)


def last_line(text: str, level: int = logging.ERROR) -> None:
    """A command's last word on stderr: a plain line, or with --log-format json a JSON record like
    every other line there (an error's without its "error: ")."""
    if state["format"] == "json":
        logger.log(level, text.removeprefix("error: "), extra={"fields": {"kind": "exit"}})
    else:
        typer.echo(text, err=True)
