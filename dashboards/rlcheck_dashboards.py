"""The rlcheck W&B workspace and report, defined in code with `wandb-workspaces`.

    from rlcheck_dashboards import build_workspace, build_report   # dashboards/ on sys.path
    build_workspace("my-team", "my-project").save()               # needs `wandb login`

Both views share one list of sections (`sections()`): overview, token, importance ratio, sequence,
signatures, quarantine, alarms, offenders, and for a mixture-of-experts model (`moe_layers=L`, the
`rlcheck/moe/*` metrics of a batch that carries routing) MoE routing. Every metric key comes from `rlcheck.core.metrics` and
`rlcheck.sinks.wandb`; nothing here retypes a key. Building touches no network: only `.save()` does
(and, for the report, serialising its run sets, which looks up the project id; see `report_spec`).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import wandb_workspaces.reports.v2 as wr
import wandb_workspaces.workspaces as ws

from rlcheck.core import metrics as K
from rlcheck.core.stats import StatsConfig
from rlcheck.sinks import wandb as W

WORKSPACE_NAME = "rlcheck: rollout vs trainer logprobs"
REPORT_TITLE = "rlcheck: rollout vs trainer logprob mismatch"
_STATS = StatsConfig()  # the default levels, named in the panel titles
DEFAULT_THRESHOLDS = _STATS.thresholds
"""|d| levels of the `frac_abs_diff_gt_*` panel: the monitor's defaults (pass yours if you changed them)."""

# Run summary keys the W&B sink writes (tests/integration/test_dashboards.py checks a real run logs them).
SUMMARY_ALARMS_TOTAL = W.SUMMARY_ALARMS_TOTAL
SUMMARY_WORST_STEP = W.SUMMARY_WORST_STEP
SUMMARY_WORST_ABS_DIFF_MEAN = W.SUMMARY_WORST_ABS_DIFF_MEAN
SUMMARY_LAST_ALARM = W.SUMMARY_LAST_ALARM
SUMMARY_COLUMNS = tuple(
    f"summary:{k}"
    for k in (SUMMARY_ALARMS_TOTAL, SUMMARY_WORST_STEP, SUMMARY_WORST_ABS_DIFF_MEAN, SUMMARY_LAST_ALARM)
)
"""Runs-table columns pinned in the workspace and the report's run sets."""


@dataclass(frozen=True)
class Section:
    """One section of the dashboards: a workspace section, or a report heading + panel grid."""

    name: str
    description: str
    panels: tuple[Any, ...]
    """`wandb_workspaces.reports.v2` panels (LinePlot, BarPlot, ...)."""


def _line(title: str, keys: Sequence[str], log_y: bool | None = None) -> wr.LinePlot:
    return wr.LinePlot(title=title, x="Step", y=list(keys), log_y=log_y)


def _overview() -> Section:
    return Section(
        "Overview",
        "The headline numbers: how far the trainer's logprobs are from the rollout's, and the alarms.",
        (
            _line(f"mean |d| (nats): clipped at {_STATS.clip:g} (what the detectors watch) and raw",
                  [K.ABS_DIFF_CLIPPED_MEAN, K.ABS_DIFF_MEAN], log_y=True),
            _line("max |d| (nats)", [K.ABS_DIFF_MAX], log_y=True),
            _line(f"catastrophic fraction (|d| >= {_STATS.catastrophic_tau:g}): tokens and sequences",
                  [K.CATASTROPHIC_TOKEN_FRAC, K.SEQ_CATASTROPHIC_FRAC]),
            _line("KL(rollout || train) estimators k1, k2, k3", [K.KL_K1, K.KL_K2, K.KL_K3]),
            _line("alarms per step", [K.ALARM_COUNT]),
        ),
    )


def _token(thresholds: Sequence[float]) -> Section:
    return Section(
        "Token",
        "Per-token d = logp_train - logp_rollout: quantiles of |d|, signed bias, divergences, the "
        "fraction of tokens past each |d| level and the |d| histogram over steps.",
        (
            _line("|d| quantiles", [K.ABS_DIFF_P50, K.ABS_DIFF_P90, K.ABS_DIFF_P99, K.ABS_DIFF_MAX], log_y=True),
            _line("mean |d|, clipped mean |d| and signed mean d", [K.ABS_DIFF_MEAN, K.ABS_DIFF_CLIPPED_MEAN, K.DIFF_MEAN]),
            _line(f"catastrophic tokens (|d| >= {_STATS.catastrophic_tau:g}): fraction", [K.CATASTROPHIC_TOKEN_FRAC]),
            _line("fraction of tokens with |d| above a level", [K.frac_abs_diff_above(t) for t in thresholds]),
            _line("KL estimators and chi^2", [K.KL_K1, K.KL_K2, K.KL_K3, K.CHI2], log_y=True),
            _line("probability error |p_train - p_rollout| (verl)", [K.PROB_ABS_DIFF_MEAN, K.PROB_ABS_DIFF_MAX]),
            _line("mean(exp|d|) (NeMo-RL)", [K.MULT_PROB_ERROR]),
            _line("tokens: counted, masked out, non-finite", [K.TOKEN_COUNT, K.TOKEN_MASKED_COUNT, K.NONFINITE_COUNT]),
            _line("|d| histogram", [W.HIST_KEY]),
        ),
    )


def _ratio() -> Section:
    return Section(
        "Importance ratio",
        "r = exp(d), raw, before any clipping: spread, effective sample size, tokens past the clip C.",
        (
            _line("ratio mean / min / max", [K.RATIO_MEAN, K.RATIO_MIN, K.RATIO_MAX], log_y=True),
            _line("ratio std", [K.RATIO_STD]),
            _line("effective sample size (sum r)^2 / (n sum r^2)", [K.RATIO_ESS]),
            _line("fraction of tokens with r > C", [K.RATIO_FRAC_ABOVE_C]),
            _line("tokens clipped", [K.RATIO_CLIPPED_COUNT]),
        ),
    )


def _sequence() -> Section:
    return Section(
        "Sequence",
        "Per-sequence reductions: worst token, log ratio, log-perplexity gap, flagged and catastrophic "
        "sequences, and where divergence starts.",
        (
            _line("per-sequence max |d|: mean and max", [K.SEQ_MAX_ABS_DIFF_MEAN, K.SEQ_MAX_ABS_DIFF_MAX], log_y=True),
            _line("sequence log ratio sum d: mean and |max|", [K.SEQ_LOG_RATIO_MEAN, K.SEQ_LOG_RATIO_ABS_MAX]),
            _line("log-ppl difference: mean and |max|", [K.SEQ_LOG_PPL_DIFF_MEAN, K.SEQ_LOG_PPL_DIFF_ABS_MAX]),
            _line("flagged and catastrophic fraction", [K.SEQ_FLAGGED_FRAC, K.SEQ_CATASTROPHIC_FRAC]),
            _line("catastrophic sequences", [K.SEQ_CATASTROPHIC_COUNT]),
            _line("first divergence position: min and median", [K.FIRST_DIV_MIN, K.FIRST_DIV_P50]),
            _line("sequences: total and empty", [K.SEQ_COUNT, K.SEQ_EMPTY_COUNT]),
        ),
    )


def _signatures() -> Section:
    return Section(
        "Signatures",
        "What the signature detectors read: slope of d on the rollout logprob (temperature / logit "
        "processing), shift-by-one gain (misalignment), early divergences (stale state).",
        (
            _line("slope of d on logp_rollout, and its correlation", [K.SIG_SLOPE, K.SIG_SLOPE_CORR]),
            _line("shift-by-one: |d| unshifted, gain, direction", [K.SIG_SHIFT_BASE, K.SIG_SHIFT_GAIN, K.SIG_SHIFT_DIRECTION]),
            _line("catastrophic sequences that diverged early", [K.SIG_EARLY_DIV_COUNT]),
        ),
    )


def _quarantine() -> Section:
    from rlcheck.core.correction import PREFIX as CORR
    from rlcheck.core.quarantine import REASONS

    return Section(
        "Quarantine and correction",
        "Sequences taken out of the step instead of halting (MonitorConfig.quarantine), by reason, and "
        "the importance-sampling correction's clip fractions and ESS (MonitorConfig.correction, verl's names).",
        (
            _line("quarantined: sequences and tokens (fraction)", [K.QUARANTINE_FRAC, K.QUARANTINE_TOKEN_FRAC]),
            _line("quarantined sequences by reason", [K.quarantine_reason(r) for r in REASONS]),
            _line("correction: ESS of the IS weights", [CORR + "rollout_is_eff_sample_size"]),
            _line("correction: weights clipped high / low, tokens rejected",
                  [CORR + "rollout_is_ratio_fraction_high", CORR + "rollout_is_ratio_fraction_low",
                   CORR + "rollout_rs_masked_fraction"]),
        ),
    )


def _moe(num_layers: int) -> Section:
    layers = range(num_layers)
    return Section(
        "MoE routing",
        "Do the engine and the trainer send each token to the same experts? Tokens routed alike at every "
        "MoE layer and at each layer, the share of the mismatch the rerouted tokens carry, and the layer "
        "where a token's routing first differs (`rlcheck localize` names it per request).",
        (
            _line("tokens routed alike at every MoE layer (fraction)", [K.MOE_ROUTE_AGREE_FRAC]),
            _line("tokens routed alike, per MoE layer (fraction)", [K.moe_layer_agree(i) for i in layers]),
            _line("share of sum |d| on tokens routed differently", [K.MOE_ABS_DIFF_SHARE]),
            _line("mean |d| rerouted / mean |d| routed alike", [K.MOE_ABS_DIFF_LIFT], log_y=True),
            _line("tokens whose routing first differs, per MoE layer", [K.moe_first_diff(i) for i in layers]),
            _line("tokens with both sides' routing", [K.MOE_TOKEN_COUNT]),
        ),
    )


def _alarms() -> Section:
    return Section(
        "Alarms",
        "Alarms per step, the run totals (by kind in the run comparer) and the worst step; each alarm "
        "is also a W&B alert.",
        (
            _line("alarms per step", [K.ALARM_COUNT]),
            wr.BarPlot(title="alarms in the run", metrics=[wr.SummaryMetric(SUMMARY_ALARMS_TOTAL)]),
            wr.BarPlot(title="worst step's mean |d|", metrics=[wr.SummaryMetric(SUMMARY_WORST_ABS_DIFF_MEAN)]),
            wr.ScalarChart(title="worst step", metric=wr.SummaryMetric(SUMMARY_WORST_STEP)),
            _line("monitor time per step (s)", [K.MONITOR_SECONDS]),
            wr.RunComparer(diff_only="split", layout=wr.Layout(w=24, h=10)),
        ),
    )


def _offenders() -> Section:
    return Section(
        "Offenders",
        "The latest step's worst sequences by max |d|: request id, index, first divergence, length, "
        "mean d. Take a request id to `rlcheck replay`.",
        (wr.WeavePanelSummaryTable(table_name=W.OFFENDERS_KEY, layout=wr.Layout(w=24, h=12)),),
    )


def sections(thresholds: Sequence[float] = DEFAULT_THRESHOLDS, moe_layers: int = 0) -> list[Section]:
    """The dashboards' sections, with fresh panel objects (panels carry ids: never share them); the MoE
    routing section when `moe_layers` (the model's MoE layers) is not 0."""
    if moe_layers < 0:
        raise ValueError(f"moe_layers must be >= 0 (0: not an MoE), got {moe_layers}")
    moe = [_moe(moe_layers)] if moe_layers else []
    return [_overview(), _token(thresholds), _ratio(), _sequence(), _signatures(), *moe, _quarantine(), _alarms(),
            _offenders()]


def build_workspace(
    entity: str, project: str, name: str = WORKSPACE_NAME, thresholds: Sequence[float] = DEFAULT_THRESHOLDS,
    moe_layers: int = 0,
) -> ws.Workspace:
    """The workspace for `entity/project` (an MoE section with `moe_layers`); no network until `.save()`."""
    return ws.Workspace(
        entity=entity,
        project=project,
        name=name,
        sections=[
            ws.Section(name=s.name, panels=list(s.panels), is_open=i < 2, pinned=i == 0)
            for i, s in enumerate(sections(thresholds, moe_layers))
        ],
        settings=ws.WorkspaceSettings(x_axis="Step", point_visualization_method="bucketing"),
        runset_settings=ws.RunsetSettings(pinned_columns=list(SUMMARY_COLUMNS)),
    )


def build_report(
    entity: str, project: str, title: str = REPORT_TITLE, thresholds: Sequence[float] = DEFAULT_THRESHOLDS,
    moe_layers: int = 0,
) -> wr.Report:
    """The report for `entity/project`: a heading, a sentence and a panel grid per section (an MoE section
    with `moe_layers`); no network until `.save()`."""
    blocks: list[Any] = [wr.TableOfContents()]
    for s in sections(thresholds, moe_layers):
        runset = wr.Runset(entity=entity, project=project, name="rlcheck runs", pinned_columns=list(SUMMARY_COLUMNS))
        blocks += [wr.H2(s.name), wr.P(s.description), wr.PanelGrid(runsets=[runset], panels=list(s.panels))]
    return wr.Report(
        entity=entity,
        project=project,
        title=title,
        description="Rollout (vLLM) vs trainer logprobs, per step: what rlcheck logs to W&B.",
        blocks=blocks,
        width="fluid",
    )


def workspace_spec(workspace: ws.Workspace) -> dict[str, Any]:
    """The view that `workspace.save()` would upload, as JSON-ready data."""
    return workspace._to_model().model_dump(mode="json", by_alias=True, exclude_none=True)


def report_spec(report: wr.Report) -> dict[str, Any]:
    """The report that `report.save()` would upload, as JSON-ready data, built offline.

    wandb-workspaces resolves each run set's entity/project to the project's internal id by a GraphQL
    call while serialising; to stay offline, the run sets of a copy are serialised without them (the
    report's own entity/project stay in the spec, and `.save()` on the original resolves them)."""
    offline = copy.deepcopy(report)
    for block in offline.blocks:
        for runset in getattr(block, "runsets", ()):
            runset.entity, runset.project = "", ""
    return offline._to_model().model_dump(mode="json", by_alias=True, exclude_none=True)


def metric_keys(spec: Any) -> set[str]:
    """Every `rlcheck/` key a spec refers to: any string that is a key, or one behind a `summary:` /
    `summary_metrics.` column prefix, anywhere in the nested data."""
    if isinstance(spec, dict):
        return set().union(*(metric_keys(v) | metric_keys(k) for k, v in spec.items()))
    if isinstance(spec, (list, tuple)):
        return set().union(*(metric_keys(v) for v in spec))
    if isinstance(spec, str):
        for prefix in ("summary:", "summary_metrics."):
            spec = spec.removeprefix(prefix)
        return {spec} if spec.startswith(K.PREFIX) else set()
    return set()
