"""The one `rlcheck` app every command module registers on (`@app.command()`), and what the commands
share: the console they print to, and the error handling (an `RLCheckError` from a command is one
`rlcheck: error:` line and exit 2). `rlcheck.cli` imports the command modules and holds `main`.
"""

from __future__ import annotations

import typer
from typer.core import TyperGroup

from rlcheck.errors import RLCheckError

EXIT_USAGE = 2
"""Exit code of a bad argument or input (click's own usage errors use it too)."""


class _Commands(TyperGroup):
    """The command group: an `RLCheckError` from a command is one `rlcheck: error:` line and exit 2."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except RLCheckError as exc:
            typer.echo(f"rlcheck: error: {exc}", err=True)
            raise typer.Exit(EXIT_USAGE) from None


app = typer.Typer(
    name="rlcheck",
    help="Keeps RL post-training honest: rollout vs trainer logprob mismatch monitoring and forensics.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    cls=_Commands,
)


def _print_version(value: bool) -> None:
    if value:
        from rlcheck import __version__
        from rlcheck.versions import TESTED, installed

        stack = ", ".join(f"{name} {installed(name) or 'not installed'}" for name in TESTED)
        typer.echo(f"rlcheck {__version__} ({stack})")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                 help="Print rlcheck's version (and the TRL, verl, vLLM it sees) and exit."),
) -> None:
    """Keeps RL post-training honest: rollout vs trainer logprob mismatch monitoring and forensics."""


def console():
    """The rich console the commands print tables and reports to (stdout, no auto-highlighting)."""
    from rich.console import Console

    return Console(highlight=False)
