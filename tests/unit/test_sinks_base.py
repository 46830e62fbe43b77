"""Tests of rlcheck.sinks.base: the do-nothing Sink and the FanOut container."""

from __future__ import annotations

import warnings

import pytest

from rlcheck.sinks import FanOut, Sink, SinkWarning
from rlcheck.sinks.testing import RecordingSink, example_record


class _Broken(Sink):
    """Fails on every call."""

    def __init__(self, essential: bool = False):
        self.essential = essential
        self.calls = 0

    def log(self, step, record):
        self.calls += 1
        raise RuntimeError("backend down")

    def close(self):
        raise RuntimeError("cannot close")


class TestSink:
    def test_base_does_nothing(self):
        """The base sink accepts every call and is not essential."""
        sink = Sink()
        sink.log(0, example_record(0))
        sink.flush()
        sink.close()
        assert sink.essential is False


class TestFanOut:
    def test_forwards_to_every_sink(self):
        """log, flush and close reach every sink in order."""
        a, b = RecordingSink(), RecordingSink()
        fan = FanOut([a, b])
        fan.log(1, example_record(1))
        fan.flush()
        fan.close()
        assert a.steps == b.steps == [1]
        assert a.num_flushes == b.num_flushes == 1
        assert a.closed and b.closed

    def test_failing_optional_sink_warns_once_and_is_dropped(self):
        """A non-essential sink that raises is warned about once, dropped, and the others keep going."""
        broken, ok = _Broken(), RecordingSink()
        fan = FanOut([broken, ok])
        with pytest.warns(SinkWarning) as caught:
            for step in range(3):
                fan.log(step, example_record(step))
            fan.close()
        assert len(caught) == 1
        assert "_Broken" in str(caught[0].message) and "backend down" in str(caught[0].message)
        assert broken.calls == 1
        assert ok.steps == [0, 1, 2] and ok.closed
        assert fan.sinks == (ok,)

    def test_dropped_sink_is_closed_at_the_end(self):
        """A sink dropped after failing is still closed by FanOut.close (quietly: no second warning)."""
        broken, ok = _Broken(), RecordingSink()
        closed = []
        broken.close = lambda: closed.append(True)
        fan = FanOut([broken, ok])
        with pytest.warns(SinkWarning) as caught:
            fan.log(0, example_record(0))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            fan.close()
        assert len(caught) == 1 and closed == [True] and ok.closed

    def test_essential_error_propagates_after_others(self):
        """An essential sink's error is raised, after the other sinks got the call, with no warning."""
        broken, ok = _Broken(essential=True), RecordingSink()
        fan = FanOut([broken, ok])
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with pytest.raises(RuntimeError, match="backend down"):
                fan.log(0, example_record(0))
        assert ok.steps == [0]
        assert fan.sinks == (broken, ok)
        assert fan.essential

    def test_keyboard_interrupt_is_not_swallowed(self):
        """Only Exceptions are isolated; a KeyboardInterrupt stops the run."""

        class _Interrupted(Sink):
            def log(self, step, record):
                raise KeyboardInterrupt

        with pytest.raises(KeyboardInterrupt):
            FanOut([_Interrupted()]).log(0, example_record(0))
