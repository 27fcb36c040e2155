"""The packed-batch trainer: RL (rollout → reward → estimator updates) and SFT, one loop.

One RL step (``mode="rl"``), reading order of :func:`train`:

1. the rollout engine (synced from the model, in its own precision) samples ``G`` responses for
   each of ``prompts_per_step`` training prompts, recording ``log μ`` and its routing;
2. the task scores every response exactly (``reward``);
3. the batch is packed (first-fit decreasing, rows of ``max prompt + max_new_tokens``);
4. the ``old_logprob`` pass records the training engine's routing (R2) or replays the engine's
   (R3) (:func:`~tokenmdp.rl.mismatch.compute_old_logprobs`); ``ref_logprob`` from the reference
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

RL from an SFT checkpoint (``init``) need not start cold (the guide *An RL recipe that does not
start cold*): ``warmup_steps`` warms the learning rate up in RL as in SFT, ``optimizer_state``
resets the optimizer's moments or carries the checkpoint's (``optimizer``: AdamW or SGD), and
``zero_variance_groups`` keeps or skips the groups whose rewards are all equal (zero advantage),
whose fraction every step logs (``frac_reward_zero_std``); a step whose every group is skipped
takes no optimizer update.

An update with a non-finite loss or gradient is skipped with a logged warning; after
``max_nonfinite`` in a row the run stops (:class:`NonFiniteError`). So does a run whose weights
become non-finite after an update, or whose sampling distributions do (a diverging run: it
stops, it does not crash). A checkpoint (model, reference, optimizer, RNG states, step) is
written atomically and durably (:mod:`tokenmdp.rl.checkpoint`); ``resume=True`` continues from
it and, on the CPU with deterministic algorithms, repeats an uninterrupted run's metrics exactly
(except :data:`TIMING_FIELDS`). The run's folder is claimed before any work and locked while the
run lasts (:mod:`tokenmdp.rl.run_folder`): a used folder needs ``resume`` or ``overwrite``.

Where the parts live: :mod:`tokenmdp.rl.run_setup` builds the model, the estimator and the
``init`` checkpoint; :mod:`tokenmdp.rl.run_state` holds the state a run carries from step to
step and one step's work (rollout or demonstrations, the updates, the evaluation, the
checkpoint); this module runs the loop (:func:`train`), joins the process group and holds the
entry points (:func:`run_and_report`, :func:`main`). Their public names are re-exported here.

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
import gc
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from tokenmdp.distributed import all_reduce_floats
from tokenmdp.rl.checkpoint import CHECKPOINT
from tokenmdp.rl.config import TrainConfig, check_config
from tokenmdp.rl.logger import RunLogger
from tokenmdp.rl.options import add_config_arguments, config_from_args
from tokenmdp.rl.run_folder import RunLock, check_run_folder
from tokenmdp.rl.run_setup import (
    SFT_ESTIMATOR,
    load_init,
)
from tokenmdp.rl.run_state import (
    INTERRUPTED_NOW,
    INTERRUPTED_STATUS,
    NonFiniteError,
    RunInterrupted,
    _Run,
)
from tokenmdp.rl.tree_step import tree_rollout_step
from tokenmdp.rl.update import TrainingPass

__all__ = ["SFT_ESTIMATOR", "TIMING_FIELDS", "main", "run_and_report", "train"]

log = logging.getLogger(__name__)

TIMING_FIELDS = ("time_s", "tokens_per_s", "generated_tokens_per_s")
"""Metrics that measure wall time (the only ones a resumed run may change)."""

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


@contextlib.contextmanager
def _released(run: _Run):
    """Yield ``run``; at the end drop its DDP wrapper and collect garbage, so that the wrapper's
    hold on the process group is gone before the group is destroyed (a group freed only at
    interpreter exit tears its gloo threads down in no defined order)."""
    try:
        yield run
    finally:
        run.trained = run.model
        gc.collect()


class _Interrupt:
    """Ctrl-C (SIGINT) once: the run stops at the next step boundary with its checkpoint
    written; twice: now (``KeyboardInterrupt``). Only the main thread can take signals; elsewhere
    SIGINT keeps its default."""

    def __init__(self) -> None:
        self.requested = False
        self._previous = None

    def __enter__(self) -> _Interrupt:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True       # the run says so in one line when it has stopped

    def agreed(self, device) -> bool:
        """Whether any rank was interrupted (one small all-reduce under ``torchrun``, so every
        rank stops at the same step and the checkpoint's collective is not left waiting)."""
        if not dist.is_initialized():
            return self.requested
        (count,) = all_reduce_floats([float(self.requested)], device=device)
        return count > 0

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)


def _set_tree_forward(run: _Run) -> None:
    """The training pass of a tree run: packed (each node once) or expanded (every path)."""
    if run.cfg.rollout_tree == "none":
        return
    target = getattr(run.trained, "module", run.trained)    # under DDP, the module it wraps
    if isinstance(target, TrainingPass):
        target.tree_forward = run.cfg.tree_forward
    else:
        run.trained = TrainingPass(run.model, tree_forward=run.cfg.tree_forward)


def train(cfg: TrainConfig) -> list[dict]:
    """Run ``cfg`` (RL or SFT, see the module docstring) and return this call's metrics rows.

    Writes ``out_dir/metrics.jsonl`` (one JSON object per step: ``step`` 0-based, ``lr``,
    the step statistics, ``eval_accuracy`` at evaluation steps) and ``out_dir/checkpoint.pt``.
    Under ``torchrun`` every rank returns the same rows (reduced over the ranks) and rank 0
    writes the files.

    Parameters
    ----------
    cfg : TrainConfig
        The run: mode, task, estimator, model, optimizer, step counts, ``out_dir``, ``init``,
        ``resume`` / ``overwrite`` (every option is documented on
        :class:`~tokenmdp.rl.config.TrainConfig`).

    Returns
    -------
    list of dict
        One metrics row per step run by this call (the rows of ``metrics.jsonl``; a resumed
        run returns the steps after the checkpoint only).

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
    with lock, _process_group(cfg) as device, _deterministic(cfg.deterministic), \
            _released(_Run(cfg, device, init_state=init_state)) as run, _Interrupt() as interrupt:
        lead = run.rank == 0
        _set_tree_forward(run)
        if cfg.resume:
            run.load(ckpt)
            if run.step > cfg.steps:          # == cfg.steps: a finished run, nothing to do
                raise ValueError(f"--steps: {ckpt} is at step {run.step}, past --steps "
                                 f"{cfg.steps}: nothing to run (pass --steps > {run.step})")
            if lead:
                log.info("resumed from %s at step %d", ckpt, run.step)
        # rank 0 writes metrics.jsonl (dropping lines after the checkpoint), TensorBoard, progress
        with RunLogger(out, total_steps=cfg.steps, start_step=run.step if cfg.resume else 0,
                       enabled=lead) as logger:
            while run.step < cfg.steps:
                if interrupt.agreed(run.device):        # Ctrl-C: stop at this step boundary
                    run.save(ckpt)
                    raise RunInterrupted(f"interrupted at step {run.step} of {cfg.steps}: wrote "
                                         f"{ckpt}; continue with --resume")
                t0 = time.perf_counter()
                lr = cfg.lr * (min(1.0, (run.step + 1) / cfg.warmup_steps) if cfg.warmup_steps
                               else 1.0)
                for group in run.optimizer.param_groups:
                    group["lr"] = lr
                if cfg.mode == "rl":
                    with _sampling_guard(run.step, "rollout"):
                        batch, stats = (run.rollout() if cfg.rollout_tree == "none"
                                        else tree_rollout_step(run))
                else:
                    batch, stats = run.demonstrations()
                (tokens,) = all_reduce_floats([batch.num_real_tokens], device=run.device)
                updates = (run.updates(batch) if tokens > 0 else  # a tree step of none
                           {"loss": None, "grad_norm": None, "skipped_updates": 0,
                            "optimizer_steps": 0})
                row = {"step": run.step, "lr": lr, **stats, **updates, "tokens": int(tokens)}
                last = run.step == cfg.steps - 1
                run.step += 1
                if last or (cfg.eval_every and run.step % cfg.eval_every == 0):
                    with _sampling_guard(run.step - 1, "evaluation"):
                        row["eval_accuracy"] = run.evaluate()
                row["time_s"] = time.perf_counter() - t0
                row["tokens_per_s"] = row["tokens"] / max(row["time_s"], 1e-9)
                if "generated_tokens" in row:       # a tree step: what the engine sampled
                    row["generated_tokens_per_s"] = row["generated_tokens"] / max(row["time_s"],
                                                                                  1e-9)
                logger.log(row)
                rows.append(row)
                if last or (cfg.checkpoint_every and run.step % cfg.checkpoint_every == 0):
                    run.save(ckpt)
    return rows


def run_and_report(cfg: TrainConfig) -> int:
    """Run ``cfg`` and print a one-line summary (on rank 0 only, under ``torchrun``); 0.

    Parameters
    ----------
    cfg : TrainConfig
        The run (:func:`train`).

    Returns
    -------
    int
        0, the exit status (errors propagate as exceptions: :func:`main` turns them into one line).
    """
    rows = train(cfg)
    if int(os.environ.get("RANK", "0")) != 0:  # the process group is gone by now
        return 0
    if rows:
        last = rows[-1]
        shown = {k: last[k] for k in ("step", "reward", "loss", "eval_accuracy") if k in last}
        print(f"{cfg.mode}: {len(rows)} steps, last {shown}; wrote {cfg.out_dir}")
    else:                                      # resumed at its last step: a finished run
        print(f"{cfg.mode}: nothing to run: {cfg.out_dir} is at step {cfg.steps} of "
              f"{cfg.steps} already (raise --steps to continue it)")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m tokenmdp.rl.trainer [--mode rl|sft] [options]``: one run, the entry point for
    ``torchrun --nproc_per_node=N -m tokenmdp.rl.trainer ...`` (the options of ``tokenmdp
    train``, plus ``--mode``).

    Parameters
    ----------
    argv : list of str, optional
        The command-line arguments (default: ``sys.argv[1:]``).

    Returns
    -------
    int
        The exit status: 0 on success, 2 on a bad configuration (one line on stderr; argparse
        itself exits with 2 on a malformed option), 1 when the run stopped on non-finite values
        (:class:`NonFiniteError`), :data:`~tokenmdp.rl.run_state.INTERRUPTED_STATUS` on Ctrl-C.
    """
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
    except RunInterrupted as err:
        print(f"stopped: {err}", file=sys.stderr)
        return INTERRUPTED_STATUS
    except KeyboardInterrupt:
        print(f"stopped: {INTERRUPTED_NOW}", file=sys.stderr)
        return INTERRUPTED_STATUS


if __name__ == "__main__":
    sys.exit(main())
