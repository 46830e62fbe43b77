"""The loop on a Ray cluster of three nodes (`ray.cluster_utils.Cluster`, all on this machine) of one
CPU each: two "trainer" nodes (the head is one) and a "rollout" node, told apart by custom resources,
with the ranks' placement group STRICT_SPREAD, so the two FSDP2 ranks (gloo) and the vLLM engine each
run on a node of their own. The ranks rendezvous on rank 0's node, the sync check passes on the
engine's load and after the first sync, a drop-sync fault from the second sync halts the run with
its dump, and every actor and placement group is gone afterwards. The same cluster refuses, within
seconds, a loop that asks for a GPU and a placement group that fits in total but on no node.

The suite holds one Ray session for all its tests (`ray_local` in conftest.py), and a process can be
connected to one Ray at a time: so the cluster lives in a child process (this file, run as a script),
which writes what it saw to a JSON file the tests read. Its Ray directory is private (RAY_TMPDIR): a
`Cluster` records its address in the default one, where any `ray.init()` on the machine would find
and join it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest

CHILD_TIMEOUT_S = 420  # ~87 s on 2 cores at load ~3; 214 s seen at load ~15
PG_TIMEOUT_S = 3.0


def _child(model: str, run_dir: str, out: str) -> None:
    """Start the cluster (its nodes boot while rlcheck imports), run what the tests check on it, write
    the facts to `out`, stop the cluster."""
    from ray.cluster_utils import Cluster

    began = time.monotonic()
    # the head's agent port is fixed by default (52365): another Ray on the machine may hold it
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"trainer": 1},
                                                            "include_dashboard": False,
                                                            "dashboard_agent_listen_port": None})
    try:
        nodes = {"trainer_a": cluster.head_node,
                 "trainer_b": cluster.add_node(wait=False, num_cpus=1, resources={"trainer": 1}),
                 "rollout": cluster.add_node(wait=False, num_cpus=1, resources={"rollout": 1})}
        facts = _on_cluster(cluster, model, run_dir, began)
        facts["nodes"] = {name: node.node_id for name, node in nodes.items()}
    finally:
        t0 = time.monotonic()
        cluster.shutdown()
    facts["shutdown_seconds"] = time.monotonic() - t0
    with open(out, "w") as f:
        json.dump(facts, f, default=str)


def _on_cluster(cluster, model: str, run_dir: str, began: float) -> dict:
    """The refusals, then the loop with its fault, and what was left of its actors afterwards."""
    from dataclasses import replace

    import ray
    from ray.exceptions import RayActorError
    from ray.util.placement_group import placement_group_table

    from rlcheck.core.monitor import Monitor, MonitorConfig
    from rlcheck.errors import ClusterResourcesError
    from rlcheck.faults import DropSync
    from rlcheck.loop import GRPOLoop, Placement, ray_session, run_grpo
    from rlcheck.loop.group import TrainerGroup
    from rlcheck.loop.presets import tiny_cpu

    def node_of(actor) -> str:
        return ray.get(actor.__ray_call__.remote(lambda _: ray.get_runtime_context().get_node_id()), timeout=60)

    def dead(actor) -> bool:
        try:
            ray.get(actor.__ray_ready__.remote(), timeout=30)
        except RayActorError:
            return True
        return False

    def refused(make) -> dict:
        t0 = time.monotonic()
        try:
            make()
        except ClusterResourcesError as exc:
            return {"error": str(exc), "seconds": time.monotonic() - t0}
        return {"error": None, "seconds": time.monotonic() - t0}

    pinned = Placement(trainer_cpus=1, rollout_cpus=1, trainer_resources={"trainer": 1},
                       rollout_resources={"rollout": 1}, strategy="STRICT_SPREAD")
    cfg = replace(tiny_cpu(model, trainer="fsdp2", world_size=2, steps=3, fault=DropSync("shared_mlp", start=1)),
                  placement=pinned)
    cluster.wait_for_nodes()
    facts: dict = {"cluster_seconds": time.monotonic() - began}
    with ray_session(address=cluster.address):
        with Monitor(MonitorConfig(run_dir=os.path.join(run_dir, "gpu"), sinks=("jsonl",))) as mon:
            facts["gpu_ask"] = refused(lambda: run_grpo(replace(cfg, placement=replace(pinned, trainer_gpus=1)), mon))
        # 2 x 1.5 CPUs: 3 in the cluster, but 1 per node
        split = Placement(trainer_cpus=1.5, schedule_timeout_s=PG_TIMEOUT_S)
        facts["pg_ask"] = refused(lambda: TrainerGroup(cfg.trainer, 2, split))
        facts["pg_states_after_refusal"] = [pg["state"] for pg in placement_group_table().values()]

        with Monitor(MonitorConfig(run_dir=run_dir, sinks=("jsonl",), context=cfg.context())) as mon:
            t0 = time.monotonic()
            loop = GRPOLoop(cfg, mon)
            try:
                facts["start_seconds"] = time.monotonic() - t0
                facts["rank_nodes"] = [node_of(w) for w in loop.group.workers]
                facts["rollout_node"] = node_of(loop.rollout)
                facts["describe"] = loop.group.describe
                pg = placement_group_table(loop.group.pg)
                facts["bundle_nodes"] = list(pg["bundles_to_node_id"].values())
                result = loop.run()
            finally:
                t1 = time.monotonic()
                loop.close()
                facts["close_seconds"] = time.monotonic() - t1
            facts["run_seconds"] = t1 - t0
        facts["result"] = {"halted": result.halted, "reason": result.reason, "steps_run": result.steps_run,
                           "dump_dir": result.dump_dir,
                           "alarms": [a.to_dict() for r in result.reports for a in r.alarms]}
        facts["dead"] = [dead(a) for a in [loop.rollout, *loop.group.workers]]
        facts["pg_states"] = [pg["state"] for pg in placement_group_table().values()]
    return facts


@pytest.fixture(scope="module")
def cluster_run(tiny_model, tmp_path_factory):
    """The facts the child saw (its output on failure), and the run directory of its loop."""
    run_dir = tmp_path_factory.mktemp("multinode")
    out = run_dir / "facts.json"
    ray_tmp = tempfile.mkdtemp(prefix="rlmn", dir="/tmp")  # short: Ray's socket paths live under it
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_TMPDIR=ray_tmp, RAY_AUTH_MODE="disabled", WANDB_MODE="offline", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    log = run_dir / "child.log"
    t0 = time.monotonic()
    try:
        with open(log, "w") as f:
            child = subprocess.Popen([sys.executable, __file__, str(tiny_model("hybrid")), str(run_dir / "loop"), str(out)],
                                     env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                code = child.wait(timeout=CHILD_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.killpg(child.pid, signal.SIGKILL)  # the child and the Ray nodes it started
                child.wait()
                raise
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    seconds = time.monotonic() - t0
    assert code == 0 and out.exists(), f"the cluster child failed ({log}):\n" + log.read_text()[-8000:]
    facts = json.loads(out.read_text())
    facts["child_seconds"] = seconds
    print(f"multinode child: {seconds:.1f} s, cluster up {facts['cluster_seconds']:.1f} s, loop start {facts['start_seconds']:.1f} s, run {facts['run_seconds']:.1f} s, "
          f"close {facts['close_seconds']:.1f} s, GPU refusal {facts['gpu_ask']['seconds']:.2f} s, "
          f"PG refusal {facts['pg_ask']['seconds']:.2f} s, cluster shutdown {facts['shutdown_seconds']:.1f} s")
    return facts, run_dir / "loop"


@pytest.mark.slow
@pytest.mark.timeout(CHILD_TIMEOUT_S + 60)
class TestLoopAcrossNodes:
    def test_ranks_and_engine_on_their_nodes(self, cluster_run):
        """One rank on each trainer node (where the placement group's bundles are), the engine on the rollout node."""
        facts, _ = cluster_run
        nodes = facts["nodes"]
        assert len(set(nodes.values())) == 3
        assert sorted(facts["rank_nodes"]) == sorted([nodes["trainer_a"], nodes["trainer_b"]])
        assert facts["rank_nodes"] == facts["bundle_nodes"]
        assert facts["rollout_node"] == nodes["rollout"]

    def test_ranks_rendezvous_and_the_engine_holds_their_weights(self, cluster_run):
        """The ranks joined one process group across their nodes; the sync check passed on the engine's load (step 0) and
        after the first sync (step 1), with the engine on the trainer's version every step."""
        facts, run_dir = cluster_run
        assert [d.split(" on ")[0] for d in facts["describe"]] == ["rank 0/2", "rank 1/2"]
        assert all(d.endswith("(fsdp2)") for d in facts["describe"])
        metrics = [json.loads(line)["metrics"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert [m["sync/fingerprint_differs"] for m in metrics[:2]] == [0, 0]
        assert all(m["loop/weights_behind"] == 0 for m in metrics)

    def test_fault_halts_cleanly_with_its_evidence(self, cluster_run):
        """The sync that left out the MLPs (step 1) is a critical weights alarm at step 2 naming every
        layer, and the halt there: the dump is on disk, every actor dead, every placement group removed."""
        facts, run_dir = cluster_run
        result = facts["result"]
        assert result["halted"] and result["steps_run"] == 3 and "weight sync to version 2 did not take" in result["reason"]
        (alarm,) = [a for a in result["alarms"] if a["kind"] == "weights"]
        assert alarm["step"] == 2 and alarm["severity"] == "critical" and alarm["details"]["layers"] == [0, 1, 2, 3]
        assert os.path.isdir(result["dump_dir"]) and os.listdir(result["dump_dir"])
        assert len(json.loads((run_dir / "loop.jsonl").read_text().splitlines()[-1])["fault_touched"]) > 0
        assert facts["dead"] == [True, True, True]
        assert facts["pg_states"] and set(facts["pg_states"]) == {"REMOVED"}

    def test_a_gpu_ask_is_refused(self, cluster_run):
        """2 ranks x 1 GPU on a cluster without GPUs: a ClusterResourcesError naming both sides, before any actor."""
        error = cluster_run[0]["gpu_ask"]["error"]
        assert error is not None and "GPU: 2 asked, 0 in the cluster" in error
        assert "2 trainer rank(s) x (1 CPU, 1 GPU, 1 trainer)" in error

    def test_an_unplaceable_group_times_out(self, cluster_run):
        """Enough CPUs in total, not on any node: the placement group's wait ends after
        schedule_timeout_s with a ClusterResourcesError, and the group is removed."""
        facts, _ = cluster_run
        error = facts["pg_ask"]["error"]
        assert error is not None and f"not placed within {PG_TIMEOUT_S:g} s" in error
        assert facts["pg_states_after_refusal"] == ["REMOVED"]


if __name__ == "__main__":
    _child(*sys.argv[1:4])
