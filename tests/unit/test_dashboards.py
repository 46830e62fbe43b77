"""Tests of dashboards/ (the W&B workspace and report in code): they build and serialise offline."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("wandb_workspaces")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "dashboards"))

import push  # noqa: E402
import rlcheck_dashboards as D  # noqa: E402

from rlcheck.core import metrics as K  # noqa: E402
from rlcheck.sinks import wandb as W  # noqa: E402


@pytest.fixture
def no_network(monkeypatch):
    """wandb.Api and the reports' GraphQL calls raise: anything that reaches for the server fails."""
    import wandb
    import wandb_workspaces.reports.v2.interface as report_interface

    def refuse(*args, **kwargs):
        raise AssertionError("the W&B API was called")

    monkeypatch.setattr(wandb, "Api", refuse)
    monkeypatch.setattr(report_interface, "execute_graphql", refuse)


class TestBuildWorkspace:
    def test_builds_and_serialises_offline(self, no_network):
        """The workspace builds for a given entity/project and dumps to JSON without the API."""
        spec = D.workspace_spec(D.build_workspace("team-a", "proj-b", name="mine"))
        json.dumps(spec)
        assert (spec["entity"], spec["project"], spec["displayName"]) == ("team-a", "proj-b", "mine")
        names = [s["name"] for s in spec["spec"]["section"]["panelBankConfig"]["sections"]]
        assert names == [s.name for s in D.sections()]

    def test_refers_to_every_requested_key(self, no_network):
        """The workspace shows the headline metrics, every token/ratio/seq key, the alarm count, the
        summary totals, the offenders table and the |d| histogram."""
        keys = D.metric_keys(D.workspace_spec(D.build_workspace("e", "p")))
        groups = ("rlcheck/token/", "rlcheck/ratio/", "rlcheck/seq/")
        wanted = {k for k in K.ALWAYS if k.startswith(groups)} | {K.FIRST_DIV_MIN, K.FIRST_DIV_P50}
        wanted |= {K.frac_abs_diff_above(t) for t in D.DEFAULT_THRESHOLDS}
        wanted |= {K.ALARM_COUNT, D.SUMMARY_ALARMS_TOTAL, W.OFFENDERS_KEY, W.HIST_KEY}
        assert wanted <= keys

    def test_thresholds_set_the_fraction_keys(self, no_network):
        """Custom |d| levels replace the default `frac_abs_diff_gt_*` keys."""
        keys = D.metric_keys(D.workspace_spec(D.build_workspace("e", "p", thresholds=(0.05, 2.0))))
        assert {k for k in keys if k.startswith("rlcheck/token/frac_")} == {
            K.frac_abs_diff_above(0.05), K.frac_abs_diff_above(2.0)
        }


class TestMoeSection:
    def test_only_with_moe_layers(self, no_network):
        """Without `moe_layers` no view refers to an `rlcheck/moe/*` key; with 3 layers the workspace and the
        report get the MoE routing section (after Signatures) with every layer's agreement and first-diff keys."""
        plain = D.metric_keys(D.workspace_spec(D.build_workspace("e", "p")))
        assert not {k for k in plain if k.startswith("rlcheck/moe/")}
        spec = D.workspace_spec(D.build_workspace("e", "p", moe_layers=3))
        names = [s["name"] for s in spec["spec"]["section"]["panelBankConfig"]["sections"]]
        assert names[names.index("Signatures") + 1] == "MoE routing"
        moe = {k for k in D.metric_keys(spec) if k.startswith("rlcheck/moe/")}
        assert moe == {K.MOE_ROUTE_AGREE_FRAC, K.MOE_ABS_DIFF_SHARE, K.MOE_ABS_DIFF_LIFT, K.MOE_TOKEN_COUNT,
                       *(K.moe_layer_agree(i) for i in range(3)), *(K.moe_first_diff(i) for i in range(3))}
        assert D.metric_keys(D.report_spec(D.build_report("e", "p", moe_layers=3))) == D.metric_keys(spec)

    def test_push_flag_and_bad_count(self, no_network, capsys):
        """`push.py --moe-layers 2 --dry-run` prints views with layer 1's key; a negative count exits 1."""
        assert push.main(["--entity", "e", "--project", "p", "--dry-run", "--moe-layers", "2"]) == 0
        assert K.moe_layer_agree(1) in D.metric_keys(json.loads(capsys.readouterr().out)["workspace"])
        assert push.main(["--entity", "e", "--project", "p", "--dry-run", "--moe-layers", "-1"]) == 1
        assert "--moe-layers" in capsys.readouterr().err


class TestBuildReport:
    def test_builds_and_serialises_offline(self, no_network):
        """The report builds and dumps to JSON without the API, keeping its entity/project."""
        spec = D.report_spec(D.build_report("team-a", "proj-b"))
        json.dumps(spec)
        assert spec["project"] == {"name": "proj-b", "entityName": "team-a"}
        assert spec["displayName"] == D.REPORT_TITLE

    def test_same_keys_as_workspace(self, no_network):
        """The report and the workspace refer to the same metric keys."""
        report = D.metric_keys(D.report_spec(D.build_report("e", "p")))
        assert report == D.metric_keys(D.workspace_spec(D.build_workspace("e", "p")))

    def test_report_keeps_its_runsets(self, no_network):
        """Serialising offline leaves the report's own run sets pointing at entity/project."""
        report = D.build_report("team-a", "proj-b")
        D.report_spec(report)
        runsets = [rs for b in report.blocks for rs in getattr(b, "runsets", ())]
        assert runsets and all((rs.entity, rs.project) == ("team-a", "proj-b") for rs in runsets)


class TestMetricKeys:
    def test_finds_keys_anywhere(self):
        """Keys are found in nested values, dict keys and behind summary column prefixes; prose is not."""
        spec = {
            "a": [{"metrics": [K.ABS_DIFF_MEAN]}, "summary_metrics." + D.SUMMARY_WORST_STEP],
            "summary:" + W.OFFENDERS_KEY: True,
            "text": "see rlcheck/token/ in the docs",
            "n": 3,
        }
        assert D.metric_keys(spec) == {K.ABS_DIFF_MEAN, D.SUMMARY_WORST_STEP, W.OFFENDERS_KEY}


class TestPush:
    def test_dry_run_prints_both_specs(self, no_network, capsys):
        """--dry-run --report prints the workspace and the report as JSON without the API."""
        assert push.main(["--entity", "e", "--project", "p", "--report", "--dry-run", "--thresholds", "0.2,3"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out.keys() == {"workspace", "report"}
        assert K.frac_abs_diff_above(3.0) in D.metric_keys(out["workspace"])

    def test_bad_thresholds(self, no_network, capsys):
        """Thresholds that are not positive numbers are refused with a message, exit code 1."""
        assert push.main(["--entity", "e", "--project", "p", "--dry-run", "--thresholds", "0,x"]) == 1
        assert "--thresholds" in capsys.readouterr().err

    def test_save_failure_says_how_to_fix(self, no_network, capsys):
        """A save that cannot reach W&B ends with exit code 1 and a hint to log in."""
        assert push.main(["--entity", "e", "--project", "p"]) == 1
        assert "wandb login" in capsys.readouterr().err
