"""A training run's state from step to step, and the work of one step on it.

``_Run`` holds everything a run carries (all of it is in the checkpoint): the trained model
and its frozen reference (the initial model), the optimizer, the rollout engine, the task and
its held-out set, the RNG states, the step and the count of non-finite updates in a row. Its
methods are the parts of one step of :func:`tokenmdp.rl.trainer.train`:

* ``_Run.save`` / ``_Run.load`` — the checkpoint (rank 0 writes it; it holds every
  rank's RNG states) and resuming from it;
* ``_Run.rollout`` (RL: sample, score, pack, ``old_logprob`` pass, step statistics) or
  ``_Run.demonstrations`` (SFT: the task's answers);
* ``_Run.updates`` — with ``zero_variance_groups="skip"`` the groups of equal rewards dropped
  first (and no update at all when none is left), ``prepare`` once on the step, then
  ``minibatches`` optimizer updates (:mod:`tokenmdp.rl.update`), skipping non-finite ones
  (:class:`NonFiniteError` after ``max_nonfinite`` in a row or on non-finite weights);
* ``_Run.evaluate`` — the held-out accuracy.

:class:`NonFiniteError` is re-exported by :mod:`tokenmdp.rl.trainer`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from pathlib import Path

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel

from tokenmdp import estimators
from tokenmdp.batch import TokenBatch
from tokenmdp.distributed import (
    all_gather_objects,
    all_reduce_floats,
    data_parallel_loss_scale,
    rank_and_world_size,
)
from tokenmdp.model import MoETransformer
from tokenmdp.packing import pack_first_fit_decreasing
from tokenmdp.rl.checkpoint import (
    check_model_config,
    load_checkpoint,
    load_state,
    save_checkpoint,
)
from tokenmdp.rl.config import DTYPES, TrainConfig
from tokenmdp.rl.mismatch import (
    RoutingReplay,
    compute_old_logprobs,
)
from tokenmdp.rl.run_setup import (
    build_engine,
    build_estimator,
    build_model,
    build_optimizer,
    carry_optimizer_state,
    load_init,
)
from tokenmdp.rl.step_stats import rollout_stats, rollout_sums
from tokenmdp.rl.tasks import CharTokenizer, Task, get_task
from tokenmdp.rl.update import (
    TrainingPass,
    blame_stats,
    blame_sums,
    minibatch_loss,
    prepare_minibatch,
    split_minibatches,
    without_zero_variance_groups,
)

__all__ = ["INTERRUPTED_NOW", "INTERRUPTED_STATUS", "NonFiniteError", "RunInterrupted"]

# the trainer's logger: the run's warnings keep the name they are filtered by
log = logging.getLogger("tokenmdp.rl.trainer")

_RESUMABLE = ("steps", "resume", "overwrite", "eval_every", "checkpoint_every", "out_dir")
"""Settings a resumed run may change without a warning."""


class NonFiniteError(RuntimeError):
    """Raised after ``max_nonfinite`` updates in a row had a non-finite loss or gradient, or when
    the weights or the sampling distributions became non-finite (a diverging run)."""


class RunInterrupted(RuntimeError):
    """Raised when a run stopped at a step boundary on Ctrl-C (SIGINT), after writing its
    checkpoint and closing its logs: ``--resume`` continues it."""


INTERRUPTED_STATUS = 130
"""The exit status of a run stopped by Ctrl-C: 128 + SIGINT, as a shell reports it."""
INTERRUPTED_NOW = "interrupted mid-step: the last checkpoint written, if any, is kept"
"""What a second Ctrl-C says (the run stopped mid-step: no checkpoint is written for it)."""


class _Run:
    """Everything a run carries from step to step (all of it is in the checkpoint)."""

    def __init__(self, cfg: TrainConfig, device: torch.device | str | None = None, *,
                 init_state: dict | None = None) -> None:
        self.cfg = cfg
        self.rank, self.world = rank_and_world_size()
        self.device = torch.device(cfg.device if device is None else device)
        self.task: Task = get_task(cfg.task)
        self.tok: CharTokenizer = self.task.tokenizer
        self.est = build_estimator(cfg)
        self.replay = RoutingReplay(cfg.replay) if cfg.mode == "rl" else RoutingReplay.NONE
        self.dtype = DTYPES[cfg.dtype]
        self.capacity = self.task.max_prompt_len() + cfg.max_new_tokens
        self.model = build_model(cfg, self.tok.vocab_size, self.device)
        if cfg.init is not None:
            state = load_init(cfg, self.device) if init_state is None else init_state
            load_state(self.model, state["model"], option="init", path=cfg.init, field="model")
        self.reference = MoETransformer(self.model.config, generator=torch.Generator(),
                                        device=self.device, dtype=self.dtype)
        self.reference.load_state_dict(self.model.state_dict())
        self.reference.requires_grad_(False)
        # the training pass: through DDP when data parallel (rollout, old_logprob and
        # evaluation passes use self.model directly: no gradient, nothing to synchronize)
        self.trained: torch.nn.Module = self.model
        if self.world > 1:  # experts are stacked parameters: every one is used in every pass
            self.trained = DistributedDataParallel(TrainingPass(self.model))
        self.optimizer = build_optimizer(cfg, self.model.parameters())
        if cfg.init is not None and cfg.optimizer_state == "carry":  # else it starts at zero
            carry_optimizer_state(self.optimizer, state, path=cfg.init)
        self.engine = build_engine(cfg, self.model)
        self.sample_gen = torch.Generator(device=self.device).manual_seed(cfg.seed + self.rank)
        self.shuffle_gen = torch.Generator().manual_seed(cfg.seed + 1 + 7919 * self.rank)
        self.rng = np.random.default_rng(cfg.seed)  # the same on every rank: the step's prompts
        self.eval_set = self.task.eval_split(cfg.eval_size, cfg.eval_seed)
        self.exclude = frozenset(ex.prompt for ex in self.eval_set)
        self.step = 0
        self.nonfinite_run = 0

    # ------------------------------------------------------------------ checkpoints
    def save(self, path: Path) -> None:
        """Write the checkpoint (rank 0; a collective: every rank calls it, for its RNG states)."""
        rngs = all_gather_objects({"numpy_rng": self.rng.bit_generator.state,
                                   "sample_gen": self.sample_gen.get_state().cpu(),
                                   "shuffle_gen": self.shuffle_gen.get_state()})
        if self.rank != 0:
            return
        state = {"model": self.model.state_dict(), "reference": self.reference.state_dict(),
                 "optimizer": self.optimizer.state_dict(), "step": self.step,
                 "nonfinite_run": self.nonfinite_run, "rng": rngs,
                 "model_config": dataclasses.asdict(self.model.config),
                 "config": dataclasses.asdict(self.cfg)}
        save_checkpoint(state, path)  # atomic: a reader sees the old or the new one, never half

    def load(self, path: Path) -> None:
        state = load_checkpoint(path, option="resume", device=self.device)
        check_model_config(state, dataclasses.asdict(self.model.config), option="resume",
                           path=path)
        if len(state["rng"]) != self.world:
            raise ValueError(f"resume: {path} was written by {len(state['rng'])} rank(s), this "
                             f"run has {self.world}; resume with the same number of ranks")
        # a setting an older checkpoint predates counts as its default
        defaults = dataclasses.asdict(TrainConfig())
        saved = state["config"].get("optimizer", defaults["optimizer"])
        if saved != self.cfg.optimizer:   # torch would load it, then fail at the first update
            raise ValueError(f"resume: {path} was trained with optimizer {saved}, this run has "
                             f"{self.cfg.optimizer}; resume with the same optimizer")
        changed = sorted(k for k, v in dataclasses.asdict(self.cfg).items()
                         if k not in _RESUMABLE and state["config"].get(k, defaults[k]) != v)
        if changed and self.rank == 0:
            log.warning("resuming %s with changed settings: %s", path, ", ".join(changed))
        for field, target in (("model", self.model), ("reference", self.reference),
                              ("optimizer", self.optimizer)):
            load_state(target, state[field], option="resume", path=path, field=field)
        self.step, self.nonfinite_run = state["step"], state["nonfinite_run"]
        self._load_rng(state["rng"][self.rank], path)

    def _load_rng(self, rng, path: Path) -> None:
        """This rank's generator states, each refused by name if it is not one."""
        setters = {"numpy_rng": lambda v: setattr(self.rng.bit_generator, "state", v),
                   "sample_gen": self.sample_gen.set_state,
                   "shuffle_gen": lambda v: self.shuffle_gen.set_state(v.cpu())}
        for name, set_state in setters.items():
            try:
                set_state(rng[name])
            except (TypeError, ValueError, KeyError, RuntimeError, AttributeError) as err:
                raise ValueError(f"resume: {path}: field 'rng[{self.rank}].{name}' is not a "
                                 f"generator state ({str(err).strip() or type(err).__name__})"
                                 ) from None

    # ------------------------------------------------------------------ data of one step
    def _share(self, examples: list) -> list:
        """This rank's contiguous share of the step's examples (all of them on one process)."""
        per_rank = len(examples) // self.world
        return examples[self.rank * per_rank:(self.rank + 1) * per_rank]

    def rollout(self) -> tuple[TokenBatch, dict[str, float]]:
        cfg = self.cfg
        examples = self._share(self.task.sample(cfg.prompts_per_step, self.rng,
                                                exclude=self.exclude))
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
        reward_PG = reward_S.double().view(len(examples), cfg.group_size)  # groups contiguous
        zero_std_P = reward_PG.amax(dim=1) == reward_PG.amin(dim=1)
        batch = pack_first_fit_decreasing(batch.replace(reward=reward_S), self.capacity)
        # log π_old, the routing used and π_old's entropy at the sampled states: one pass
        batch, ent_RC = compute_old_logprobs(self.model, batch, self.replay, entropy=True)
        if self.est.kl is not None:
            with torch.no_grad():
                ref_RC = self.reference.token_logprobs(batch)
            batch = batch.replace(ref_logprob=ref_RC.to(self.dtype))
        sums = rollout_sums(batch, reward_S, correct, ent_RC, groups=len(examples),
                            zero_std=float(zero_std_P.sum()),
                            all_zero=float((zero_std_P & (reward_PG[:, 0] == 0)).sum()),
                            sequence=self._sequence_correction())
        _, stats = rollout_stats(sums, self.device)
        return batch, stats

    def _sequence_correction(self) -> bool:
        """Whether the estimator's correction acts per sequence (product or geometric mean)."""
        level = getattr(self.est.correction, "level", estimators.Level.TOKEN)
        return level is not estimators.Level.TOKEN

    def demonstrations(self) -> tuple[TokenBatch, dict[str, float]]:
        examples = self._share(self.task.sample(self.cfg.prompts_per_step, self.rng,
                                                exclude=self.exclude))
        batch = TokenBatch.from_sequences(
            [self.tok.encode(ex.prompt) for ex in examples],
            [self.tok.encode(ex.answer) + [self.tok.EOS] for ex in examples],
            rewards=[1.0] * len(examples), dtype=self.dtype, device=self.device)
        batch = pack_first_fit_decreasing(batch, self.capacity)
        n, length = all_reduce_floats([batch.num_sequences, float(batch.length.double().sum())],
                                      device=self.device)
        return batch, {"response_length": length / n}

    # ------------------------------------------------------------------ updates
    def updates(self, batch: TokenBatch) -> dict[str, float]:
        """Prepare the step (advantages of whole groups; this rank's share), then
        ``minibatches`` optimizer updates. Returns the step's update metrics (over all ranks).
        With ``zero_variance_groups="skip"`` the groups of equal rewards leave the step first; a
        step left with none on any rank takes no update (``optimizer_steps`` 0), one left with
        fewer sequences than ``minibatches`` (on its fullest rank) takes that many."""
        cfg, params = self.cfg, list(self.model.parameters())
        parts_n = cfg.minibatches
        if cfg.zero_variance_groups == "skip":
            batch = without_zero_variance_groups(batch, self.capacity)
            (most,) = all_reduce_floats([float(batch.num_sequences)], op="max",
                                        device=self.device)
            parts_n = min(parts_n, int(most))
            if parts_n == 0:      # every group of the step had equal rewards: no update
                return {"loss": None, "grad_norm": None, "skipped_updates": 0,
                        "optimizer_steps": 0}
        batch = estimators.prepare(batch, self.est, max_len=cfg.max_new_tokens,
                                   advantage_S=self._step_advantages(batch))
        blame = {}
        if cfg.mode == "rl":  # where the update at θ_old pushes (a diagnostic: no RNG, no state)
            sums = blame_sums(batch, self.est)
            blame = blame_stats(dict(zip(sums, all_reduce_floats(list(sums.values()),
                                                                 device=self.device))))
        parts = split_minibatches(batch, parts_n, generator=self.shuffle_gen,
                                  capacity=self.capacity)
        scale = data_parallel_loss_scale()
        losses, norms, metrics, skipped = [], [], [], 0
        for part in parts:
            part = prepare_minibatch(part, self.est, max_len=cfg.max_new_tokens)
            self.optimizer.zero_grad(set_to_none=True)
            loss, m = minibatch_loss(self.trained, part, self.est, self.replay,
                                     load_balancing_coef=cfg.load_balancing_coef,
                                     world_size=self.world)
            if part.num_sequences == 0:  # a rank whose groups were all skipped: a zero
                # gradient for every parameter, so that DDP's all-reduce still runs
                loss = loss + 0.0 * sum(p.sum() for p in params).to(loss.dtype)
            # every rank skips together (DDP's backward is a collective); the rank losses sum
            # to the mini-batch's loss (weights from the global counts)
            finite, global_loss = all_reduce_floats(
                [float(torch.isfinite(loss)), float(loss.detach())], device=self.device)
            finite = finite == self.world
            if finite:
                (loss * scale).backward()
                norm = torch.nn.utils.clip_grad_norm_(
                    params, cfg.grad_clip if cfg.grad_clip > 0 else math.inf)
            if not finite or not torch.isfinite(norm):
                self.nonfinite_run += 1
                skipped += 1
                if self.rank == 0:
                    log.warning("step %d: non-finite loss or gradient, update skipped (%d in a "
                                "row)", self.step, self.nonfinite_run)
                self.optimizer.zero_grad(set_to_none=True)
                if self.nonfinite_run >= cfg.max_nonfinite:
                    raise NonFiniteError(f"{self.nonfinite_run} updates in a row had a "
                                         "non-finite loss or gradient; stopping")
                continue
            self.nonfinite_run = 0
            self.optimizer.step()
            if not all(bool(torch.isfinite(p).all()) for p in params):
                raise NonFiniteError(f"step {self.step}: the weights became non-finite after an "
                                     f"update (lr {self.optimizer.param_groups[0]['lr']:g}); "
                                     "stopping (lower --lr)")
            losses.append(global_loss)
            norms.append(float(norm))
            metrics.append(m)
        out = {"loss": _mean(losses), "grad_norm": _mean(norms), "skipped_updates": skipped,
               "optimizer_steps": len(losses), **blame}
        if not metrics:
            return out
        # token-weighted over the updates and the ranks; extremes over both
        weighted = [k for k in ("clip_fraction", "masked_fraction", "r_mean", "rho_mean", "kl_ref",
                                "load_balancing")
                    if k in metrics[0]]
        sums = all_reduce_floats(
            [sum(float(m["tokens"]) for m in metrics)] +
            [sum(float(m[k]) * float(m["tokens"]) for m in metrics) for k in weighted],
            device=self.device)
        out.update({k: v / max(sums[0], 1.0) for k, v in zip(weighted, sums[1:])})
        for keys, pick, op in ((("r_min", "rho_min"), min, "min"), (("r_max", "rho_max"), max, "max")):
            keys = [k for k in keys if k in metrics[0]]
            values = all_reduce_floats([pick(float(m[k]) for m in metrics) for k in keys],
                                       op=op, device=self.device)
            out.update(zip(keys, values))
        return out

    def _step_advantages(self, batch: TokenBatch) -> torch.Tensor | None:
        """With data parallel and a batch-wide advantage (``ppo``'s batch normalization,
        REINFORCE++'s whitening): the advantages of the whole step, from every rank's rewards and
        loss-token counts (gathered in rank order, group ids made distinct), this rank's part.
        None otherwise (``prepare`` computes them); a batch-wide token-level advantage is
        refused."""
        part = self.est.advantage
        if self.world == 1 or part.group_local:
            return None
        if getattr(part, "token_level", False):
            raise ValueError(f"estimator {self.est.name!r}: the token-level advantage "
                             f"{part.describe()} has statistics over the whole step, which data "
                             f"parallelism (world size {self.world}) does not gather; train it "
                             "in one process")
        rewards = estimators.advantage_rewards(batch, self.est)
        lengths = batch.sequence_sum(batch.loss_mask.to(rewards.dtype))
        shares = all_gather_objects((rewards.cpu(), batch.group.cpu(), lengths.cpu()))
        offsets = np.cumsum([0] + [int(g.max()) + 1 if g.numel() else 0 for _, g, _ in shares])
        all_rewards = torch.cat([r for r, _, _ in shares]).to(self.device)
        all_groups = torch.cat([g + int(o) for (_, g, _), o in zip(shares, offsets)]).to(
            self.device)
        all_lengths = torch.cat([n for _, _, n in shares]).to(self.device)
        start = sum(len(r) for r, _, _ in shares[:self.rank])
        return part.per_sequence(all_rewards, all_groups, all_lengths)[start:start + len(rewards)]

    @torch.no_grad()
    def evaluate(self) -> float:
        """Fraction of held-out prompts answered correctly (near-greedy sampling; the held-out
        set is split over the ranks)."""
        self.engine.sync(self.model)
        share = self.eval_set[self.rank::self.world]
        gen = torch.Generator(device=self.device).manual_seed(
            self.cfg.eval_seed + self.step + 7919 * self.rank)
        batch = self.engine.generate([self.tok.encode(ex.prompt) for ex in share],
                                     max_new_tokens=self.cfg.max_new_tokens, eos_id=self.tok.EOS,
                                     generator=gen, temperature=self.cfg.eval_temperature,
                                     dtype=self.dtype)
        correct = sum(self.task.is_correct(ex, r) for ex, (_, r) in zip(share, batch.sequences()))
        correct, total = all_reduce_floats([correct, len(share)], device=self.device)
        return correct / total


def _mean(values: list[float]) -> float | None:
    """Mean, or None (JSON null) when every update of the step was skipped."""
    return float(np.mean(values)) if values else None
