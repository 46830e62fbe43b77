"""rlcheck's verl plugin without verl's trainer: its settings and refusals (verl's config as OmegaConf or
plain mappings), the import hook it waits with, the wrapping of a trainer class, the run directory
it picks, the v1 rows' ids and versions. verl's real trainer: tests/integration/test_verl_trainer.py."""

from __future__ import annotations

import inspect
import json
import pickle
import sys
import types
import warnings

import numpy as np
import pytest

from rlcheck.core.correction import CorrectionConfig
from rlcheck.errors import ConfigError, MismatchHalt
from rlcheck.integrations.verl import imports, plugin, settings, tq_batch
from rlcheck.integrations.verl.session import Session


def verl_config(**sections):
    """verl's config as far as the plugin reads it: rollout, correction, trainer, and an `rlcheck` section."""
    config = {"actor_rollout_ref": {"rollout": {"calculate_log_probs": True}},
              "algorithm": {"rollout_correction": {"bypass_mode": False, "rollout_is": None}},
              "trainer": {"use_v1": True, "v1": {"trainer_mode": "sync"}, "default_local_dir": "checkpoints/p/e"}}
    for dotted, value in sections.items():
        node = config
        *parents, leaf = dotted.split("__")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return config


class TestSettings:
    def test_absent_section_stays_out(self):
        """No `rlcheck` section and the plugin not named in VERL_USE_EXTERNAL_MODULES: rlcheck stays out."""
        assert settings.settings_of(verl_config(), loaded_by_name=False) is None

    def test_named_plugin_uses_defaults(self):
        """Named in VERL_USE_EXTERNAL_MODULES: on, the run directory beside verl's checkpoints."""
        found = settings.settings_of(verl_config(), loaded_by_name=True)
        assert found.run_dir == "checkpoints/p/e/rlcheck" and not found.quarantine and found.correction is None

    def test_section_sets_everything(self):
        found = settings.settings_of(verl_config(rlcheck={"quarantine": True, "rollout_is": "token",
                                                          "rollout_is_threshold": 3.0, "halt": False,
                                                          "run_dir": "x", "sinks": ["console"]}),
                                     loaded_by_name=False)
        assert found.quarantine and not found.halt and found.run_dir == "x" and found.sinks == ("console",)
        assert found.correction == CorrectionConfig(rollout_is="token", rollout_is_threshold=3.0)

    def test_enable_false_turns_it_off(self):
        assert settings.settings_of(verl_config(rlcheck={"enable": False}), loaded_by_name=True) is None

    def test_omegaconf_section(self):
        """verl's config is an OmegaConf DictConfig; `+rlcheck.*` lines make a section of it."""
        omegaconf = pytest.importorskip("omegaconf")
        config = omegaconf.OmegaConf.create(verl_config())
        config.rlcheck = {"quarantine": True}
        assert settings.settings_of(config, loaded_by_name=False).quarantine

    @pytest.mark.parametrize("section, match", [({"quarantin": True}, "unknown key"), ("on", "must be a section"),
                                                ({"max_weight_lag": -1}, "max_weight_lag"),
                                                ({"rollout_is": "tokens"}, "rollout_is")])
    def test_bad_section(self, section, match):
        with pytest.raises(ConfigError, match=match):
            settings.settings_of(verl_config(rlcheck=section), loaded_by_name=False)


class TestRefusals:
    def test_verls_defaults_pass(self):
        found = settings.settings_of(verl_config(), loaded_by_name=True)
        assert settings.refusals(verl_config(), found) == []

    def test_every_refusal_at_once(self):
        """Bypass mode, no engine logprobs, two IS weights, an off-policy v1 mode: one ConfigError naming all."""
        config = verl_config(actor_rollout_ref__rollout__calculate_log_probs=False,
                             algorithm__rollout_correction__bypass_mode=True,
                             algorithm__rollout_correction__rollout_is="token",
                             trainer__v1__trainer_mode="separate_async", rlcheck={"rollout_is": "sequence"})
        with pytest.raises(ConfigError) as err:
            settings.check(config, settings.settings_of(config, loaded_by_name=False))
        for setting in ("calculate_log_probs=false", "bypass_mode=true", "rlcheck.rollout_is with verl's own",
                        "trainer_mode=separate_async"):
            assert setting in str(err.value)

    def test_legacy_trainer_ignores_v1_modes(self):
        config = verl_config(trainer__use_v1=False, trainer__v1__trainer_mode="colocate_async")
        assert settings.refusals(config, settings.settings_of(config, loaded_by_name=True)) == []


class TestAfterImport:
    def test_runs_once_the_module_is_imported(self, tmp_path, monkeypatch):
        """The callback gets the module right after it executes, once; an imported module at once."""
        (tmp_path / "rlcheck_probe_mod.py").write_text("VALUE = 1\n")
        monkeypatch.syspath_prepend(str(tmp_path))
        seen = []
        imports.after_import("rlcheck_probe_mod", lambda m: seen.append(m.VALUE))
        assert seen == []
        import rlcheck_probe_mod  # noqa: F401

        assert seen == [1]
        imports.after_import("rlcheck_probe_mod", lambda m: seen.append(m.VALUE + 1))
        assert seen == [1, 2]
        del sys.modules["rlcheck_probe_mod"]


class TestWrapping:
    def trainer_module(self, name="verl.trainer.ppo.ray_trainer"):
        module = types.ModuleType(name)

        class RayPPOTrainer:
            global_steps = 1

            def init_workers(self):
                self.started = True

            def _compute_old_log_prob(self, batch):
                return types.SimpleNamespace(batch={"old_log_probs": batch["old_log_probs"]}), 0.0

        module.RayPPOTrainer = RayPPOTrainer
        return module

    def test_attach_wraps_once(self):
        module = self.trainer_module()
        plugin._attach("RayPPOTrainer", "init_workers", module)
        wrapped = module.RayPPOTrainer._compute_old_log_prob
        plugin._attach("RayPPOTrainer", "init_workers", module)
        assert module.RayPPOTrainer._compute_old_log_prob is wrapped

    def test_without_settings_the_trainer_runs_untouched(self):
        """No `rlcheck` section: init and every step run as verl's own, nothing observed."""
        module = self.trainer_module()
        plugin._attach("RayPPOTrainer", "init_workers", module)
        trainer = module.RayPPOTrainer()
        trainer.config = verl_config()
        trainer.init_workers()
        assert trainer.started and trainer._rlcheck is None
        out, _ = trainer._compute_old_log_prob({"old_log_probs": 1})
        assert out.batch["old_log_probs"] == 1

    def test_a_refusal_stops_init_before_the_workers(self):
        module = self.trainer_module()
        plugin._attach("RayPPOTrainer", "init_workers", module)
        trainer = module.RayPPOTrainer()
        trainer.config = verl_config(algorithm__rollout_correction__bypass_mode=True, rlcheck={})
        with pytest.raises(ConfigError, match="bypass_mode"):
            trainer.init_workers()
        assert not getattr(trainer, "started", False)

    def test_a_subclass_of_a_wrapped_trainer_is_wrapped_too(self):
        """The fully async trainer subclasses the legacy one, wrapped first: it gets its own wrappers (the
        parent's flag does not stand for it)."""
        module = self.trainer_module()
        plugin._attach("RayPPOTrainer", "init_workers", module)
        child = types.ModuleType("verl.experimental.fully_async_policy.fully_async_trainer")

        class FullyAsyncTrainer(module.RayPPOTrainer):
            async def init_workers(self):
                self.started = True

            def _compute_old_log_prob(self, batch):
                return super()._compute_old_log_prob(batch)

        child.FullyAsyncTrainer = FullyAsyncTrainer
        plugin._attach("FullyAsyncTrainer", "init_workers", child)
        assert FullyAsyncTrainer.__dict__["_compute_old_log_prob"].__wrapped__.__qualname__.startswith("TestWrapping")
        assert inspect.iscoroutinefunction(FullyAsyncTrainer.init_workers)

    def test_a_ray_actor_class_is_wrapped_in_rays_subclass(self):
        """`@ray.remote` trainers (the fully async one): Ray runs its own subclass holding copies of the
        methods, so that is the class wrapped."""
        module = self.trainer_module()
        modified = type("Class", (module.RayPPOTrainer,), dict(module.RayPPOTrainer.__dict__))
        module.RayPPOTrainer = types.SimpleNamespace(__ray_metadata__=types.SimpleNamespace(modified_class=modified))
        plugin._attach("RayPPOTrainer", "init_workers", module)
        assert modified.__dict__["_rlcheck_wrapped"] and hasattr(modified.__dict__["_compute_old_log_prob"], "__wrapped__")

    def test_kinds(self):
        assert plugin.kind_of(types.SimpleNamespace(current_param_version=0)) == "fully_async"
        v1 = type("PPOTrainerSync", (), {"__module__": "verl.trainer.ppo.v1.trainer_sync"})
        assert plugin.kind_of(v1()) == "v1" and plugin.kind_of(object()) == "legacy"


def fields(num_rows=6, width=8, seed=0, versions=None):
    """verl's step batch as a plain mapping: rollout and old logprobs on response_mask, uids."""
    rng = np.random.default_rng(seed)
    lr = -rng.exponential(1.0, (num_rows, width)).astype(np.float32)
    out = {"rollout_log_probs": lr, "old_log_probs": lr + rng.normal(0, 1e-3, lr.shape).astype(np.float32),
           "response_mask": np.ones((num_rows, width), dtype=np.int64),
           "responses": rng.integers(3, 100, (num_rows, width)), "uid": np.array([f"u{i // 2}" for i in range(num_rows)])}
    if versions is not None:
        out["min_global_steps"] = out["max_global_steps"] = np.array([versions] * num_rows, dtype=object)
    return out


class TestSessionRunDir:
    def session(self, tmp_path, **kw):
        return Session(settings.VerlSettings(run_dir=str(tmp_path / "rlcheck"), **kw), "legacy", {})

    def test_fresh_run_keeps_the_earlier_aside(self, tmp_path):
        """verl starting at step 1 (trainer.resume_mode found nothing to resume): the earlier run in the
        directory is kept as rlcheck.prev-1 and never appended to."""
        first = self.session(tmp_path)
        for step in (1, 2):
            first.observe(step, fields(versions=step - 1), global_steps=step)
        first.close()
        second = self.session(tmp_path)
        with pytest.warns(UserWarning, match="held an earlier run"):
            second.observe(1, fields(versions=0), global_steps=1)
        second.close()
        lines = lambda d: (tmp_path / d / "metrics.jsonl").read_text().splitlines()  # noqa: E731
        assert len(lines("rlcheck.prev-1")) == 2 and len(lines("rlcheck")) == 1

    def test_resumed_run_continues(self, tmp_path):
        """verl resumed from its checkpoint (first step past 1): rlcheck resumes the run there."""
        first = self.session(tmp_path)
        first.observe(1, fields(versions=0), global_steps=1)
        first.close()
        second = self.session(tmp_path)
        with pytest.warns(UserWarning, match="resuming"):
            second.observe(2, fields(versions=1), global_steps=2)
        second.close()
        records = [json.loads(line) for line in (tmp_path / "rlcheck" / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in records] == [1, 2] and records[1]["resumed"]["after_step"] == 1

    def test_pending_metrics_are_rlchecks_own(self, tmp_path):
        session = self.session(tmp_path)
        session.observe(1, fields(versions=0), {"training/rollout_probs_diff_mean": 0.5}, global_steps=1)
        assert session.pending and all(k.startswith("rlcheck/") for k in session.pending)
        session.close()

    def test_halt_raises_with_the_dump(self, tmp_path):
        """A step on weights older than verl's convention allows halts, the dump written."""
        session = self.session(tmp_path)
        session.observe(1, fields(versions=0), global_steps=1)
        with pytest.raises(MismatchHalt, match="step 2") as err:
            session.observe(2, fields(versions=0), global_steps=2)
        assert (tmp_path / "rlcheck" / "dumps" / "step_000002").is_dir() and err.value.dump_dir
        again = pickle.loads(pickle.dumps(err.value))  # how Ray hands it from verl's TaskRunner to main_ppo
        assert str(again) == str(err.value) and again.report.step == 2 and again.dump_dir == err.value.dump_dir

    def test_first_alarm_is_dumped(self, tmp_path):
        """A step that alarms without halting (a warn) keeps its sequences for `rlcheck diagnose`."""
        session = self.session(tmp_path)
        batch = fields(versions=0)
        batch["old_log_probs"] = batch["old_log_probs"] - 0.2  # mean |d| past the warn level, no hard limit
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            report = session.observe(1, batch, global_steps=1)
        assert report.alarms and not report.halted
        meta = json.loads((tmp_path / "rlcheck" / "dumps" / "step_000001" / "meta.json").read_text())
        assert meta["reason"] == "first alarm"
        session.close()


class TestV1Rows:
    def test_uid_of_a_row_key(self):
        assert tq_batch.uid_of("4f1c-9a_3_0") == "4f1c-9a" and tq_batch.uid_of("plain") == "plain"

    def test_versions_only_when_every_row_has_them(self):
        keys = ["a_0_0", "a_1_0"]
        both = tq_batch.non_tensors(keys, [{"min_global_steps": 2, "max_global_steps": 2}] * 2)
        assert both["uid"].tolist() == ["a", "a"] and both["min_global_steps"].tolist() == [2, 2]
        partial = tq_batch.non_tensors(keys, [{"min_global_steps": 2}, {"min_global_steps": None}])
        assert "min_global_steps" not in partial

    def test_turn_counts_as_the_legacy_trainers(self):
        """The v1 rows' `num_turns` field becomes `__num_turns__`, which the agent-loop adapter reads."""
        found = tq_batch.non_tensors(["a_0_0", "a_1_0"], [{}, {}], [6, 2])
        assert found["__num_turns__"].tolist() == [6, 2]
        assert "__num_turns__" not in tq_batch.non_tensors(["a_0_0"], [{}])
