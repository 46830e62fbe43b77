"""What every recipe takes to run on a Ray cluster of several nodes: the cluster to join and where the
actors go (`rlcheck.loop.Placement`). See recipes/README.md, "On a Ray cluster".

    ray start --head --resources='{"trainer": 2}'                        # node A: the trainer ranks
    ray start --address=NODE_A_IP:6379 --resources='{"rollout": 1}'      # node B: the rollout engine
    python recipes/grpo_tiny.py --ray-address auto \\
        --trainer-resources '{"trainer": 1}' --rollout-resources '{"rollout": 1}'

Without the custom resources Ray places the actors where they fit (the ranks packed on the fewest
nodes). A cluster without what the run asks for is refused before any actor starts
(`ClusterResourcesError`, naming both sides), and a placement group that waits longer than
`--schedule-timeout` for its resources ends the run with one too.
"""

from __future__ import annotations

import argparse
import json

from rlcheck.loop import Placement

STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


def _resources(text: str) -> dict[str, float]:
    """A JSON object of custom resource amounts, e.g. '{"trainer": 1}'."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc.msg}): write it as '{{\"trainer\": 1}}'") from None
    if not isinstance(value, dict) or not all(isinstance(v, (int, float)) for v in value.values()):
        raise argparse.ArgumentTypeError(f"want a JSON object of resource amounts, as '{{\"trainer\": 1}}', got {text!r}")
    return {str(k): float(v) for k, v in value.items()}


def add_cluster_args(ap: argparse.ArgumentParser, address: str) -> None:
    """The cluster arguments, `--ray-address` defaulting to `address`."""
    arg = ap.add_argument
    arg("--ray-address", default=address,
        help='Ray cluster to join: "auto" (the one `ray start` set up on this node), HOST:PORT of its head, '
             'or "local" to start a private one on this machine (default: %(default)s)')
    arg("--trainer-resources", type=_resources, default={}, metavar="JSON",
        help="custom Ray resources of each trainer rank, e.g. '{\"trainer\": 1}': the ranks go only to nodes "
             "started with them (`ray start --resources=...`)")
    arg("--rollout-resources", type=_resources, default={}, metavar="JSON",
        help="custom Ray resources of the rollout actor, e.g. '{\"rollout\": 1}'")
    arg("--placement-strategy", choices=STRATEGIES, default="PACK",
        help="Ray placement strategy of the trainer ranks (default: %(default)s)")
    arg("--schedule-timeout", type=float, default=Placement.schedule_timeout_s, metavar="S",
        help="seconds the ranks' placement group may wait for its resources (default: %(default)s)")


def ray_address(args: argparse.Namespace) -> str | None:
    """The address for `ray_session`: None starts a private local Ray."""
    return None if args.ray_address == "local" else args.ray_address


def placement(args: argparse.Namespace, *, trainer_cpus: float, rollout_cpus: float, trainer_gpus: float = 0,
              rollout_gpus: float = 0) -> Placement:
    """The recipe's resources per actor, with the cluster arguments' custom resources and strategy."""
    return Placement(trainer_cpus=trainer_cpus, trainer_gpus=trainer_gpus, rollout_cpus=rollout_cpus,
                     rollout_gpus=rollout_gpus, trainer_resources=args.trainer_resources,
                     rollout_resources=args.rollout_resources, strategy=args.placement_strategy,
                     schedule_timeout_s=args.schedule_timeout)
