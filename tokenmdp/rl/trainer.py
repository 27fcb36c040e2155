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
   its own counts (:mod:`tokenmdp.rl.update`); the advantages of step 5 are kept. Updates
   ``2..N`` are off-policy: ``π_θ ≠ π_old``, which the estimator's ratio and clip handle;
7. metrics (one JSON line per step in ``out_dir/metrics.jsonl``, TensorBoard scalars when
   ``tensorboard`` is installed, a progress line on a terminal: :class:`~tokenmdp.rl.logger.RunLogger`)
   and, every ``eval_every`` steps, the held-out accuracy; ``tokenmdp plot RUN_DIR`` draws them.

SFT (``mode="sft"``) is the same loop with demonstrations (the task's correct answers) in place
of steps 1-4, ``A = 1`` and a REINFORCE surrogate with token-mean aggregation: the loss is the
mean NLL of the answer tokens.

An update with a non-finite loss or gradient is skipped with a logged warning; after
``max_nonfinite`` in a row the run stops (:class:`NonFiniteError`). So does a run whose weights
become non-finite after an update, or whose sampling distributions do (a diverging run: it
stops, it does not crash). A checkpoint (model, reference, optimizer, RNG states, step) is
written atomically and durably (:mod:`tokenmdp.rl.checkpoint`); ``resume=True`` continues from
it and, on the CPU with deterministic algorithms, repeats an uninterrupted run's metrics exactly
(except :data:`TIMING_FIELDS`). The run's folder is claimed before any work and locked while the
run lasts (:mod:`tokenmdp.rl.run_folder`): a used folder needs ``resume`` or ``overwrite``.

Scale-out (data parallel)::

    torchrun --nproc_per_node=N -m tokenmdp.rl.trainer --task addition --estimator minirl ...

Under ``torchrun`` (``WORLD_SIZE > 1``) :func:`train` joins the process group (gloo on the CPU,
NCCL on CUDA, ``cuda:LOCAL_RANK``) and wraps the model in DDP. ``prompts_per_step`` is the
*global* step: every rank draws the same prompts (one seed) and takes its contiguous
``1/N`` share, so a step holds the prompts of a single-process step and groups never span
ranks. Each rank runs its own rollout engine (sampling seed ``seed + rank``), ``old_logprob``
pass and mini-batch split; the loss weights of every update come from counts all-reduced over
the ranks (:func:`~tokenmdp.distributed.global_counts`) and each rank's loss is multiplied by
:func:`~tokenmdp.distributed.data_parallel_loss_scale`, so after DDP's gradient all-reduce
every rank holds the gradient of the global mini-batch (``tests/rl/test_trainer_ddp.py``
checks it against the single-process update). The one exception is the optional
load-balancing term (``load_balancing_coef``): each rank's is over its own tokens, and the
ranks' mean is used. Metrics are reduced over the ranks as sums of
numerators and denominators; rank 0 writes them and the checkpoint (which holds every rank's
RNG states); the held-out set is split over the ranks. Estimators whose advantage normalizes
over the whole batch (``ppo``: :class:`~tokenmdp.estimators.BatchNormalized`) get them from
every rank's rewards (gathered), so they equal the single-process ones. FSDP is not used: the
model is a few hundred thousand parameters, which every rank holds whole.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from tokenmdp import estimators
from tokenmdp.batch import TokenBatch
from tokenmdp.distributed import (
    all_gather_objects,
    all_reduce_floats,
    data_parallel_loss_scale,
    rank_and_world_size,
)
from tokenmdp.estimators import Aggregation, Estimator, KLPenalty, Reinforce, RewardAsAdvantage
from tokenmdp.model import ModelConfig, MoETransformer
from tokenmdp.packing import pack_first_fit_decreasing
from tokenmdp.rl.checkpoint import (
    CHECKPOINT,
    check_model_config,
    load_checkpoint,
    save_checkpoint,
)
from tokenmdp.rl.config import DTYPES, TrainConfig, check_config
from tokenmdp.rl.logger import RunLogger
from tokenmdp.rl.options import add_config_arguments, config_from_args
from tokenmdp.rl.rollout import (
    ENGINE_ROUTING,
    OLD_ROUTING,
    RolloutEngine,
    RoutingReplay,
    compute_old_logprobs,
    routing_mismatch_counts,
    training_inference_kl,
)
from tokenmdp.rl.run_folder import RunLock, check_run_folder
from tokenmdp.rl.tasks import CharTokenizer, Task, get_task
from tokenmdp.rl.update import (
    TrainingPass,
    minibatch_loss,
    prepare_minibatch,
    split_minibatches,
)

__all__ = ["SFT_ESTIMATOR", "TIMING_FIELDS", "NonFiniteError", "TrainingPass", "build_estimator",
           "build_model", "load_init", "main", "minibatch_loss", "model_config",
           "prepare_minibatch", "run_and_report", "split_minibatches", "train"]

log = logging.getLogger(__name__)

TIMING_FIELDS = ("time_s", "tokens_per_s")
"""Metrics that measure wall time (the only ones a resumed run may change)."""

SFT_ESTIMATOR = Estimator(name="sft", surrogate=Reinforce(), advantage=RewardAsAdvantage(),
                          aggregation=Aggregation.TOKEN_MEAN)
"""SFT as an estimator: ``A = R = 1``, weighted NLL, mean over the step's answer tokens."""

_RESUMABLE = ("steps", "resume", "overwrite", "eval_every", "checkpoint_every", "out_dir")
"""Settings a resumed run may change without a warning."""


class NonFiniteError(RuntimeError):
    """Raised after ``max_nonfinite`` updates in a row had a non-finite loss or gradient, or when
    the weights or the sampling distributions became non-finite (a diverging run)."""


_NONFINITE_SAMPLING = "probability tensor contains"
"""How ``torch.multinomial`` reports inf/NaN probabilities (a diverged model)."""


@contextlib.contextmanager
def _sampling_guard(step: int, what: str):
    """Turn ``torch.multinomial``'s error on non-finite probabilities into :class:`NonFiniteError`."""
    try:
        yield
    except RuntimeError as err:
        if _NONFINITE_SAMPLING not in str(err):
            raise
        raise NonFiniteError(f"step {step}: the {what} sampling distribution is not finite (the "
                             "model diverged; lower --lr)") from None


# ---------------------------------------------------------------------------------- building
def model_config(cfg: TrainConfig, vocab_size: int) -> ModelConfig:
    """The :class:`~tokenmdp.model.ModelConfig` of ``cfg`` for a vocabulary of ``vocab_size``."""
    # TrainConfig repeats the ModelConfig fields it exposes (flat, one command-line option each)
    shared = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(ModelConfig)
              if hasattr(cfg, f.name)}
    return ModelConfig(vocab_size=vocab_size, **shared)


def load_init(cfg: TrainConfig, device: torch.device | str = "cpu") -> dict:
    """The ``cfg.init`` checkpoint, checked to hold a model of ``cfg``'s shape.

    Raises
    ------
    ValueError
        ``init``: unreadable, not a trainer checkpoint, or a model of another shape.
    """
    state = load_checkpoint(cfg.init, option="init", device=device)
    vocab = get_task(cfg.task).tokenizer.vocab_size
    check_model_config(state, dataclasses.asdict(model_config(cfg, vocab)), option="init",
                       path=cfg.init)
    return state


def build_model(cfg: TrainConfig, vocab_size: int, device: torch.device | str | None = None
                ) -> MoETransformer:
    """The MoE transformer of ``cfg``, initialized from ``cfg.seed`` on ``device`` (default
    ``cfg.device``)."""
    mc = model_config(cfg, vocab_size)
    return MoETransformer(mc, generator=torch.Generator().manual_seed(cfg.seed),
                          device=cfg.device if device is None else device, dtype=DTYPES[cfg.dtype])


def build_estimator(cfg: TrainConfig) -> Estimator:
    """The registry estimator (rl) with ``kl_coef`` applied (k3 in the loss), or SFT's."""
    if cfg.mode == "sft":
        return SFT_ESTIMATOR
    est = estimators.get(cfg.estimator)
    if cfg.kl_coef is not None:
        est = est.replace(kl=KLPenalty(coef=cfg.kl_coef, in_reward=False) if cfg.kl_coef > 0
                          else None)
    return est


# ---------------------------------------------------------------------------------- the run
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
            self.model.load_state_dict(state["model"])
        self.reference = MoETransformer(self.model.config, generator=torch.Generator(),
                                        device=self.device, dtype=self.dtype)
        self.reference.load_state_dict(self.model.state_dict())
        self.reference.requires_grad_(False)
        # the training pass: through DDP when data parallel (rollout, old_logprob and
        # evaluation passes use self.model directly: no gradient, nothing to synchronize)
        self.trained: torch.nn.Module = self.model
        if self.world > 1:  # experts are stacked parameters: every one is used in every pass
            self.trained = DistributedDataParallel(TrainingPass(self.model))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr,
                                           betas=(cfg.beta1, cfg.beta2),
                                           weight_decay=cfg.weight_decay)
        self.engine = RolloutEngine(self.model, precision=cfg.rollout_precision)
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
        changed = sorted(k for k, v in dataclasses.asdict(self.cfg).items()
                         if k not in _RESUMABLE and state["config"].get(k, defaults[k]) != v)
        if changed and self.rank == 0:
            log.warning("resuming %s with changed settings: %s", path, ", ".join(changed))
        self.model.load_state_dict(state["model"])
        self.reference.load_state_dict(state["reference"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step, self.nonfinite_run = state["step"], state["nonfinite_run"]
        rng = state["rng"][self.rank]
        self.rng.bit_generator.state = rng["numpy_rng"]
        self.sample_gen.set_state(rng["sample_gen"])
        self.shuffle_gen.set_state(rng["shuffle_gen"].cpu())

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
        batch = pack_first_fit_decreasing(batch.replace(reward=reward_S), self.capacity)
        # log π_old, the routing used and π_old's entropy at the sampled states: one pass
        batch, ent_RC = compute_old_logprobs(self.model, batch, self.replay, entropy=True)
        if self.est.kl is not None:
            with torch.no_grad():
                ref_RC = self.reference.token_logprobs(batch)
            batch = batch.replace(ref_logprob=ref_RC.to(self.dtype))
        mask = batch.loss_mask
        tokens = float(mask.sum())
        mismatch, routed = routing_mismatch_counts(batch.token_extras[ENGINE_ROUTING],
                                                   batch.token_extras[OLD_ROUTING])
        reward = reward_S.double()
        # sums over this rank, reduced over the ranks, then divided: step-wide ratios
        sums = dict(seqs=len(responses), reward=float(reward.sum()),
                    reward_sq=float((reward ** 2).sum()), correct=float(sum(correct)),
                    length=float(batch.length.double().sum()), tokens=tokens,
                    entropy=float(ent_RC[mask].double().sum()),
                    kl_k1=training_inference_kl(batch, kind="k1") * tokens,
                    kl_k3=training_inference_kl(batch, kind="k3") * tokens,
                    mismatch=mismatch, routed=routed)
        g = dict(zip(sums, all_reduce_floats(list(sums.values()), device=self.device)))
        n, t = g["seqs"], max(g["tokens"], 1.0)
        mean_reward = g["reward"] / n
        stats = {"reward": mean_reward,
                 "reward_std": math.sqrt(max(g["reward_sq"] / n - mean_reward ** 2, 0.0)),
                 "train_accuracy": g["correct"] / n, "response_length": g["length"] / n,
                 "entropy": g["entropy"] / t, "train_infer_kl_k1": g["kl_k1"] / t,
                 "train_infer_kl_k3": g["kl_k3"] / t,
                 "routing_mismatch": g["mismatch"] / g["routed"] if g["routed"] else 0.0}
        return batch, stats

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
        ``minibatches`` optimizer updates. Returns the step's update metrics (over all ranks)."""
        cfg, params = self.cfg, list(self.model.parameters())
        batch = estimators.prepare(batch, self.est, max_len=cfg.max_new_tokens,
                                   advantage_S=self._step_advantages(batch))
        parts = split_minibatches(batch, cfg.minibatches, generator=self.shuffle_gen,
                                  capacity=self.capacity)
        scale = data_parallel_loss_scale()
        losses, norms, metrics, skipped = [], [], [], 0
        for part in parts:
            part = prepare_minibatch(part, self.est, max_len=cfg.max_new_tokens)
            self.optimizer.zero_grad(set_to_none=True)
            loss, m = minibatch_loss(self.trained, part, self.est, self.replay,
                                     load_balancing_coef=cfg.load_balancing_coef,
                                     world_size=self.world)
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
        out = {"loss": _mean(losses), "grad_norm": _mean(norms), "skipped_updates": skipped}
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
        """With data parallel and a batch-wide advantage (``ppo``'s batch normalization): the
        advantages of the whole step, from every rank's rewards (gathered in rank order, group
        ids made distinct), this rank's part. None otherwise (``prepare`` computes them)."""
        if self.world == 1 or self.est.advantage.group_local:
            return None
        rewards = estimators.advantage_rewards(batch, self.est)
        shares = all_gather_objects((rewards.cpu(), batch.group.cpu()))
        offsets = np.cumsum([0] + [int(g.max()) + 1 if g.numel() else 0 for _, g in shares])
        all_rewards = torch.cat([r for r, _ in shares]).to(self.device)
        all_groups = torch.cat([g + int(o) for (_, g), o in zip(shares, offsets)]).to(self.device)
        start = sum(len(r) for r, _ in shares[:self.rank])
        return self.est.advantage(all_rewards, all_groups)[start:start + len(rewards)]

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


@contextlib.contextmanager
def _process_group(cfg: TrainConfig):
    """Join the process group ``torchrun`` describes (``WORLD_SIZE > 1`` in the environment)
    unless one is already initialized; yield this rank's device; leave the group at the end
    if it was joined here."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    device = torch.device(cfg.device)
    joined = False
    if world > 1 and not (dist.is_available() and dist.is_initialized()):
        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        joined = True
    try:
        yield device
        if joined:  # every rank done before any leaves: gloo aborts a rank whose peer hung up
            dist.barrier()
    finally:
        if joined:
            dist.destroy_process_group()


def train(cfg: TrainConfig) -> list[dict]:
    """Run ``cfg`` (RL or SFT, see the module docstring) and return this call's metrics rows.

    Writes ``out_dir/metrics.jsonl`` (one JSON object per step: ``step`` 0-based, ``lr``,
    the step statistics, ``eval_accuracy`` at evaluation steps) and ``out_dir/checkpoint.pt``.
    Under ``torchrun`` every rank returns the same rows (reduced over the ranks) and rank 0
    writes the files.

    Raises
    ------
    ValueError
        On a bad configuration (:func:`~tokenmdp.rl.config.check_config`), an unreadable
        ``init`` checkpoint or an unusable ``out_dir`` (:func:`~tokenmdp.rl.run_folder.check_run_folder`),
        before any work; on a checkpoint that cannot be written.
    NonFiniteError
        After ``max_nonfinite`` consecutive non-finite updates, or when the weights or the
        sampling distributions become non-finite.
    """
    check_config(cfg, world_size=int(os.environ.get("WORLD_SIZE", "1")))
    out = Path(cfg.out_dir)
    ckpt = out / CHECKPOINT
    init_state = load_init(cfg) if cfg.init is not None else None
    check_run_folder(out, resume=cfg.resume, overwrite=cfg.overwrite)  # every rank, read-only
    lead_process = int(os.environ.get("RANK", "0")) == 0
    lock = RunLock(out, overwrite=cfg.overwrite) if lead_process else contextlib.nullcontext()
    rows = []
    with lock, _process_group(cfg) as device, _deterministic(cfg.deterministic):
        run = _Run(cfg, device, init_state=init_state)
        lead = run.rank == 0
        if cfg.resume:
            run.load(ckpt)
            if lead:
                log.info("resumed from %s at step %d", ckpt, run.step)
        # rank 0 writes metrics.jsonl (dropping lines after the checkpoint), TensorBoard, progress
        with RunLogger(out, total_steps=cfg.steps, start_step=run.step if cfg.resume else 0,
                       enabled=lead) as logger:
            while run.step < cfg.steps:
                t0 = time.perf_counter()
                lr = cfg.lr * (min(1.0, (run.step + 1) / cfg.warmup_steps) if cfg.warmup_steps
                               else 1.0)
                for group in run.optimizer.param_groups:
                    group["lr"] = lr
                if cfg.mode == "rl":
                    with _sampling_guard(run.step, "rollout"):
                        batch, stats = run.rollout()
                else:
                    batch, stats = run.demonstrations()
                (tokens,) = all_reduce_floats([batch.num_real_tokens], device=run.device)
                row = {"step": run.step, "lr": lr, **stats, **run.updates(batch),
                       "tokens": int(tokens)}
                last = run.step == cfg.steps - 1
                run.step += 1
                if last or (cfg.eval_every and run.step % cfg.eval_every == 0):
                    with _sampling_guard(run.step - 1, "evaluation"):
                        row["eval_accuracy"] = run.evaluate()
                row["time_s"] = time.perf_counter() - t0
                row["tokens_per_s"] = row["tokens"] / max(row["time_s"], 1e-9)
                logger.log(row)
                rows.append(row)
                if last or (cfg.checkpoint_every and run.step % cfg.checkpoint_every == 0):
                    run.save(ckpt)
    return rows


def run_and_report(cfg: TrainConfig) -> int:
    """Run ``cfg`` and print a one-line summary (on rank 0 only, under ``torchrun``); 0."""
    rows = train(cfg)
    if rows and int(os.environ.get("RANK", "0")) == 0:  # the process group is gone by now
        last = rows[-1]
        shown = {k: last[k] for k in ("step", "reward", "loss", "eval_accuracy") if k in last}
        print(f"{cfg.mode}: {len(rows)} steps, last {shown}; wrote {cfg.out_dir}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m tokenmdp.rl.trainer [--mode rl|sft] [options]``: one run, the entry point for
    ``torchrun --nproc_per_node=N -m tokenmdp.rl.trainer ...`` (the options of ``tokenmdp
    train``, plus ``--mode``)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m tokenmdp.rl.trainer",
                                     description="One training run (RL or SFT); under torchrun, "
                                                 "data parallel over the ranks.")
    add_config_arguments(parser, skip=())
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        return run_and_report(config_from_args(args, args.mode))
    except (ValueError, NonFiniteError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1 if isinstance(err, NonFiniteError) else 2

if __name__ == "__main__":
    sys.exit(main())
