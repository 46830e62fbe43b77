"""How rank 0's Monitor error reaches the other ranks in `observe_across_ranks`: as plain data (the
class name and the message), rebuilt from rlcheck's own error classes, never an unpickled object."""

from __future__ import annotations

import json

from rlcheck.distributed.failures import rebuild as _rebuild
from rlcheck.distributed.failures import sendable as _sendable
from rlcheck.errors import ConfigError, InputError, RecordWriteError, RLCheckError, RunDirError


class InputErrorLookalike(RLCheckError):
    """Not rlcheck's InputError, though it has its name."""


InputErrorLookalike.__name__ = "InputError"


class TestErrorAcrossRanks:
    def test_rlcheck_errors_travel_as_name_and_message(self):
        """ConfigError, InputError and RunDirError go as (name, message), plain JSON, and come back as the same error."""
        for exc in (ConfigError("bad top_k"), InputError("rlcheck/not-yours"), RunDirError("locked by pid 7")):
            name = _sendable(exc)
            sent = json.loads(json.dumps([name, str(exc)]))
            back = _rebuild(*sent, step=3)
            assert type(back) is type(exc) and str(back) == str(exc)

    def test_other_errors_are_named_in_an_rlcheck_error(self):
        """A non-rlcheck error, an rlcheck error that its message cannot rebuild (RecordWriteError takes a
        report), and a class that only borrows an rlcheck name are sent as None: an RLCheckError naming them."""
        record_error = RecordWriteError.__new__(RecordWriteError)
        Exception.__init__(record_error, "could not record step 3")
        for exc in (ZeroDivisionError("division by zero"), record_error, InputErrorLookalike("x")):
            assert _sendable(exc) is None
        back = _rebuild(None, "ZeroDivisionError: division by zero", step=3)
        assert type(back) is RLCheckError
        assert str(back) == "rlcheck stopped on rank 0 at step 3: ZeroDivisionError: division by zero"

    def test_unknown_name_is_not_looked_up_elsewhere(self):
        """A name that is not an rlcheck error class (a builtin, a function of rlcheck.errors) rebuilds as RLCheckError."""
        for name in ("OSError", "TYPE_CHECKING", "annotations"):
            assert type(_rebuild(name, "m", step=0)) is RLCheckError
