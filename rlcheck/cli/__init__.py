"""The `rlcheck` command."""

from rlcheck.cli.app import app, main

__all__ = ["app", "main"]
