"""How rank 0's Monitor error reaches the other ranks in `observe_across_ranks`: as plain data (the
class name and the message), rebuilt from rlcheck's own error classes, never an unpickled object."""

from __future__ import annotations

import json

import pytest

from rlcheck.distributed.failures import RankGuard, describe
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


class TestRankGuard:
    """Issue 42 item 8, the logic alone (two real gloo ranks: tests/integration/test_distributed.py::
    TestExtrasAcrossRanks::test_a_failure_on_rank_1_reaches_every_rank): a rank's own failure is kept, the
    step goes on with neutral values, and the next exchange raises on every rank."""

    @staticmethod
    def _gather(monkeypatch, others):
        """torch.distributed's all-gather as this rank (0) would see it, the other ranks sending `others`."""
        dist = pytest.importorskip("torch.distributed")
        monkeypatch.setattr(dist, "get_world_size", lambda group=None: 1 + len(others))

        def all_gather_object(parts, obj, group=None):
            parts[:] = [obj, *others]

        monkeypatch.setattr(dist, "all_gather_object", all_gather_object)

    def test_own_failure_kept_and_raised_at_the_exchange(self, monkeypatch):
        self._gather(monkeypatch, [("ok", 2)])
        guard = RankGuard(step=4)
        calls = []

        def oom():
            raise MemoryError("CUDA out of memory")

        assert guard.call(oom, default="neutral") == "neutral"
        assert guard.call(calls.append, 1, default="skipped") == "skipped" and calls == []  # nothing after it
        with pytest.raises(MemoryError, match="out of memory"):
            guard.exchange(1)

    def test_another_ranks_failure_raised_here_naming_it(self, monkeypatch):
        self._gather(monkeypatch, [("ok", 2), ("failed", *describe(RuntimeError("CUDA out of memory")))])
        with pytest.raises(RLCheckError, match="rank 2 at step 4: RuntimeError: CUDA out of memory"):
            RankGuard(step=4).exchange(1)
        self._gather(monkeypatch, [("failed", *describe(InputError("empty step")))])
        with pytest.raises(InputError, match="rank 1: empty step"):
            RankGuard(step=4).exchange(1)

    def test_all_ok_returns_every_ranks_part(self, monkeypatch):
        self._gather(monkeypatch, [("ok", {"n": 2}), ("ok", {"n": 3})])
        assert RankGuard(step=0).exchange({"n": 1}) == [{"n": 1}, {"n": 2}, {"n": 3}]


class TestTheRanksExchange:
    """What `observe_across_ranks` exchanges after each rank's own part (the correction, the tally, the measured floor),
    rank 0's side, the other rank's message faked (the real ranks: tests/integration/test_distributed.py)."""

    def test_different_corrections_are_named(self, monkeypatch):
        """A rank passing another correction is refused with a ConfigError naming each rank's (was a ValueError from
        the message itself once the exchange carried the floor sample)."""
        dist = pytest.importorskip("torch.distributed")
        from rlcheck.core.correction import CorrectionConfig
        from rlcheck.core.stats import StatsConfig
        from rlcheck.core.tally import Tally
        from rlcheck.distributed import observe_across_ranks

        theirs = CorrectionConfig(rollout_is="token")
        sent = iter([[], ("ok", (theirs, Tally(), 0.02))])  # rank 1's alarms, then its part of the exchange
        monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
        monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
        monkeypatch.setattr(dist, "all_gather_object", lambda parts, obj, group=None: parts.__setitem__(
            slice(None), [obj, next(sent)]))
        with pytest.raises(ConfigError, match="the ranks pass different corrections .*rollout_is='token'"):
            observe_across_ranks(None, 0, None, StatsConfig(), floor_sample=0.01)
