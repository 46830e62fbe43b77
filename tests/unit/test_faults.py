"""`rlcheck.faults`: `parse_inject` maps NAME=VALUE text onto faults, and `SkipSync` skips every K-th sync."""

from __future__ import annotations

import pytest

from rlcheck.errors import ConfigError
from rlcheck.faults import Fault, SkipSync, parse_inject


class TestParseInject:
    @pytest.mark.parametrize("spec", [None, ""])
    def test_none_is_no_fault(self, spec):
        """No spec gives the do-nothing fault, which never skips a sync."""
        fault = parse_inject(spec)
        assert type(fault) is Fault and fault.describe() == "none"
        assert not any(fault.skip_sync(step) for step in range(100))

    def test_skip_sync_every(self):
        """skip-sync-every=4 skips the syncs after the updates of steps 3, 7 and 11 (of 0..12) only."""
        fault = parse_inject("skip-sync-every=4")
        assert fault == SkipSync(4)
        assert [step for step in range(13) if fault.skip_sync(step)] == [3, 7, 11]

    def test_describe_round_trips(self):
        """`describe()` is the spec that parses back to the same fault."""
        fault = SkipSync(7)
        assert parse_inject(fault.describe()) == fault

    @pytest.mark.parametrize("spec, match", [
        ("skip-sync=4", "unknown fault"),
        ("drop-weights=1", "unknown fault"),
        ("skip-sync-every", "integer"),
        ("skip-sync-every=", "integer"),
        ("skip-sync-every=four", "integer"),
        ("skip-sync-every=2.5", "integer"),
        ("skip-sync-every=1", "K >= 2"),
        ("skip-sync-every=0", "K >= 2"),
        ("skip-sync-every=-3", "K >= 2"),
    ])
    def test_rejects_bad_specs(self, spec, match):
        """Unknown names, values that are not integers and K < 2 are ConfigErrors saying which."""
        with pytest.raises(ConfigError, match=match):
            parse_inject(spec)


class TestSkipSync:
    def test_rejects_k_below_two(self):
        """Constructed directly, K = 1 (never sync) is a ConfigError too."""
        with pytest.raises(ConfigError):
            SkipSync(1)

    @pytest.mark.parametrize("every", [2, 3, 5])
    def test_one_skip_per_period(self, every):
        """Over any K consecutive steps exactly one sync is skipped, the one after step K-1 mod K."""
        fault = SkipSync(every)
        skipped = [s for s in range(10 * every) if fault.skip_sync(s)]
        assert skipped == list(range(every - 1, 10 * every, every))
