"""The run directory and its one owner, `Run` (`rlcheck.core.run.run`); the files' formats and
durability rules in `journal`, `files`, `dump`, `guard_record` and `guard_files`."""

from rlcheck.core.run.run import LOOP_FILE, DumpInfo, Run

__all__ = ["LOOP_FILE", "DumpInfo", "Run"]
