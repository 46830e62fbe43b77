"""A failure on any rank reaches every rank (see `rlcheck.distributed`): a rank whose own part of a step
fails (an OOM in its statistics, a bad batch) does not leave the collective: `RankGuard` keeps its first
exception and lets it go on with neutral values, and the next checked exchange (`RankGuard.exchange`,
an all-gather that carries each rank's status) raises on every rank: the failed rank its own exception,
the others the same `rlcheck.errors` class when it can travel (`sendable`), else an `RLCheckError`,
naming the rank. Only plain data crosses ranks (a class name and a message), never an exception object.
torch is imported lazily here."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rlcheck import errors
from rlcheck.errors import RLCheckError


def sendable(exc: BaseException) -> str | None:
    """The name of `exc`'s class when the other ranks can raise it too, else None: a class of
    `rlcheck.errors` that rebuilds the same error from its message alone. The receiver looks the name
    up among rlcheck's own error classes (`rebuild`), so nothing a rank sends is executed."""
    name = type(exc).__name__
    if not isinstance(exc, RLCheckError) or getattr(errors, name, None) is not type(exc):
        return None
    try:
        copy = type(exc)(str(exc))
    except Exception:  # a richer constructor (RecordWriteError, ActorDiedError, ...)
        return None
    return name if str(copy) == str(exc) else None


def rebuild(name: str | None, message: str, step: int, rank: int = 0) -> RLCheckError:
    """Rank `rank`'s error on another rank: the `rlcheck.errors` class `name` from its message, or (None) an
    `RLCheckError` naming it."""
    cls = getattr(errors, name, None) if name is not None else None
    if isinstance(cls, type) and issubclass(cls, RLCheckError):
        return cls(message if rank == 0 else f"rank {rank}: {message}")
    return RLCheckError(f"rlcheck stopped on rank {rank} at step {step}: {message}")


def describe(exc: BaseException) -> tuple[str | None, str]:
    """(the class name when it can travel, the message to send) of `exc`."""
    name = sendable(exc)
    return name, str(exc) if name else f"{type(exc).__name__}: {exc}"


class RankGuard:
    """This rank's first failure in one collective step (see the module docstring)."""

    def __init__(self, step: int, group: Any = None):
        self.step, self.group = step, group
        self.failure: Exception | None = None

    def call(self, fn: Callable[..., Any], *args: Any, default: Any = None) -> Any:
        """`fn(*args)`, or `default` when it raises (kept as the failure) or a failure came before."""
        if self.failure is not None:
            return default
        try:
            return fn(*args)
        except Exception as exc:  # every rank must hear of it at the next exchange
            self.failure = exc
            return default

    def exchange(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order (an all-gather); raises on every rank when a rank failed."""
        import torch.distributed as dist

        status = ("ok", obj) if self.failure is None else ("failed", *describe(self.failure))
        parts: list = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(parts, status, group=self.group)
        failed = [(rank, part) for rank, part in enumerate(parts) if part[0] == "failed"]
        if failed:
            if self.failure is not None:
                raise self.failure
            rank, (_, name, message) = failed[0]
            raise rebuild(name, message, self.step, rank)
        return [part[1] for part in parts]
