"""Beyond the sampled token with TRL: vLLM's top-K logprobs at every completion position and the
trainer's logprobs at the same ids, as the step's `TopK` (`rlcheck/dist/*`, `TRLOptions.top_logprobs`).

vLLM side. TRL 1.16 builds its `VLLMGeneration` with `logprobs=0` (the sampled token's logprob only)
and keeps `lp[0]` of each position, the entry of rank 1 once `logprobs` > 0: the top-1 token's,
not the sampled token's. So rlcheck sets `vllm_generation.logprobs = K` and wraps the instance's
`generate` (`EngineTopK`): it hands TRL each position's sampled-token logprob alone (what
`logprobs=0` gives), and keeps the top-K of each completion, in the order of TRL's rows. Colocate
mode: vLLM caps K at the engine's `max_logprobs` (20 unless set). Server mode: TRL's client returns
the same per-position lists (ids as `token_id:<n>`), capped by the server's `--max-logprobs`
(`trl vllm-serve` lifts it). Refused: `rollout_func` (TRL does not call its generate), tools (several
generate calls per row, tool tokens between), a `logprobs` entry in `generation_kwargs`.

Trainer side (`trainer_topk`): one more no-grad forward of prompt + completion per generation, under
accelerate's autocast as TRL's own, `rlcheck.trainers.logprobs.token_logprobs` at TRL's temperature
scoring the engine's ids and the trainer's own top-K in its chunked pass (no [T, vocab] tensor).
Text-only models: the forward takes no image inputs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from rlcheck.core.topk import PAD_ID, TopK, from_engine_dicts
from rlcheck.errors import ConfigError, InputError

DEFAULT_TOP_K = 20
"""K when `StatsConfig(distribution=True)` asks for the metrics and `TRLOptions.top_logprobs` is None (as
`rlcheck demo --topk`'s usual K)."""
IMAGE_KEYS = ("pixel_values", "image_grid_thw", "pixel_attention_mask", "image_sizes")


def resolve_top_k(top_k: int | None, distribution: bool) -> int:
    """K for a run: `top_k` as given, or with None `DEFAULT_TOP_K` when the Monitor's stats compare
    distributions and 0 (off) otherwise."""
    if top_k is None:
        return DEFAULT_TOP_K if distribution else 0
    return top_k


def check_topk(trainer: Any, k: int) -> None:
    """ConfigError when this GRPOTrainer cannot give vLLM's top-`k` rows (see the module docstring)."""
    why = None
    if getattr(trainer, "rollout_func", None) is not None:
        why = "a rollout_func generates instead of TRL's vLLM call"
    elif getattr(trainer, "tools", None):
        why = "with tools TRL calls vLLM several times per completion, with tool tokens between"
    elif "logprobs" in (getattr(trainer.vllm_generation, "generation_kwargs", None) or {}):
        why = "GRPOConfig.generation_kwargs sets 'logprobs' (TRLOptions.top_logprobs sets it: remove the entry)"
    else:
        cap = _max_logprobs(trainer)
        if cap is not None and 0 <= cap < k:
            why = (f"vLLM returns at most max_logprobs={cap} per position (colocate: the engine's "
                   "default, which TRL does not expose; server: start it with --max-logprobs -1)")
    if why:
        raise ConfigError(f"rlcheck cannot take vLLM's top-{k} logprobs from this GRPOTrainer: {why}. "
                          "Top-k metrics need use_vllm=True (colocate or server) and plain single-turn "
                          "generation; TRLOptions(top_logprobs=0) turns them off")


def _max_logprobs(trainer: Any) -> int | None:
    gen = trainer.vllm_generation
    llm = getattr(gen, "llm", None)
    if llm is not None:
        return int(llm.llm_engine.model_config.max_logprobs)
    client = getattr(gen, "vllm_client", None)
    if client is None or not trainer.accelerator.is_main_process:
        return None
    return (client.get_server_info().get("model_config") or {}).get("max_logprobs")


def split_sampled(completion_ids: Sequence[Sequence[int]], logprobs: Sequence[Any], token_ids: Sequence[Any],
                  k: int) -> tuple[list, list, list[tuple[np.ndarray, np.ndarray]]]:
    """TRL's per-position lists (each sorted by rank, the sampled token among them) of every completion
    as (logprobs [[sampled]] per position and ids [[sampled]], what TRL reads with `logprobs=0`; None
    where vLLM had none), and per completion the top-`k` (ids (L, k) int64, logp (L, k) float32)."""
    sampled_lp, sampled_ids, tops = [], [], []
    for seq, lps, ids in zip(completion_ids, logprobs, token_ids, strict=True):
        dicts = [{t: v for t, v in zip(i, lp, strict=True) if v is not None} for i, lp in zip(ids, lps, strict=True)]
        sampled_lp.append([[d.get(t)] for t, d in zip(seq, dicts, strict=True)])
        sampled_ids.append([[t] for t in seq])
        tops.append(from_engine_dicts(dicts, k))
    return sampled_lp, sampled_ids, tops


class EngineTopK:
    """Wraps `vllm_generation.generate` to keep each completion's top-`k`; `take()` returns the rows
    of the last call and forgets them (TRL makes one call per `_generate_and_score_completions`)."""

    def __init__(self, vllm_generation: Any, k: int):
        self.k = k
        self._gen = vllm_generation
        self._previous = vllm_generation.__dict__.get("generate")  # someone else's wrapper, if any
        self._generate = vllm_generation.generate
        self._rows: list[tuple[np.ndarray, np.ndarray]] | None = None
        vllm_generation.logprobs = k
        vllm_generation.generate = self.generate

    def generate(self, *args: Any, **kwargs: Any) -> tuple:
        prompt_ids, completion_ids, logprobs, token_ids = self._generate(*args, **kwargs)
        if logprobs is None or token_ids is None:
            raise InputError("TRL's vLLM returned no logprobs for top-k: is the engine's max_logprobs 0?")
        logprobs, token_ids, self._rows = split_sampled(completion_ids, logprobs, token_ids, self.k)
        return prompt_ids, completion_ids, logprobs, token_ids

    def take(self) -> list[tuple[np.ndarray, np.ndarray]] | None:
        rows, self._rows = self._rows, None
        return rows

    def uninstall(self) -> None:
        """TRL's generate and `logprobs=0` back."""
        if self._previous is None:
            del self._gen.generate
        else:
            self._gen.generate = self._previous
        self._gen.logprobs = 0


def padded_engine_topk(rows: Sequence[tuple[np.ndarray, np.ndarray]], num_cols: int,
                       k: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-completion top-k (L_i, k) right-padded as TRL pads completions: ids (B, C, k) int64 (-1 on
    padding), logp (B, C, k) float32 (-inf on padding)."""
    ids = np.full((len(rows), num_cols, k), PAD_ID, dtype=np.int64)
    lp = np.full((len(rows), num_cols, k), -np.inf, dtype=np.float32)
    for b, (i, p) in enumerate(rows):
        if i.shape[0] > num_cols:
            raise InputError(f"completion {b} has {i.shape[0]} top-k rows for {num_cols} completion columns")
        ids[b, : i.shape[0]], lp[b, : i.shape[0]] = i, p
    return ids, lp


def step_topk(engine_ids: np.ndarray, engine_lp: np.ndarray, logp_at: Any, own_ids: Any) -> TopK:
    """The `TopK` of B*C rows (row b*C + t: completion position (b, t), as `StepBatch.from_padded`
    takes it) from (B, C, K) arrays: the engine's ids and logprobs, the trainer's logprobs at those
    ids and its own top-K ids."""
    b, c, k = engine_ids.shape
    parts = [engine_ids, engine_lp, logp_at, own_ids]
    flat = [np.asarray(x).reshape(b * c, -1) for x in parts]
    if any(x.shape != (b * c, k) for x in flat):
        raise InputError(f"top-k parts have shapes {[np.shape(x) for x in parts]}, expected ({b}, {c}, {k}) each")
    return TopK.from_packed(*flat)


def trainer_topk(trainer: Any, output: dict, engine_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The trainer's logprobs at the engine's ids (B, C, K) and its own top-K ids (B, C, K) at every
    completion position of TRL's step output: a no-grad forward over prompt + completion in chunks of
    `per_device_train_batch_size` rows, at TRL's temperature and under accelerate's autocast."""
    import torch

    from rlcheck.trainers.logprobs import token_logprobs

    if any(output.get(key) is not None for key in IMAGE_KEYS):
        raise ConfigError("top-k metrics with TRL need a text-only model (the extra forward takes no images): "
                          "TRLOptions(top_logprobs=0)")
    ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)  # (B, P+C)
    attention = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)  # (B, P+C)
    start, k = output["prompt_ids"].shape[1] - 1, engine_ids.shape[2]  # output row P-1 scores completion token 0
    asked = torch.full((*ids.shape[:1], ids.shape[1] - 1, k), PAD_ID, dtype=torch.long, device=ids.device)
    asked[:, start:] = torch.from_numpy(engine_ids).to(ids.device)  # (B, P+C-1, K)
    at, own, rows = [], [], trainer.args.per_device_train_batch_size
    with torch.no_grad(), trainer.accelerator.autocast():
        for s in range(0, ids.shape[0], rows):
            out = token_logprobs(trainer.model, ids[s:s + rows], attention_mask=attention[s:s + rows],
                                 temperature=trainer.temperature, top_k=k, topk_ids=asked[s:s + rows])
            at.append(out.topk.logp_at[:, start:].float().cpu())  # (b, C, K)
            own.append(out.topk.ids[:, start:].cpu())  # (b, C, K)
    return torch.cat(at).numpy(), torch.cat(own).numpy()


def attach_topk(trainer: Any, cfg: Any, top_k: int | None, owned: bool) -> tuple[Any, EngineTopK | None]:
    """(the MonitorConfig to run with, the installed `EngineTopK` or None when top-k is off). `owned`:
    rlcheck opens the Monitor from `cfg`, so it may turn `StatsConfig.distribution` on."""
    import dataclasses

    k = resolve_top_k(top_k, cfg.stats.distribution)
    if not k:
        return cfg, None
    if not cfg.stats.distribution:
        if not owned:
            raise ConfigError(f"TRLOptions(top_logprobs={k}) with a Monitor whose StatsConfig has distribution=False: "
                              "build it with StatsConfig(distribution=True), or pass a MonitorConfig")
        cfg = dataclasses.replace(cfg, stats=dataclasses.replace(cfg.stats, distribution=True))
    check_topk(trainer, k)
    return cfg, EngineTopK(trainer.vllm_generation, k)


def build_step_topk(trainer: Any, output: dict, rows: Sequence[tuple[np.ndarray, np.ndarray]] | None,
                    k: int) -> TopK:
    """The step's `TopK` from the engine rows `EngineTopK.take()` kept and the trainer's extra forward."""
    num_rows, num_cols = output["completion_ids"].shape
    if rows is None or len(rows) != num_rows:
        raise InputError(f"top-k is on but vLLM's top-{k} of this generation's {num_rows} completions were not "
                         f"captured ({'none' if rows is None else len(rows)}): was TRL's vllm_generation.generate "
                         "replaced after rlcheck attached?")
    engine_ids, engine_lp = padded_engine_topk(rows, num_cols, k)
    logp_at, own = trainer_topk(trainer, output, engine_ids)
    return step_topk(engine_ids, engine_lp, logp_at, own)
