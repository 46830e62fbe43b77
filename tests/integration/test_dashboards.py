"""The dashboards against a real run: every key a panel refers to is one the Monitor logs to W&B."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("wandb")
pytest.importorskip("wandb_workspaces")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "dashboards"))

import rlcheck_dashboards as D  # noqa: E402

from rlcheck import Monitor, MonitorConfig  # noqa: E402
from rlcheck.core.correction import CorrectionConfig  # noqa: E402
from rlcheck.core.monitor import HaltConfig  # noqa: E402
from rlcheck.core.quarantine import QuarantineConfig  # noqa: E402
from rlcheck.core.stats import StatsConfig  # noqa: E402
from rlcheck.sinks import WandbConfig  # noqa: E402
from rlcheck.sinks import wandb as W  # noqa: E402
from rlcheck.sinks.testing import read_offline_run  # noqa: E402
from rlcheck.synthetic import SyntheticConfig, synthetic_batch  # noqa: E402

MOE_LAYERS = 2  # the batches carry routing: the MoE section's keys are logged too
THRESHOLDS = (0.05, 0.3, 2.0)  # not the defaults: the dashboards must follow the configuration
STREAM = SyntheticConfig(num_sequences=200, mean_length=20, corrupt_every_step=2)  # offenders + alarms every step


def _logged(records: list[dict]) -> tuple[set[str], dict[str, str]]:
    """(every history and summary key, media type by key) of an offline run's records. W&B flattens
    a logged Table or Histogram into `<key>._type`, `<key>.path`, ...: those count as `<key>`."""
    flat = set()
    for r in records:
        if r["type"] == "history":
            flat |= set(r["history"]["item"])
        elif r["type"] == "summary":
            flat |= set(r["summary"]["update"])
    media = {k.removesuffix("._type") for k in flat if k.endswith("._type")}
    plain = {k for k in flat if not any(k.startswith(m + ".") for m in media)}
    types = {
        m: next(r["history"]["item"][m + "._type"] for r in records if r["type"] == "history")
        for m in media
    }
    return plain | media, types


def routed(batch, step: int):
    """`batch` with routing over MOE_LAYERS MoE layers (top-2 of 8), the trainer's other on 1 in 10 tokens:
    the `rlcheck/moe/*` metrics of the MoE section, every one defined."""
    import dataclasses

    from rlcheck.core.moe import Routing

    rng = np.random.default_rng(step)
    rollout = rng.integers(0, 8, (batch.num_tokens, MOE_LAYERS, 2))
    train = rollout.copy()
    train[rng.random(batch.num_tokens) < 0.1, -1] = [8, 9]
    return dataclasses.replace(batch, routing=Routing(rollout, train))


@pytest.fixture
def offline_run(tmp_path, monkeypatch) -> Path:
    """An offline W&B run of a real Monitor (jsonl + wandb sinks) over 3 synthetic steps, each with
    offenders, alarms and MoE routing; every directory wandb writes is under tmp_path."""
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_MODE", "offline")  # wandb's process-wide settings keep the first run's env
    for var in ("WANDB_DIR", "WANDB_DATA_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(tmp_path / var.lower()))
    cfg = MonitorConfig(
        run_dir=tmp_path / "run",
        sinks=("jsonl", "wandb"),
        stats=StatsConfig(thresholds=THRESHOLDS),
        halt=HaltConfig(enabled=False),
        wandb=WandbConfig(mode="offline"),
        # the quarantine and correction panels' keys: logged when configured (guard-named sequences only,
        # so the corrupted ones stay in the step and alarm)
        quarantine=QuarantineConfig(rules=("guard",)),
        correction=CorrectionConfig(rollout_is="token", rollout_rs="seq_mean_k3", rollout_rs_threshold=0.01),
    )
    with Monitor(cfg) as mon:
        for step in range(3):
            report = mon.observe(step, routed(synthetic_batch(STREAM, step), step))
            assert report.alarms and report.offenders
    (run,) = (tmp_path / "run" / "wandb").glob("offline-run-*")
    return run


@pytest.mark.slow
class TestDashboardKeys:
    def test_every_panel_key_is_logged(self, offline_run):
        """Each key the workspace and the report refer to is a history or summary key of the run."""
        try:
            records = read_offline_run(offline_run)
        except RuntimeError as e:
            pytest.skip(str(e))
        logged, types = _logged(records)
        for spec in (
            D.workspace_spec(D.build_workspace("e", "p", thresholds=THRESHOLDS, moe_layers=MOE_LAYERS)),
            D.report_spec(D.build_report("e", "p", thresholds=THRESHOLDS, moe_layers=MOE_LAYERS)),
        ):
            referenced = D.metric_keys(spec)
            assert len(referenced) > 40 and referenced - logged == set()
        assert types == {W.OFFENDERS_KEY: "table-file", W.HIST_KEY: "histogram"}
