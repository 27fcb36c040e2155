"""The packed-batch trainer: RL (rollout → reward → estimator updates) and SFT, one loop.

One RL step (``mode="rl"``), reading order of :func:`train`:

1. the rollout engine (synced from the model, in its own precision) samples ``G`` responses for
   each of ``prompts_per_step`` training prompts, recording ``log μ`` and its routing;
2. the task scores every response exactly (``reward``);
3. the batch is packed (first-fit decreasing, rows of ``max prompt + max_new_tokens``);
4. the ``old_logprob`` pass records the training engine's routing (R2) or replays the engine's
   (R3) (:func:`~tokenmdp.rl.rollout.compute_old_logprobs`); ``ref_logprob`` from the reference
   (the initial model) when the estimator has a KL penalty;
5. :func:`~tokenmdp.estimators.prepare` runs **once** on the whole step: the advantages need
   whole groups;
6. the sequences are shuffled and split into ``N = minibatches`` mini-batches. **Each mini-batch
   update is its own optimizer step** (as in PPO), so each mini-batch gets the loss weights of
   its own counts (:func:`prepare_minibatch`); the advantages of step 5 are kept. Updates
   ``2..N`` are off-policy: ``π_θ ≠ π_old``, which the estimator's ratio and clip handle;
7. metrics (one JSON line per step in ``out_dir/metrics.jsonl``) and, every ``eval_every``
   steps, the held-out accuracy.

SFT (``mode="sft"``) is the same loop with demonstrations (the task's correct answers) in place
of steps 1-4, ``A = 1`` and a REINFORCE surrogate with token-mean aggregation: the loss is the
mean NLL of the answer tokens.

An update with a non-finite loss or gradient is skipped with a logged warning; after
``max_nonfinite`` in a row the run stops (:class:`NonFiniteError`). A checkpoint (model,
reference, optimizer, RNG states, step) is written atomically (temporary file, then
``os.replace``); ``resume=True`` continues from it and, on the CPU with deterministic algorithms,
repeats an uninterrupted run's metrics exactly (except :data:`TIMING_FIELDS`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import time
from pathlib import Path

import numpy as np
import torch

from tokenmdp import estimators
from tokenmdp.batch import TokenBatch
from tokenmdp.distributed import global_counts
from tokenmdp.estimators import Aggregation, Estimator, KLPenalty, Reinforce, RewardAsAdvantage
from tokenmdp.model import ModelConfig, MoETransformer
from tokenmdp.packing import pack_first_fit_decreasing, select_sequences
from tokenmdp.rl.config import DTYPES, TrainConfig, check_config
from tokenmdp.rl.rollout import (
    ENGINE_ROUTING,
    OLD_ROUTING,
    RolloutEngine,
    RoutingReplay,
    compute_old_logprobs,
    replay_routing,
    routing_mismatch_rate,
    training_inference_kl,
)
from tokenmdp.rl.tasks import CharTokenizer, Task, get_task

__all__ = ["SFT_ESTIMATOR", "TIMING_FIELDS", "NonFiniteError", "build_estimator", "build_model",
           "minibatch_loss", "prepare_minibatch", "split_minibatches", "train"]

log = logging.getLogger(__name__)

TIMING_FIELDS = ("time_s", "tokens_per_s")
"""Metrics that measure wall time (the only ones a resumed run may change)."""

SFT_ESTIMATOR = Estimator(name="sft", surrogate=Reinforce(), advantage=RewardAsAdvantage(),
                          aggregation=Aggregation.TOKEN_MEAN)
"""SFT as an estimator: ``A = R = 1``, weighted NLL, mean over the step's answer tokens."""

_RESUMABLE = ("steps", "resume", "eval_every", "checkpoint_every", "out_dir")
"""Settings a resumed run may change without a warning."""
CHECKPOINT = "checkpoint.pt"
METRICS = "metrics.jsonl"


class NonFiniteError(RuntimeError):
    """Raised after ``max_nonfinite`` updates in a row had a non-finite loss or gradient."""


# ---------------------------------------------------------------------------------- building
def build_model(cfg: TrainConfig, vocab_size: int) -> MoETransformer:
    """The MoE transformer of ``cfg``, initialized from ``cfg.seed`` on ``cfg.device``."""
    mc = ModelConfig(vocab_size=vocab_size, d_model=cfg.d_model, n_layers=cfg.n_layers,
                     n_heads=cfg.n_heads, n_experts=cfg.n_experts, top_k=cfg.top_k,
                     expert_hidden=cfg.expert_hidden, dense=cfg.dense, init_std=cfg.init_std)
    return MoETransformer(mc, generator=torch.Generator().manual_seed(cfg.seed),
                          device=cfg.device, dtype=DTYPES[cfg.dtype])


def build_estimator(cfg: TrainConfig) -> Estimator:
    """The registry estimator (rl) with ``kl_coef`` applied (k3 in the loss), or SFT's."""
    if cfg.mode == "sft":
        return SFT_ESTIMATOR
    est = estimators.get(cfg.estimator)
    if cfg.kl_coef is not None:
        est = est.replace(kl=KLPenalty(coef=cfg.kl_coef, in_reward=False) if cfg.kl_coef > 0
                          else None)
    return est


# ---------------------------------------------------------------------------------- one update
def minibatch_loss(model: MoETransformer, batch: TokenBatch, estimator: Estimator,
                   replay: RoutingReplay | str = RoutingReplay.NONE
                   ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss of one update: ``log π_θ`` under the replayed routing, then
    :func:`~tokenmdp.estimators.loss` with the batch's own ``advantage`` and ``loss_weight``."""
    logprobs_RC = model.token_logprobs(batch, routing=replay_routing(batch, replay))
    return estimators.loss(logprobs_RC.to(batch.dtype), batch, estimator)


def prepare_minibatch(batch: TokenBatch, estimator: Estimator, *, max_len: int) -> TokenBatch:
    """Loss weights of a mini-batch that is its own optimizer step: the aggregation with the
    mini-batch's counts (summed over ranks); ``advantage`` is kept as the step computed it."""
    mask = estimators.counted_mask(batch, estimator)
    counts = global_counts(batch, mask=mask)
    weights = estimators.loss_weights(batch, estimator.aggregation, num_tokens=counts.num_loss_tokens,
                                      num_sequences=counts.num_sequences, max_len=max_len,
                                      mask=mask)
    return batch.replace(loss_weight=weights)


def split_minibatches(batch: TokenBatch, n: int, *, generator: torch.Generator,
                      capacity: int) -> list[TokenBatch]:
    """Shuffle the sequences (``generator``, CPU) into ``n`` parts of sizes differing by at most
    one, each packed again (first-fit decreasing, rows of ``capacity``)."""
    order = torch.randperm(batch.num_sequences, generator=generator)
    return [pack_first_fit_decreasing(select_sequences(batch, part.sort().values.to(batch.device)),
                                      capacity) for part in order.tensor_split(n)]


# ---------------------------------------------------------------------------------- the run
class _Run:
    """Everything a run carries from step to step (all of it is in the checkpoint)."""

    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg
        self.task: Task = get_task(cfg.task)
        self.tok: CharTokenizer = self.task.tokenizer
        self.est = build_estimator(cfg)
        self.replay = RoutingReplay(cfg.replay) if cfg.mode == "rl" else RoutingReplay.NONE
        self.dtype = DTYPES[cfg.dtype]
        self.capacity = self.task.max_prompt_len() + cfg.max_new_tokens
        self.model = build_model(cfg, self.tok.vocab_size)
        if cfg.init is not None:
            state = torch.load(cfg.init, map_location=cfg.device, weights_only=True)
            if state["model_config"] != dataclasses.asdict(self.model.config):
                raise ValueError(f"init: {cfg.init} holds a model of another shape: "
                                 f"{state['model_config']}")
            self.model.load_state_dict(state["model"])
        self.reference = MoETransformer(self.model.config, generator=torch.Generator(),
                                        device=cfg.device, dtype=self.dtype)
        self.reference.load_state_dict(self.model.state_dict())
        self.reference.requires_grad_(False)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr,
                                           betas=(cfg.beta1, cfg.beta2),
                                           weight_decay=cfg.weight_decay)
        self.engine = RolloutEngine(self.model, precision=cfg.rollout_precision)
        self.sample_gen = torch.Generator(device=cfg.device).manual_seed(cfg.seed)
        self.shuffle_gen = torch.Generator().manual_seed(cfg.seed + 1)
        self.rng = np.random.default_rng(cfg.seed)
        self.eval_set = self.task.eval_split(cfg.eval_size, cfg.eval_seed)
        self.exclude = frozenset(ex.prompt for ex in self.eval_set)
        self.step = 0
        self.nonfinite_run = 0

    # ------------------------------------------------------------------ checkpoints
    def save(self, path: Path) -> None:
        state = {"model": self.model.state_dict(), "reference": self.reference.state_dict(),
                 "optimizer": self.optimizer.state_dict(), "step": self.step,
                 "nonfinite_run": self.nonfinite_run, "numpy_rng": self.rng.bit_generator.state,
                 "sample_gen": self.sample_gen.get_state(),
                 "shuffle_gen": self.shuffle_gen.get_state(),
                 "model_config": dataclasses.asdict(self.model.config),
                 "config": dataclasses.asdict(self.cfg)}
        tmp = path.with_name(path.name + ".tmp")
        torch.save(state, tmp)
        os.replace(tmp, path)  # atomic: a reader sees the old or the new checkpoint, never half

    def load(self, path: Path) -> None:
        state = torch.load(path, map_location=self.cfg.device, weights_only=True)
        changed = sorted(k for k, v in dataclasses.asdict(self.cfg).items()
                         if k not in _RESUMABLE and state["config"].get(k) != v)
        if changed:
            log.warning("resuming %s with changed settings: %s", path, ", ".join(changed))
        self.model.load_state_dict(state["model"])
        self.reference.load_state_dict(state["reference"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step, self.nonfinite_run = state["step"], state["nonfinite_run"]
        self.rng.bit_generator.state = state["numpy_rng"]
        self.sample_gen.set_state(state["sample_gen"])
        self.shuffle_gen.set_state(state["shuffle_gen"])

    # ------------------------------------------------------------------ data of one step
    def rollout(self) -> tuple[TokenBatch, dict[str, float]]:
        cfg = self.cfg
        examples = self.task.sample(cfg.prompts_per_step, self.rng, exclude=self.exclude)
        repeated = [ex for ex in examples for _ in range(cfg.group_size)]
        groups = [i for i in range(len(examples)) for _ in range(cfg.group_size)]
        self.engine.sync(self.model)
        batch = self.engine.generate([self.tok.encode(ex.prompt) for ex in repeated],
                                     max_new_tokens=cfg.max_new_tokens, eos_id=self.tok.EOS,
                                     generator=self.sample_gen, temperature=cfg.temperature,
                                     groups=groups, dtype=self.dtype)
        responses = [r for _, r in batch.sequences()]
        reward_S = torch.tensor([self.task.reward(ex, r) for ex, r in zip(repeated, responses)],
                                dtype=self.dtype, device=batch.device)
        correct = [self.task.is_correct(ex, r) for ex, r in zip(repeated, responses)]
        batch = pack_first_fit_decreasing(batch.replace(reward=reward_S), self.capacity)
        batch = compute_old_logprobs(self.model, batch, self.replay)
        if self.est.kl is not None:
            with torch.no_grad():
                ref_RC = self.reference.token_logprobs(batch)
            batch = batch.replace(ref_logprob=ref_RC.to(self.dtype))
        with torch.no_grad():  # entropy of π_old at the sampled states
            lp_RCV = self.model.next_token_logprobs(
                batch, routing=replay_routing(batch, self.replay))
            ent_RC = -torch.where(lp_RCV > -math.inf, lp_RCV.exp() * lp_RCV, 0.0).sum(-1)
        mask = batch.loss_mask
        stats = {"reward": float(reward_S.mean()), "reward_std": float(reward_S.std(correction=0)),
                 "train_accuracy": float(np.mean(correct)),
                 "response_length": float(batch.length.double().mean()),
                 "entropy": float(ent_RC[mask].double().mean()),
                 "train_infer_kl_k1": training_inference_kl(batch, kind="k1"),
                 "train_infer_kl_k3": training_inference_kl(batch, kind="k3"),
                 "routing_mismatch": routing_mismatch_rate(batch.token_extras[ENGINE_ROUTING],
                                                           batch.token_extras[OLD_ROUTING])}
        return batch, stats

    def demonstrations(self) -> tuple[TokenBatch, dict[str, float]]:
        examples = self.task.sample(self.cfg.prompts_per_step, self.rng, exclude=self.exclude)
        batch = TokenBatch.from_sequences(
            [self.tok.encode(ex.prompt) for ex in examples],
            [self.tok.encode(ex.answer) + [self.tok.EOS] for ex in examples],
            rewards=[1.0] * len(examples), dtype=self.dtype, device=self.cfg.device)
        batch = pack_first_fit_decreasing(batch, self.capacity)
        return batch, {"response_length": float(batch.length.double().mean())}

    # ------------------------------------------------------------------ updates
    def updates(self, batch: TokenBatch) -> dict[str, float]:
        cfg, params = self.cfg, list(self.model.parameters())
        batch = estimators.prepare(batch, self.est, max_len=cfg.max_new_tokens)
        parts = split_minibatches(batch, cfg.minibatches, generator=self.shuffle_gen,
                                  capacity=self.capacity)
        losses, norms, metrics, skipped = [], [], [], 0
        for part in parts:
            part = prepare_minibatch(part, self.est, max_len=cfg.max_new_tokens)
            self.optimizer.zero_grad(set_to_none=True)
            loss, m = minibatch_loss(self.model, part, self.est, self.replay)
            if torch.isfinite(loss):
                loss.backward()
                norm = torch.nn.utils.clip_grad_norm_(
                    params, cfg.grad_clip if cfg.grad_clip > 0 else math.inf)
            if not torch.isfinite(loss) or not torch.isfinite(norm):
                self.nonfinite_run += 1
                skipped += 1
                log.warning("step %d: non-finite loss or gradient, update skipped (%d in a row)",
                            self.step, self.nonfinite_run)
                self.optimizer.zero_grad(set_to_none=True)
                if self.nonfinite_run >= cfg.max_nonfinite:
                    raise NonFiniteError(f"{self.nonfinite_run} updates in a row had a "
                                         "non-finite loss or gradient; stopping")
                continue
            self.nonfinite_run = 0
            self.optimizer.step()
            losses.append(float(loss.detach()))
            norms.append(float(norm))
            metrics.append(m)
        out = {"loss": _mean(losses), "grad_norm": _mean(norms), "skipped_updates": skipped}
        tokens = [float(m["tokens"]) for m in metrics]
        for key in ("clip_fraction", "masked_fraction", "r_mean", "rho_mean", "kl_ref"):
            if metrics and key in metrics[0]:  # token-weighted over the updates
                out[key] = sum(float(m[key]) * t for m, t in zip(metrics, tokens)) / \
                    max(sum(tokens), 1.0)
        for key, pick in (("r_min", min), ("r_max", max), ("rho_min", min), ("rho_max", max)):
            if metrics and key in metrics[0]:
                out[key] = pick(float(m[key]) for m in metrics)
        return out

    @torch.no_grad()
    def evaluate(self) -> float:
        """Fraction of held-out prompts answered correctly (near-greedy sampling)."""
        self.engine.sync(self.model)
        gen = torch.Generator(device=self.cfg.device).manual_seed(self.cfg.eval_seed + self.step)
        batch = self.engine.generate([self.tok.encode(ex.prompt) for ex in self.eval_set],
                                     max_new_tokens=self.cfg.max_new_tokens, eos_id=self.tok.EOS,
                                     generator=gen, temperature=self.cfg.eval_temperature,
                                     dtype=self.dtype)
        return float(np.mean([self.task.is_correct(ex, r)
                              for ex, (_, r) in zip(self.eval_set, batch.sequences())]))


def _mean(values: list[float]) -> float | None:
    """Mean, or None (JSON null) when every update of the step was skipped."""
    return float(np.mean(values)) if values else None


@contextlib.contextmanager
def _deterministic(enabled: bool):
    before = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    if enabled and not before:  # warn only: an op without a deterministic kernel still runs
        torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before, warn_only=warn_only)


def _keep_metrics_before(path: Path, step: int) -> None:
    """Drop lines of steps ``>= step`` (written after the checkpoint a resumed run starts from)."""
    if path.exists():
        lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
        kept = [ln for ln in lines if json.loads(ln)["step"] < step]
        path.write_text("".join(ln + "\n" for ln in kept))


def train(cfg: TrainConfig) -> list[dict]:
    """Run ``cfg`` (RL or SFT, see the module docstring) and return this call's metrics rows.

    Writes ``out_dir/metrics.jsonl`` (one JSON object per step: ``step`` 0-based, ``lr``,
    the step statistics, ``eval_accuracy`` at evaluation steps) and ``out_dir/checkpoint.pt``.

    Raises
    ------
    ValueError
        On a bad configuration (:func:`~tokenmdp.rl.config.check_config`), before any work.
    NonFiniteError
        After ``max_nonfinite`` consecutive non-finite updates.
    """
    check_config(cfg)
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ckpt, metrics_path = out / CHECKPOINT, out / METRICS
    rows = []
    with _deterministic(cfg.deterministic):
        run = _Run(cfg)
        if cfg.resume and ckpt.exists():
            run.load(ckpt)
            log.info("resumed from %s at step %d", ckpt, run.step)
        _keep_metrics_before(metrics_path, run.step if cfg.resume else 0)
        while run.step < cfg.steps:
            t0 = time.perf_counter()
            lr = cfg.lr * (min(1.0, (run.step + 1) / cfg.warmup_steps) if cfg.warmup_steps
                           else 1.0)
            for group in run.optimizer.param_groups:
                group["lr"] = lr
            if cfg.mode == "rl":
                batch, stats = run.rollout()
            else:
                batch, stats = run.demonstrations()
            row = {"step": run.step, "lr": lr, **stats, **run.updates(batch),
                   "tokens": batch.num_real_tokens}
            last = run.step == cfg.steps - 1
            run.step += 1
            if last or (cfg.eval_every and run.step % cfg.eval_every == 0):
                row["eval_accuracy"] = run.evaluate()
            row["time_s"] = time.perf_counter() - t0
            row["tokens_per_s"] = row["tokens"] / max(row["time_s"], 1e-9)
            with open(metrics_path, "a") as f:
                f.write(json.dumps(row) + "\n")
            rows.append(row)
            if last or (cfg.checkpoint_every and run.step % cfg.checkpoint_every == 0):
                run.save(ckpt)
    return rows
