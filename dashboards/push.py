"""Build the rlcheck W&B workspace (and, with --report, the report) and save them to a project.

    python dashboards/push.py --entity my-team --project my-project            # the workspace
    python dashboards/push.py --entity my-team --project my-project --report   # and the report
    python dashboards/push.py --entity E --project P --report --dry-run        # print the specs, offline

Saving needs `pip install 'rlcheck[wandb,dashboards]'` and a W&B login (`wandb login`, or WANDB_API_KEY;
WANDB_BASE_URL for a dedicated server). --dry-run builds and prints the JSON specs without any network.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # rlcheck_dashboards sits beside this script

from rlcheck.core.stats import StatsConfig  # noqa: E402
from rlcheck.errors import ConfigError  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--entity", required=True, help="W&B entity (user or team) that owns the views")
    p.add_argument("--project", required=True, help="W&B project the rlcheck runs log to")
    p.add_argument("--workspace-name", default=None, help="display name of the saved workspace")
    p.add_argument("--report", action="store_true", help="also build and save the report")
    p.add_argument("--report-title", default=None, help="title of the report")
    p.add_argument(
        "--thresholds", default=None,
        help="comma-separated |d| levels of the monitor's StatsConfig.thresholds, if not the defaults",
    )
    p.add_argument("--moe-layers", type=int, default=0,
                   help="MoE layers of the model (its rlcheck/moe/* routing metrics): adds the MoE routing section")
    p.add_argument("--dry-run", action="store_true", help="print the specs as JSON; no network")
    return p.parse_args(argv)


def _thresholds(text: str | None) -> tuple[float, ...]:
    if text is None:
        return StatsConfig().thresholds
    try:
        return StatsConfig(thresholds=tuple(float(t) for t in text.split(","))).thresholds
    except ValueError as e:
        raise ConfigError(f"--thresholds {text!r}: {e}; give positive numbers, e.g. 0.1,0.5,1") from None


def build(args: argparse.Namespace) -> dict[str, Any]:
    """The views the arguments ask for, by name ("workspace", and "report" with --report)."""
    try:
        import rlcheck_dashboards as D
    except ImportError as e:
        raise ConfigError(f"the dashboards need wandb-workspaces ({e}): pip install 'rlcheck[wandb,dashboards]'") from e
    thresholds = _thresholds(args.thresholds)
    if args.moe_layers < 0:
        raise ConfigError(f"--moe-layers {args.moe_layers}: give the model's number of MoE layers (0: not an MoE)")
    views: dict[str, Any] = {
        "workspace": D.build_workspace(
            args.entity, args.project, name=args.workspace_name or D.WORKSPACE_NAME, thresholds=thresholds,
            moe_layers=args.moe_layers,
        )
    }
    if args.report:
        views["report"] = D.build_report(
            args.entity, args.project, title=args.report_title or D.REPORT_TITLE, thresholds=thresholds,
            moe_layers=args.moe_layers,
        )
    return views


def specs(views: dict[str, Any]) -> dict[str, Any]:
    """The JSON-ready spec of each view, built offline."""
    import rlcheck_dashboards as D

    out = {"workspace": D.workspace_spec(views["workspace"])}
    if "report" in views:
        out["report"] = D.report_spec(views["report"])
    return out


def save(views: dict[str, Any]) -> None:
    """Saves each view to W&B and prints where it went."""
    for kind, view in views.items():
        try:
            view.save()
        except Exception as e:  # no login, no such entity, no network: say which and how to fix it
            raise ConfigError(
                f"saving the {kind} failed ({type(e).__name__}: {e}); log in with `wandb login` (or set "
                "WANDB_API_KEY, and WANDB_BASE_URL for a dedicated server) and check --entity/--project"
            ) from e
        print(f"{kind}: {view.url}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        views = build(args)
        if args.dry_run:
            print(json.dumps(specs(views), indent=2))
        else:
            save(views)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
