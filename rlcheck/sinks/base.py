"""The sink interface every output shares, and `FanOut`, the container the monitor logs through.

A sink receives one record per step (schema in `rlcheck/sinks/__init__.py`) through
`log(step, record)`; `flush()` makes what it has seen durable, `close()` releases it. The base class
does nothing, so a sink implements only what it needs. `FanOut` forwards every call to its sinks and
keeps a broken optional sink (W&B down, terminal gone) from stopping training: the sink is warned
about once and dropped. A sink of yours with `essential = True` has its errors propagate instead (the
run's own record, metrics.jsonl, is not a sink: the Monitor's `Run` writes it before any view).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from typing import Any

from rlcheck.errors import SinkInitError

__all__ = ["FanOut", "Sink", "SinkInitError", "SinkWarning"]


class SinkWarning(UserWarning):
    """An optional sink failed or could not start; rlcheck carries on without it."""


class Sink:
    """Do-nothing base: subclasses override what they need."""

    essential: bool = False
    """If True, errors of this sink propagate out of `FanOut` instead of disabling the sink."""

    def log(self, step: int, record: dict[str, Any]) -> None:
        """Record one step."""

    def flush(self) -> None:
        """Make everything logged so far durable / visible."""

    def close(self) -> None:
        """Release the sink; it receives no further calls."""

    def state_dict(self) -> dict[str, Any]:
        """What the sink must carry over a resume (its totals), saved in the Monitor's state.json; {}: nothing."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a `state_dict` of the run's previous process."""


class FanOut(Sink):
    """Forwards each call to every sink, in order; a failing non-essential sink is warned about once
    and dropped, the others keep receiving. Errors of essential sinks are raised after every sink
    has had the call (the first one wins). A dropped sink is still closed with the others (quietly,
    it was warned about already), so e.g. a W&B run whose `log` failed mid-run is finished at the
    end of training, holding the steps it took, rather than never."""

    def __init__(self, sinks: Iterable[Sink] = ()):
        self._sinks: list[Sink] = list(sinks)
        self._dropped: list[Sink] = []

    @property
    def sinks(self) -> tuple[Sink, ...]:
        return tuple(self._sinks)

    @property
    def essential(self) -> bool:  # type: ignore[override]
        return any(s.essential for s in self._sinks)

    def log(self, step: int, record: dict[str, Any]) -> None:
        self._each(lambda s: s.log(step, record), "log")

    def flush(self) -> None:
        self._each(lambda s: s.flush(), "flush")

    def state_dict(self) -> dict[str, Any]:
        """Each sink's non-empty `state_dict`, by its class name."""
        return {type(s).__name__: found for s in self._sinks if (found := s.state_dict())}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for sink in self._sinks:
            if isinstance(state.get(type(sink).__name__), dict):
                sink.load_state_dict(state[type(sink).__name__])

    def close(self) -> None:
        dropped, self._dropped = self._dropped, []
        for sink in dropped:
            try:
                sink.close()
            except Exception:  # already warned about when it was dropped
                pass
        self._each(lambda s: s.close(), "close")

    def _each(self, call: Callable[[Sink], None], what: str) -> None:
        first_error: BaseException | None = None
        for sink in list(self._sinks):
            try:
                call(sink)
            except Exception as e:
                if sink.essential:
                    first_error = first_error or e
                    continue
                self._sinks.remove(sink)
                if what != "close":
                    self._dropped.append(sink)
                warnings.warn(
                    f"rlcheck: sink {type(sink).__name__} failed in {what}() with {type(e).__name__}: {e}; "
                    "it is disabled for the rest of the run",
                    SinkWarning,
                    stacklevel=3,
                )
        if first_error is not None:
            raise first_error
