"""One attribute of one object replaced for a while (TRL's and accelerate's methods, on an instance)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def replaced(obj: Any, name: str, value: Any) -> Iterator[None]:
    """Within it `obj.name` is `value` (on this instance only); afterwards what it was: the instance's
    own attribute, or its class's again."""
    own = name in vars(obj)
    before = vars(obj).get(name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        if own:
            setattr(obj, name, before)
        else:
            delattr(obj, name)
