"""The `rlcheck` command: one Typer `app` (`rlcheck.cli.base`) on which each command module registers
its commands, listed in `COMMANDS` in the order `rlcheck --help` shows them:

- `run_commands`: summarize, report, demo (a run directory: read it, or make one);
- `inspection`: diagnose, replay (a run or a dump, after the fact);
- `models`: make-model;
- `preflight`: preflight (before a run: the settings on which the engine and the trainer would differ);
- `forensics`: stress, sweep (vLLM under load, replayed against the reference), localize (the first
  divergent decoder layer);
- `repro`: repro (an engine failure shrunk to a standalone reproducer and a bug report draft).

`main` is the console entry point (`rlcheck = "rlcheck.cli:main"` in pyproject.toml).
"""

import typer

# the commands register as their modules are imported: this order is the order of `rlcheck --help`
# isort: off
from rlcheck.cli import run_commands, inspection, models, preflight, forensics, repro
# isort: on
from rlcheck.cli.base import EXIT_USAGE, app
from rlcheck.errors import RLCheckError

COMMANDS = (run_commands, inspection, models, preflight, forensics, repro)
"""The command modules; each registers its commands on `app` when it is imported."""


def main() -> None:
    """Entry point: rlcheck errors print as one line and exit 2, not as a traceback; an unexpected
    crash exits 3, so that a CI gate tells it from a finding (exit 1)."""
    try:
        app()
    except RLCheckError as exc:
        typer.echo(f"rlcheck: error: {exc}", err=True)
        raise SystemExit(EXIT_USAGE) from None
    except Exception:  # noqa: BLE001 - reported whole, with its own exit code
        import traceback

        traceback.print_exc()
        typer.echo("rlcheck: internal error (the traceback above); please report it", err=True)
        raise SystemExit(3) from None


__all__ = ["COMMANDS", "app", "main"]
