"""What the loop's actors need of the Ray cluster, checked before the first one starts, and which GPU
an actor got from Ray.

Asked for more than the cluster has, Ray does not fail: an infeasible placement group or actor stays
pending, with a warning in the logs, and `ray.get` on it waits forever. So before the engine starts,
`check_cluster` compares what the placement asks (`world_size` trainer bundles and the rollout actor)
with `ray.cluster_resources()` and with every node's resources (a bundle, the rollout actor, a
STRICT_PACK group must fit on one node), and raises `ClusterResourcesError` naming both sides.
`wait_placed` bounds the wait for the ranks' placement group by `Placement.schedule_timeout_s`, for
what only the scheduler knows (resources held by other jobs, a PACK group split badly across nodes).

Devices: Ray sets CUDA_VISIBLE_DEVICES of a GPU actor to the GPUs it assigned, so the actor's device
is cuda:0; under RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1 it does not, every GPU of the node is
visible and the assigned id is the index (`device_index`, `visible_devices`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from rlcheck.errors import ClusterResourcesError, ConfigError
from rlcheck.loop.placement import Placement

NOSET_VISIBLE_DEVICES = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"


def _add(requests: Sequence[Mapping[str, float]]) -> dict[str, float]:
    total: dict[str, float] = {}
    for request in requests:
        for key, amount in request.items():
            total[key] = total.get(key, 0.0) + amount
    return total


def _fits(request: Mapping[str, float], have: Mapping[str, float]) -> bool:
    return all(have.get(key, 0.0) >= amount for key, amount in request.items())


def _show(resources: Mapping[str, float]) -> str:
    return ", ".join(f"{amount:g} {key}" for key, amount in resources.items()) or "nothing"


def needs(placement: Placement, world_size: int) -> dict[str, float]:
    """What the loop holds at once: `world_size` trainer bundles plus the rollout actor, per resource."""
    return _add([placement.trainer_bundle()] * world_size + [placement.rollout_request()])


def shortfall(need: Mapping[str, float], have: Mapping[str, float]) -> list[str]:
    """One line per resource of `need` that `have` holds less of, e.g. "GPU: 3 asked, 2 in the cluster"."""
    return [f"{key}: {amount:g} asked, {have.get(key, 0.0):g} in the cluster"
            for key, amount in need.items() if have.get(key, 0.0) < amount]


def unplaceable(placement: Placement, world_size: int, nodes: Sequence[Mapping[str, float]]) -> list[str]:
    """The actors that fit on none of `nodes` (each node's resources), one line each; the cluster's
    total may still be enough. STRICT_PACK puts every rank on one node, STRICT_SPREAD each on its own."""
    bundle, rollout = placement.trainer_bundle(), placement.rollout_request()
    out = []
    fitting = sum(_fits(bundle, node) for node in nodes)
    if placement.strategy == "STRICT_PACK" and not any(_fits(_add([bundle] * world_size), node) for node in nodes):
        out.append(f"the {world_size} trainer ranks together ({_show(_add([bundle] * world_size))}, STRICT_PACK)")
    elif placement.strategy == "STRICT_SPREAD" and fitting < world_size:
        out.append(f"{world_size} trainer ranks of {_show(bundle)} each on its own node (STRICT_SPREAD): "
                   f"{fitting} node(s) fit one")
    elif not fitting:
        out.append(f"a trainer rank ({_show(bundle)})")
    if not any(_fits(rollout, node) for node in nodes):
        out.append(f"the rollout actor ({_show(rollout)})")
    return out


def check_cluster(placement: Placement, world_size: int, total: Mapping[str, float] | None = None,
                  nodes: Sequence[Mapping[str, float]] | None = None) -> None:
    """`ClusterResourcesError` when the cluster (`total`: `ray.cluster_resources()`; `nodes`: each
    live node's resources; both read from Ray when None) cannot hold the loop's actors."""
    import ray

    total = ray.cluster_resources() if total is None else total
    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")] if nodes is None else nodes
    need = needs(placement, world_size)
    asked = (f"{world_size} trainer rank(s) x ({_show(placement.trainer_bundle())}) + the rollout actor "
             f"({_show(placement.rollout_request())}) = {_show(need)}")
    has = _show({key: total.get(key, 0.0) for key in need})
    missing = shortfall(need, total)
    if missing:
        raise ClusterResourcesError(
            f"the Ray cluster is too small for the loop: {'; '.join(missing)}. Asked: {asked}; the cluster has "
            f"{has}. Add nodes (`ray start --address=HEAD_IP:6379` on each, with --num-gpus / --resources "
            "as needed) or ask for less (LoopConfig.world_size, Placement's trainer_*/rollout_* fields)")
    lonely = unplaceable(placement, world_size, nodes)
    if lonely:
        per_node = "; ".join(f"node {i}: {_show({k: n.get(k, 0.0) for k in need})}" for i, n in enumerate(nodes))
        raise ClusterResourcesError(
            f"the Ray cluster has enough in total ({has}) but no node fits {' nor '.join(lonely)}. "
            f"Per node: {per_node}. Use nodes with more resources each, or ask less per actor")


def wait_placed(pg, placement: Placement, world_size: int) -> None:
    """Wait for the trainer ranks' placement group `pg`; past `placement.schedule_timeout_s` remove
    it and raise `ClusterResourcesError` (Ray would keep it pending forever)."""
    import ray
    from ray.exceptions import GetTimeoutError
    from ray.util.placement_group import remove_placement_group

    try:
        ray.get(pg.ready(), timeout=placement.schedule_timeout_s)
    except GetTimeoutError:
        remove_placement_group(pg)
        free = _show({k: v for k, v in ray.available_resources().items() if k in placement.trainer_bundle()})
        raise ClusterResourcesError(
            f"the trainer ranks' placement group ({world_size} x ({_show(placement.trainer_bundle())}), "
            f"{placement.strategy}) was not placed within {placement.schedule_timeout_s:g} s "
            f"(Placement.schedule_timeout_s); free in the cluster now: {free}. Its resources are held by "
            "other jobs, or no node (STRICT_PACK: no single node) has them") from None


def device_index(gpu_ids: Sequence[int | str], visible: str | None) -> int:
    """The torch CUDA index of the GPU Ray assigned (`ray.get_gpu_ids()`, in any order; the first
    visible one if several), given the process's CUDA_VISIBLE_DEVICES `visible`. Ray sets it to the
    assigned ids, so that is 0; under RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES it is the id's place
    in the node's list, or the id itself with none set. No ids (not a Ray GPU actor): 0."""
    if not gpu_ids:
        return 0
    ids = [str(i) for i in gpu_ids]
    if visible is None:
        if not all(i.isdigit() for i in ids):
            raise ConfigError(f"Ray assigned GPUs {ids} but CUDA_VISIBLE_DEVICES is unset: cannot map them to "
                              "CUDA indices (set CUDA_VISIBLE_DEVICES before `ray start`)")
        return min(int(i) for i in ids)
    listed = [v.strip() for v in visible.split(",")]
    places = [listed.index(i) for i in ids if i in listed]
    if not places:
        raise ConfigError(f"Ray assigned GPUs {ids}, none of them in CUDA_VISIBLE_DEVICES={visible!r}: "
                          "the node's CUDA_VISIBLE_DEVICES changed after `ray start`")
    return min(places)


def visible_devices(gpu_ids: Sequence[int | str], environ: Mapping[str, str]) -> str | None:
    """The CUDA_VISIBLE_DEVICES a GPU actor that lets a library pick its device (vLLM takes the first
    `tensor_parallel_size` visible GPUs) must set before the library starts: the assigned ids when Ray
    was told not to set it (RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1) and assigned some; else None
    (leave it: Ray set it, or there is no GPU)."""
    if not gpu_ids or environ.get(NOSET_VISIBLE_DEVICES, "").lower() not in ("1", "true"):
        return None
    listed = [v.strip() for v in environ.get("CUDA_VISIBLE_DEVICES", "").split(",")]

    def place(i: str) -> tuple[int, str]:  # the node's order, else the id's number
        return (listed.index(i) if i in listed else int(i) if i.isdigit() else len(listed)), i

    return ",".join(sorted((str(i) for i in gpu_ids), key=place))
