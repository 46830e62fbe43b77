"""The test support that runs verl's fully async trainer here (tests/verl_cpu): the file checkpoint engine
that carries the trainer's weights to its rollouter without a GPU, and the skip-sync fault around verl's
`auto_await` weight sync (awaited by the fully async trainer, called plainly by the others)."""

from __future__ import annotations

import asyncio
import json
import types

import pytest

pytest.importorskip("verl.checkpoint_engine.base")
pytest.importorskip("verl.utils.ray_utils")

import torch  # noqa: E402

from tests.verl_cpu import checkpoint_engine, faults  # noqa: E402


async def _received(engine, step: int) -> dict[str, torch.Tensor]:
    return {name: tensor async for name, tensor in engine.receive_weights(global_steps=step)}


class TestFileCheckpointEngine:
    def test_rank_0_sends_every_rollout_worker_receives(self, tmp_path, monkeypatch):
        monkeypatch.setenv("RLCHECK_VERL_CKPT_DIR", str(tmp_path))
        actor, rollout = checkpoint_engine.FileCheckpointEngine.build_topology(2, 1, [])
        assert actor == {"rank": [0, 1], "is_sender": [True, True]} and rollout == {"rank": [0], "is_sender": [False]}
        weights = [("a.weight", torch.arange(6.0).reshape(2, 3)), ("b.bias", torch.ones(3))]
        senders = [checkpoint_engine.FileCheckpointEngine() for _ in range(2)]
        for rank, engine in enumerate(senders):
            engine.init_process_group(rank, True)
        asyncio.run(senders[1].send_weights(iter(weights), global_steps=3))
        assert list(tmp_path.iterdir()) == []  # only rank 0 writes
        asyncio.run(senders[0].send_weights(iter(weights), global_steps=3))
        assert sorted(p.name for p in tmp_path.iterdir()) == ["v3.pt"]  # no half-written file left
        receiver = checkpoint_engine.FileCheckpointEngine()
        receiver.init_process_group(0, False)
        got = asyncio.run(_received(receiver, 3))
        assert list(got) == ["a.weight", "b.bias"]
        assert all(torch.equal(got[name], tensor) for name, tensor in weights)

    def test_receiver_waits_for_its_version(self, tmp_path, monkeypatch):
        monkeypatch.setenv("RLCHECK_VERL_CKPT_DIR", str(tmp_path))
        sender, receiver = checkpoint_engine.FileCheckpointEngine(), checkpoint_engine.FileCheckpointEngine()
        sender.init_process_group(0, True)
        receiver.init_process_group(0, False)
        asyncio.run(sender.send_weights(iter([("w", torch.zeros(1))]), global_steps=1))

        async def both():
            waiting = asyncio.create_task(_received(receiver, 2))
            await asyncio.sleep(3 * checkpoint_engine.POLL_SECONDS)
            assert not waiting.done()  # version 1 on disk is not version 2
            await sender.send_weights(iter([("w", torch.full((1,), 2.0))]), global_steps=2)
            return await asyncio.wait_for(waiting, 5)

        assert asyncio.run(both())["w"].item() == 2.0


class TestSkipSync:
    @staticmethod
    def manager_module():
        from verl.utils.ray_utils import auto_await

        class CheckpointEngineManager:
            def __init__(self):
                self.synced = []

            @auto_await
            async def update_weights(self, global_steps=None):
                self.synced.append(global_steps)
                return {"synced": global_steps}

        return types.SimpleNamespace(CheckpointEngineManager=CheckpointEngineManager)

    def test_skipped_at_its_step_called_plainly_or_awaited(self, tmp_path, monkeypatch):
        monkeypatch.setenv("RLCHECK_VERL_FAULTS", "skip-sync@3")
        monkeypatch.setenv("RLCHECK_VERL_RECORD", str(tmp_path))
        module = self.manager_module()
        faults._skip_sync(module)
        manager = module.CheckpointEngineManager()
        assert manager.update_weights(global_steps=2) == {"synced": 2}  # the legacy and v1 trainers' call
        assert manager.update_weights(global_steps=3) == {}

        async def fully_async():  # the fully async trainer awaits it
            return await manager.update_weights(global_steps=4), await manager.update_weights(global_steps=3)

        assert asyncio.run(fully_async()) == ({"synced": 4}, {})
        assert manager.synced == [2, 4]
        rows = [json.loads(line) for line in (tmp_path / "faults.jsonl").read_text().splitlines()]
        assert [(r["fault"], r["step"]) for r in rows] == [("skip-sync", 3), ("skip-sync", 3)]
