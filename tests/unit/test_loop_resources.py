"""What the loop asks of a Ray cluster (`rlcheck.loop.resources`): the sum of its actors' resources, the
refusal of a cluster too small in total or per node, and the GPU an actor got from Ray."""

from __future__ import annotations

import pytest

from rlcheck.errors import ClusterResourcesError, ConfigError
from rlcheck.loop import Placement
from rlcheck.loop.resources import check_cluster, device_index, needs, shortfall, unplaceable, visible_devices

GPU_RUN = Placement(trainer_gpus=1, rollout_gpus=2, trainer_resources={"trainer": 1}, rollout_resources={"rollout": 1})
"""Two GPUs of tensor parallel for the engine, one per rank; ranks and engine pinned by custom resources."""


def _node(cpus: float, gpus: float = 0, **custom: float) -> dict[str, float]:
    return {"CPU": cpus, "GPU": gpus, "memory": 1e9, **custom}


class TestNeeds:
    def test_ranks_times_bundle_plus_rollout(self):
        """world_size x (CPU, GPU, custom) of a rank, plus the rollout actor's, per resource."""
        assert needs(GPU_RUN, 4) == {"CPU": 5.0, "GPU": 6.0, "trainer": 4.0, "rollout": 1.0}

    def test_zero_resources_are_not_asked(self):
        """A CPU run asks no GPU (a zero entry would be a resource Ray has to match)."""
        assert needs(Placement(), 2) == {"CPU": 3.0}
        assert Placement().trainer_bundle() == {"CPU": 1.0}

    def test_shortfall_names_each_missing_resource(self):
        """Only what the cluster holds less of, with both amounts."""
        assert shortfall({"CPU": 3, "GPU": 4, "x": 1}, {"CPU": 8, "GPU": 3}) == [
            "GPU: 4 asked, 3 in the cluster", "x: 1 asked, 0 in the cluster"]


class TestCheckCluster:
    def test_fits(self):
        """Two 4-GPU nodes hold 2 ranks and a tp-2 engine: no error."""
        nodes = [_node(8, 4, trainer=2), _node(8, 4, rollout=1)]
        check_cluster(GPU_RUN, 2, total={"CPU": 16, "GPU": 8, "trainer": 2, "rollout": 1}, nodes=nodes)

    def test_too_few_gpus_in_total(self):
        """3 GPUs for 2 ranks x 1 + tp 2: the error names what is asked and what the cluster has."""
        nodes = [_node(8, 3, trainer=2, rollout=1)]
        with pytest.raises(ClusterResourcesError, match="GPU: 4 asked, 3 in the cluster") as err:
            check_cluster(GPU_RUN, 2, total=nodes[0], nodes=nodes)
        assert "2 trainer rank(s) x (1 CPU, 1 GPU, 1 trainer) + the rollout actor (1 CPU, 2 GPU, 1 rollout)" in str(err.value)
        assert "the cluster has 8 CPU, 3 GPU, 2 trainer, 1 rollout" in str(err.value)

    def test_missing_custom_resource(self):
        """A custom resource no node was started with is short like any other (and a ConfigError)."""
        with pytest.raises(ConfigError, match="rollout: 1 asked, 0 in the cluster"):
            check_cluster(GPU_RUN, 1, total={"CPU": 9, "GPU": 9, "trainer": 1}, nodes=[_node(9, 9, trainer=1)])

    def test_enough_in_total_but_on_no_node(self):
        """The engine's 2 GPUs exist in total, one per node: refused, with each node's resources."""
        p = Placement(rollout_gpus=2)
        nodes = [_node(4, 1), _node(4, 1)]
        with pytest.raises(ClusterResourcesError, match=r"no node fits the rollout actor \(1 CPU, 2 GPU\)") as err:
            check_cluster(p, 2, total={"CPU": 8, "GPU": 2}, nodes=nodes)
        assert "node 0: 4 CPU, 1 GPU; node 1: 4 CPU, 1 GPU" in str(err.value)

    @pytest.mark.parametrize(("strategy", "ok"), [("PACK", True), ("SPREAD", True), ("STRICT_PACK", False),
                                                  ("STRICT_SPREAD", False)])
    def test_strict_strategies(self, strategy, ok):
        """3 ranks of 1 GPU on a 2-GPU and a 1-GPU node (and a GPU-less one for the engine): any split
        fits, not all on one node, nor each on its own GPU node."""
        nodes = [_node(4, 2), _node(4, 1), _node(4)]
        p = Placement(trainer_gpus=1, strategy=strategy)
        assert (unplaceable(p, 3, nodes) == []) is ok


class TestPlacement:
    @pytest.mark.parametrize("kwargs", [{"trainer_resources": {"GPU": 1}}, {"rollout_resources": {"x": -1}},
                                        {"schedule_timeout_s": 0}, {"strategy": "ANY"}])
    def test_bad_settings_are_refused(self, kwargs):
        """Ray's own resources as custom ones, negative amounts, a zero timeout, an unknown strategy."""
        with pytest.raises(ConfigError):
            Placement(**kwargs)


class TestDeviceIndex:
    @pytest.mark.parametrize(("ids", "visible", "index"), [
        ([], None, 0),  # not a GPU actor
        ([3], "3", 0),  # Ray set CUDA_VISIBLE_DEVICES to the assigned GPU
        ([5, 4], "4,5", 0),  # two GPUs, in any order: the first visible
        ([2], None, 2),  # NOSET, nothing set on the node: the id is the index
        (["6"], "4,5,6", 2),  # NOSET, the node started with CUDA_VISIBLE_DEVICES=4,5,6
        (["GPU-b"], "GPU-a, GPU-b", 1),  # UUIDs
    ])
    def test_index(self, ids, visible, index):
        """The torch index of the assigned GPU, with and without Ray setting CUDA_VISIBLE_DEVICES."""
        assert device_index(ids, visible) == index

    @pytest.mark.parametrize(("ids", "visible"), [([7], "0,1"), (["GPU-a"], None)])
    def test_unmappable(self, ids, visible):
        """An id absent from CUDA_VISIBLE_DEVICES, or a UUID with none set: a clear error, not a wrong GPU."""
        with pytest.raises(ConfigError, match="CUDA_VISIBLE_DEVICES"):
            device_index(ids, visible)


class TestVisibleDevices:
    NOSET = {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}

    def test_left_alone_when_ray_sets_it(self):
        """Without NOSET (Ray set it) or without GPUs there is nothing to set."""
        assert visible_devices([1], {"CUDA_VISIBLE_DEVICES": "1"}) is None
        assert visible_devices([], self.NOSET) is None

    def test_noset_gives_the_assigned_ids(self):
        """Under NOSET the engine sees exactly Ray's GPUs, in the node's order (or by number)."""
        assert visible_devices([10, 2], self.NOSET) == "2,10"
        assert visible_devices(["5", "3"], {**self.NOSET, "CUDA_VISIBLE_DEVICES": "5,4,3"}) == "5,3"
