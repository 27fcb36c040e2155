"""The trainer's configuration: one dataclass, every field documented, checked at start.

:class:`TrainConfig` configures both loops of :mod:`tokenmdp.rl.trainer` (``mode`` "rl" or
"sft"); :func:`check_config` rejects a bad configuration before any work with a ``ValueError``
naming the field; :func:`field_docs` reads the fields' descriptions (the command line's help text,
:mod:`tokenmdp.rl.cli_commands`).
"""

from __future__ import annotations

import dataclasses
import inspect
import math

import torch

__all__ = ["TrainConfig", "check_config", "field_docs"]

MODES = ("rl", "sft")
OPTIMIZERS = ("adamw", "sgd")
OPTIMIZER_STATES = ("reset", "carry")
ZERO_VARIANCE_GROUPS = ("keep", "skip")
DTYPES = {"float32": torch.float32, "float64": torch.float64}


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything one training run needs; see :func:`tokenmdp.rl.trainer.train`.

    Each parameter's description below is also its option's help text in ``tokenmdp train`` and
    ``tokenmdp sft`` (read by :func:`field_docs`).

    Parameters
    ----------
    mode : str, default "rl"
        Loop: rl (rollout, reward, estimator updates) or sft (demonstrations, advantage 1).
    task : str, default "addition"
        Task name: addition, sorting, count, or the long-answer running_sum_L (L = 8, 16, 32,
        64, 128; :mod:`tokenmdp.rl.tasks`, :mod:`tokenmdp.rl.tasks`).
    estimator : str, default "dapo"
        Estimator registry name (``tokenmdp estimators`` lists them); ignored by sft.
    replay : str, default "none"
        MoE routing replay of the training passes: none, r2 (old-logprob pass's routing) or r3 (the
        rollout engine's routing).
    rollout_precision : str, default "fp32"
        Numerics of the rollout engine (the numeric mismatch mode): fp32, bf16, fp16, or fp32
        compute on simulated low-precision numbers: fp8 (e4m3 weights), fp8_w8a8 (e4m3 weights
        and activations, as fp8 inference engines) or fp4 (e2m1 weights in blocks of 32).
    rollout_logit_noise : float, default 0.0
        Engine-mismatch dial, fresh mode: standard deviation of Gaussian noise drawn anew at every
        sampled token and added to the rollout engine's logits (``RolloutEngine(logit_noise=...)``,
        the same as --rollout-mismatch fresh with this scale; 0: none). Real engines do not do
        this: their logits are a function of the prefix (see --rollout-mismatch).
    rollout_mismatch : str, default "none"
        Engine mismatch mode of the rollout engine (``tokenmdp.exact.EngineMismatch``): none;
        fixed (a Gaussian logit offset that is a function of the context and the token, the same
        at every visit); heavy (an offset of plus or minus the scale on a share fraction of the
        (context, token) pairs: rare large deviations); growing (relative noise scale times
        abs(logit - mean logit), which grows as the policy sharpens); fresh (new noise at every
        step, as --rollout-logit-noise, which engines do not do). The numeric mode is
        --rollout-precision.
    rollout_mismatch_scale : float, default 0.0
        Size of the engine mismatch mode: standard deviation (fixed, fresh), offset (heavy) or
        relative standard deviation (growing); > 0 with a mode, 0 without.
    rollout_mismatch_fraction : float, default 1.0
        Share in (0, 1] of the (context, token) pairs that the fixed, heavy and growing modes
        perturb (only 1 for none and fresh).
    rollout_mismatch_seed : int, default 0
        Seed of the fixed, heavy and growing modes' pattern, in [0, 2^31 - 1): runs that keep it
        sample from the same engine.
    rollout_tree : str, default "none"
        Branching rollouts: none (group_size independent responses per prompt) or one tree per
        prompt whose leaves are its group: fixed:DxB[,DxB...] (every live branch forks into B
        after D response tokens, D = 0 at the prompt: fixed:2x2,4x2 has 4 leaves) or
        entropy:NxT[,NxT...] (one chain, then per round T new children at each of the N prefix
        states of highest engine entropy: 1 + sum N*T leaves). group_size must equal the leaves;
        a branch that ends before a fork does not fork.
    tree_forward : str, default "packed"
        With a rollout tree, how the old-logprob, reference and training passes run: packed
        (each tree node computed once, tree attention) or expanded (every root-to-leaf path
        whole); the loss is the same either way.
    minibatches : int, default 1
        Mini-batch updates per step (N >= 1); each is its own optimizer step, so N > 1 makes updates
        2..N off-policy.
    group_size : int, default 4
        Responses sampled per prompt (G).
    prompts_per_step : int, default 8
        Prompts per step (rl: each answered G times; sft: demonstrations per step).
    max_new_tokens : int, default 6
        Longest response the engine samples (L_max of the aggregation).
    temperature : float, default 1.0
        Sampling temperature of the rollout engine.
    optimizer : str, default "adamw"
        adamw (``torch.optim.AdamW``: an update of about lr per parameter, whatever the gradient's
        scale) or sgd (``torch.optim.SGD``, momentum beta1, L2 weight decay: the update is lr
        times the gradient, so a loss's scale is its step size; 0 grad_clip to keep it so).
    lr : float, default 1e-3
        Peak learning rate.
    beta1 : float, default 0.9
        AdamW beta1 (SGD's momentum).
    beta2 : float, default 0.99
        AdamW beta2 (unused by SGD).
    weight_decay : float, default 0.0
        Weight decay (decoupled in AdamW).
    grad_clip : float, default 1.0
        Clip the gradient norm to this value before each update (0 disables clipping).
    warmup_steps : int, default 0
        Steps of linear learning-rate warm-up, in RL as in SFT (step s uses lr * min(1, (s + 1) /
        warmup); counted from the run's step 0, so an RL run from an SFT checkpoint warms up
        again).
    optimizer_state : str, default "reset"
        The optimizer's state at the start of a run from ``init``: reset (a fresh optimizer, zero
        moments, as verl and TRL start RL) or carry (the init checkpoint's moments and step
        counts, e.g. SFT's, of the same optimizer; this run's lr, betas and weight decay). A
        resumed run continues its own state.
    zero_variance_groups : str, default "keep"
        RL groups whose rewards are all equal (all wrong, all right: zero advantage under a group
        baseline): keep (as TRL) or skip (as verl's filter_groups and DAPO's dynamic sampling,
        without resampling: their responses leave the step; a step left with none takes no
        optimizer update). Their fraction is logged either way (frac_reward_zero_std).
    kl_coef : float or None, default None
        KL-in-loss coefficient (k3) to the reference (the initial model); None keeps the estimator's
        own KL, 0 removes it.
    load_balancing_coef : float, default 0.0
        Coefficient of the MoE load-balancing loss added to every update's loss (Switch
        Transformer's auxiliary loss, Fedus et al. 2021, who use 0.01); 0 leaves it out (it is still
        logged as ``load_balancing``).
    steps : int, default 20
        Number of steps to run (the total, including resumed ones).
    eval_every : int, default 10
        Held-out accuracy every this many steps and at the last step (0: only at the last).
    eval_size : int, default 32
        Number of held-out evaluation prompts (training never draws them, so changing it also
        changes which training prompts a seed draws).
    eval_temperature : float, default 0.01
        Sampling temperature of the evaluation (near greedy).
    seed : int, default 0
        Seed of the model initialization, the training prompts and every sample.
    eval_seed : int, default 1234
        Seed of the held-out split (training prompts never come from it).
    device : str, default "cpu"
        Device of the model, the engine and every batch.
    dtype : str, default "float32"
        Floating-point dtype of the trained model and of the batches: float32 or float64.
    d_model : int, default 32
        Model width.
    n_layers : int, default 2
        Transformer blocks.
    n_heads : int, default 2
        Attention heads.
    n_experts : int, default 4
        Experts per MoE layer.
    top_k : int, default 2
        Experts per token.
    expert_hidden : int, default 32
        Hidden width of each expert (of the dense MLP with ``dense``).
    dense : bool, default False
        Dense MLPs instead of experts (no routing; r2 and r3 are rejected).
    init_std : float, default 0.02
        Standard deviation of the initial weights.
    init : str or None, default None
        Checkpoint whose model weights start the run (e.g. one written by ``tokenmdp sft``).
    out_dir : str, default "runs/train"
        Folder of ``metrics.jsonl`` and ``checkpoint.pt``.
    resume : bool, default False
        Continue from ``out_dir/checkpoint.pt`` (model, optimizer, RNG states, step); refused when
        there is no checkpoint there.
    overwrite : bool, default False
        Replace the run already in ``out_dir`` (without it, a non-empty ``out_dir`` is refused).
    checkpoint_every : int, default 10
        Write the checkpoint every this many steps and at the last (0: only at the last). Writing
        it every step cost about 9 percent of a small run's time; every 10 steps bounds the work lost
        to a crash to 9 steps, and a resumed run still repeats the uninterrupted one exactly
        (``1`` for a checkpoint after every step).
    max_nonfinite : int, default 3
        Stop after this many updates in a row with a non-finite loss or gradient (each skipped).
    deterministic : bool, default True
        Run under ``torch.use_deterministic_algorithms`` (resumed runs then repeat exactly).
    """

    mode: str = "rl"
    task: str = "addition"
    estimator: str = "dapo"
    replay: str = "none"
    rollout_precision: str = "fp32"
    rollout_logit_noise: float = 0.0
    rollout_mismatch: str = "none"
    rollout_mismatch_scale: float = 0.0
    rollout_mismatch_fraction: float = 1.0
    rollout_mismatch_seed: int = 0
    rollout_tree: str = "none"
    tree_forward: str = "packed"
    minibatches: int = 1
    group_size: int = 4
    prompts_per_step: int = 8
    max_new_tokens: int = 6
    temperature: float = 1.0
    optimizer: str = "adamw"
    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.99
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    warmup_steps: int = 0
    optimizer_state: str = "reset"
    zero_variance_groups: str = "keep"
    kl_coef: float | None = None
    load_balancing_coef: float = 0.0
    steps: int = 20
    eval_every: int = 10
    eval_size: int = 32
    eval_temperature: float = 0.01
    seed: int = 0
    eval_seed: int = 1234
    device: str = "cpu"
    dtype: str = "float32"
    d_model: int = 32
    n_layers: int = 2
    n_heads: int = 2
    n_experts: int = 4
    top_k: int = 2
    expert_hidden: int = 32
    dense: bool = False
    init_std: float = 0.02
    init: str | None = None
    out_dir: str = "runs/train"
    resume: bool = False
    overwrite: bool = False
    checkpoint_every: int = 10
    max_nonfinite: int = 3
    deterministic: bool = True


def field_docs(cls: type = TrainConfig) -> dict[str, str]:
    """Field name → its description in the ``Parameters`` section of the dataclass ``cls``'s
    docstring, whitespace folded.

    Returns
    -------
    dict of str to str
        One entry per documented field, in the section's order (the command line's help texts);
        empty when the docstring has no ``Parameters`` section (e.g. under ``python -OO``).
    """
    fields = {f.name for f in dataclasses.fields(cls)}
    lines = inspect.cleandoc(cls.__doc__ or "").splitlines()
    if "Parameters" not in lines:
        return {}
    docs: dict[str, list[str]] = {}
    name = None
    for line in lines[lines.index("Parameters") + 2:]:   # after the dashes
        if line and not line[0].isspace():               # "name : type", or the next section
            name = line.split(" : ")[0]
            if name not in fields:
                break
            docs[name] = []
        elif name is not None:
            docs[name].append(line)
    return {name: " ".join(" ".join(text).split()) for name, text in docs.items()}


def _device_supports(device: torch.device, precision: str) -> str | None:
    """Why ``device`` cannot run the engine at ``precision`` (None when it can)."""
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return "CUDA is not available"
        if precision == "bf16" and not torch.cuda.is_bf16_supported():
            return "this GPU has no bfloat16"
    if precision.startswith("fp8") and not hasattr(torch, "float8_e4m3fn"):
        return "this PyTorch build has no float8_e4m3fn"
    return None


def _check_rollout_mismatch(cfg: TrainConfig) -> None:
    """The ``rollout_mismatch*`` fields: an :class:`~tokenmdp.exact.EngineMismatch`, a scale
    with every mode (none without one), not together with ``rollout_logit_noise``."""
    from tokenmdp.exact.world.engine_mismatch import EngineMismatch

    mode, scale = cfg.rollout_mismatch, cfg.rollout_mismatch_scale
    if mode != "none" and cfg.rollout_logit_noise > 0:
        raise ValueError("rollout_logit_noise, rollout_mismatch: give one of them "
                         "(--rollout-logit-noise S is --rollout-mismatch fresh "
                         "--rollout-mismatch-scale S)")
    try:
        EngineMismatch(mode, scale, cfg.rollout_mismatch_fraction, cfg.rollout_mismatch_seed)
    except (TypeError, ValueError) as err:
        field, _, why = str(err).partition(": ")
        raise ValueError(f"rollout_mismatch{'' if field == 'mode' else '_' + field}: {why}"
                         ) from None
    if mode != "none" and not scale > 0:
        raise ValueError(f"rollout_mismatch_scale: mode {mode} needs a scale > 0, got {scale}")


def check_config(cfg: TrainConfig, *, world_size: int = 1) -> None:
    """Raise ``ValueError`` naming the field on a configuration that cannot run (on
    ``world_size`` data-parallel ranks): unknown names, sizes out of range, float options that
    are not finite numbers, negative seeds.

    Parameters
    ----------
    cfg : TrainConfig
        The configuration to check.
    world_size : int, default 1
        Data-parallel ranks it will run on (prompts and evaluation prompts must split over them).

    Raises
    ------
    ValueError
        Naming the field (or fields) at fault.
    """
    from tokenmdp import estimators
    from tokenmdp.rl.engine_numerics import PRECISIONS
    from tokenmdp.rl.mismatch import RoutingReplay
    from tokenmdp.rl.tasks import TASKS
    from tokenmdp.rl.tree_schedule import check_tree_config

    for f in dataclasses.fields(cfg):  # every float option: a finite number (NaN, inf rejected)
        value = getattr(cfg, f.name)
        if f.type in ("float", "float | None") and value is not None and not (
                isinstance(value, (int, float)) and not isinstance(value, bool)
                and math.isfinite(value)):
            raise ValueError(f"{f.name}: must be a finite number, got {value!r}")
    for name in ("seed", "eval_seed"):
        if getattr(cfg, name) < 0:
            raise ValueError(f"{name}: must be >= 0, got {getattr(cfg, name)}")
    for name in ("beta1", "beta2"):
        if not 0 <= getattr(cfg, name) < 1:
            raise ValueError(f"{name}: must be in [0, 1), got {getattr(cfg, name)}")
    for name in ("weight_decay", "init_std"):
        if getattr(cfg, name) < 0:
            raise ValueError(f"{name}: must be >= 0, got {getattr(cfg, name)}")
    for name, choices in (("mode", MODES), ("task", TASKS), ("optimizer", OPTIMIZERS),
                          ("optimizer_state", OPTIMIZER_STATES),
                          ("zero_variance_groups", ZERO_VARIANCE_GROUPS),
                          ("rollout_precision", PRECISIONS), ("dtype", DTYPES)):
        if getattr(cfg, name) not in choices:
            raise ValueError(f"{name}: expected one of {', '.join(choices)}, got "
                             f"{getattr(cfg, name)!r}")
    if cfg.mode == "rl" and cfg.estimator not in estimators.names(trees=None):
        raise ValueError(f"estimator: unknown {cfg.estimator!r}; known: "
                         f"{', '.join(estimators.names(trees=None))}")
    if cfg.replay not in [r.value for r in RoutingReplay]:
        raise ValueError(f"replay: expected none, r2 or r3, got {cfg.replay!r}")
    if cfg.replay != "none" and cfg.dense:
        raise ValueError(f"replay: {cfg.replay} replays MoE routing, but the model is dense "
                         "(--dense); use --replay none")
    if cfg.optimizer_state == "carry" and cfg.init is None:
        raise ValueError("optimizer_state: carry takes the optimizer state of the init "
                         "checkpoint; pass --init")
    if cfg.zero_variance_groups == "skip" and (cfg.mode != "rl" or cfg.group_size < 2):
        raise ValueError("zero_variance_groups: skip drops groups of equal rewards, which every "
                         "group is " + ("in sft (A = 1)" if cfg.mode != "rl" else
                                        "with group_size 1") + "; use keep")
    try:
        device = torch.device(cfg.device)
    except RuntimeError as err:
        raise ValueError(f"device: {err}") from None
    why = _device_supports(device, cfg.rollout_precision)
    if why is not None:
        raise ValueError(f"rollout_precision / device: {cfg.rollout_precision} on "
                         f"{cfg.device}: {why}")
    for name in ("minibatches", "group_size", "prompts_per_step", "max_new_tokens", "steps",
                 "eval_size", "max_nonfinite"):
        if getattr(cfg, name) < 1:
            raise ValueError(f"{name}: must be >= 1, got {getattr(cfg, name)}")
    for name in ("eval_every", "warmup_steps", "checkpoint_every"):
        if getattr(cfg, name) < 0:
            raise ValueError(f"{name}: must be >= 0, got {getattr(cfg, name)}")
    if world_size > 1:
        if cfg.prompts_per_step % world_size:
            raise ValueError(f"prompts_per_step: {cfg.prompts_per_step} prompts do not split "
                             f"evenly over {world_size} ranks")
        if cfg.eval_size < world_size:
            raise ValueError(f"eval_size: {cfg.eval_size} is fewer than the {world_size} ranks")
    per_step = cfg.prompts_per_step * (cfg.group_size if cfg.mode == "rl" else 1)
    if cfg.minibatches > per_step // world_size:
        raise ValueError(f"minibatches: {cfg.minibatches} exceeds the {per_step // world_size} "
                         "sequences of a step" + (" on each rank" if world_size > 1 else ""))
    for name in ("lr", "temperature", "eval_temperature"):
        if not getattr(cfg, name) > 0:
            raise ValueError(f"{name}: must be > 0, got {getattr(cfg, name)}")
    if cfg.grad_clip < 0 or (cfg.kl_coef is not None and cfg.kl_coef < 0):
        raise ValueError("grad_clip, kl_coef: must be >= 0")
    if not cfg.rollout_logit_noise >= 0:
        raise ValueError(f"rollout_logit_noise: must be >= 0, got {cfg.rollout_logit_noise}")
    _check_rollout_mismatch(cfg)
    check_tree_config(cfg)
    if not cfg.load_balancing_coef >= 0:
        raise ValueError(f"load_balancing_coef: must be >= 0, got {cfg.load_balancing_coef}")
    if cfg.load_balancing_coef > 0 and cfg.dense:
        raise ValueError("load_balancing_coef: a dense model has no experts to balance")
