"""The report's MoE routing section (`rlcheck.report`): drawn from the records' `rlcheck/moe/*` metrics when
the run's batches carried routing, absent otherwise."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from rlcheck.core import metrics as K
from rlcheck.core.moe import Routing
from rlcheck.core.monitor import HaltConfig, Monitor, MonitorConfig
from rlcheck.report import write_report
from rlcheck.report.data import collect, moe_layer_count
from rlcheck.synthetic import SyntheticConfig, synthetic_batch

DATA = SyntheticConfig(num_sequences=16, mean_length=30)
LAYERS = 3


def routed(batch, step: int):
    """`batch` with routing over LAYERS MoE layers: from step 10 the engine sends 5% of the tokens to other
    experts at layer 1, and those tokens are 1 nat off (the rerouted tokens carry the mismatch)."""
    rng = np.random.default_rng(step)
    rollout = np.stack([rng.permutation(8)[:2] for _ in range(batch.num_tokens * LAYERS)]).reshape(-1, LAYERS, 2)
    train = rollout.copy()
    moved = rng.random(batch.num_tokens) < (0.05 if step >= 10 else 0.0)
    rollout[moved, 1] = [8, 9]
    lt = batch.logp_train.copy()
    lt[moved] -= 1.0
    return dataclasses.replace(batch, logp_train=lt, routing=Routing(rollout, train))


def record(run_dir: Path, moe: bool, steps: int = 20) -> Path:
    cfg = MonitorConfig(run_dir=run_dir, sinks=("jsonl",), halt=HaltConfig(enabled=False))
    with Monitor(cfg) as mon:
        for step in range(steps):
            batch = synthetic_batch(DATA, step)
            mon.observe(step, routed(batch, step) if moe else batch)
    return run_dir


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory) -> Path:
    return record(tmp_path_factory.mktemp("report-moe") / "run", moe=True)


class TestCollectMoe:
    def test_layers_and_series(self, moe_run):
        """The records' MoE layers are counted and every routing series is collected per step; a run
        without routing has none."""
        data = collect(moe_run)
        assert data.moe_layers == LAYERS
        agree = data.series[K.MOE_ROUTE_AGREE_FRAC]
        assert agree.shape == data.steps.shape and (agree[:10] == 1.0).all() and (agree[10:] < 1.0).all()
        assert (data.series[K.moe_layer_agree(0)] == 1.0).all() and (data.series[K.moe_layer_agree(1)][10:] < 1).all()
        assert np.nansum(data.series[K.moe_first_diff(1)]) > 0 and K.MOE_ABS_DIFF_SHARE in data.series
        assert moe_layer_count([{"metrics": {K.ABS_DIFF_MEAN: 0.1}}]) == 0


class TestMoeSection:
    def test_section_when_routing_is_logged(self, moe_run):
        """The page has the MoE routing section: its sentence (lowest agreement and the layer where routing
        first differs most), both line plots and the per-layer heat map; the routing warnings are marked."""
        page = write_report(moe_run).read_text()
        section = page[page.index("<h2>MoE routing</h2>"):]
        section = section[:section.index("<h2>", 4)]
        assert "3 MoE layers" in section and "first differs most often at MoE layer 1" in section
        assert section.count("<svg") == 3 and "data:image/png;base64," in section  # the heat map: one raster
        assert "tokens routed to the same experts at every MoE layer: median" in section
        assert "moe1-alarm-" in section  # the rerouted tokens' warnings, on the share of |d| they carry

    def test_no_section_without_routing(self, tmp_path):
        """A run whose batches carried no routing gets no MoE section and no heat map."""
        page = write_report(record(tmp_path / "plain", moe=False, steps=5)).read_text()
        assert "MoE routing" not in page and "moe-layers" not in page
