"""Training by sampled updates on an exact token MDP, with the exact ``J`` after every update.

:func:`train_exact` is the loop of a trainer in miniature, run on an enumerable MDP so that
nothing but the updates is random: each update draws a batch from the sampler, runs the
estimator's own :func:`~tokenmdp.estimators.prepare` and :func:`~tokenmdp.estimators.loss` on
it, and steps the optimizer; after every update the objective ``J`` is computed exactly
(:func:`~tokenmdp.exact.objective`), so a training curve carries no evaluation noise and two
estimators trained with the same budget can be compared update by update.

Three policies per update, as in :mod:`~tokenmdp.exact.world.behavior`:

* ``π_θ``, the policy being trained (the one whose gradient the loss takes);
* ``π_old``, the policy the rollout was generated with: ``π_θ`` itself on-policy, or the policy
  of ``staleness`` updates ago (an asynchronous pipeline whose rollouts lag by ``k`` updates);
* ``μ``, the engine that sampled: ``π_old``, or ``engine(π_old)`` (for example an
  :func:`~tokenmdp.exact.inference_copy` with rounded or perturbed logits).

The batch of update ``t`` is ``sample(mdp, μ_t, groups_per_update * group_size,
generator=generator, group_size=group_size)`` (:func:`~tokenmdp.exact.sample`, which fills
``behavior_logprob = log μ``), with ``old_logprob = log π_old`` and, when ``reference`` is given,
``ref_logprob = log π_ref`` of its tokens; it is prepared with ``max_len = mdp.max_len``. The
generator is used by nothing else, so a run is a deterministic function of its seed.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
from collections.abc import Callable

import torch
from torch import nn
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from tokenmdp.estimators import Estimator, loss, prepare
from tokenmdp.exact.world.ground_truth import gradient, objective, sequence_kl
from tokenmdp.exact.world.mdp import TokenMDP
from tokenmdp.exact.world.policies import PrefixPolicy, check_number, check_policy
from tokenmdp.exact.world.sampling import sample

__all__ = ["ExactTrainingRun", "train_exact"]


@dataclasses.dataclass(frozen=True)
class ExactTrainingRun:
    """The record of :func:`train_exact`: exact ``J`` and per-update diagnostics.

    Parameters
    ----------
    objective : Tensor ``[updates + 1]``
        The exact ``J(θ_t)`` before the first update (``t = 0``) and after each update.
    gradient_norm : Tensor ``[updates]``
        ``‖ĝ_t‖`` of the sampled ascent direction ``ĝ_t = −∇_θ loss`` of update ``t``.
    true_gradient_norm : Tensor ``[updates]``
        ``‖∇J(θ_t)‖`` at the parameters the update started from.
    cosine : Tensor ``[updates]``
        ``cos(ĝ_t, ∇J(θ_t))`` (0 when either vector is 0).
    behavior_kl : Tensor ``[updates]``
        The exact sequence KL ``KL(π_θ_t ‖ μ_t)`` between the policy being trained and the
        sampler of its batch (0 on-policy without an engine).
    metrics : dict of str to Tensor ``[updates]``
        Every metric of :func:`~tokenmdp.estimators.loss` (``clip_fraction``, ``r_max``, ...),
        one value per update.
    parameters : Tensor ``[updates + 1, num_params]``
        The flat parameters ``θ_t`` before the first update and after each update
        (:meth:`policy_at` rebuilds ``π_t``).
    policy : nn.Module
        The trained policy (a copy; the policy passed in is not modified).
    """

    objective: torch.Tensor
    gradient_norm: torch.Tensor
    true_gradient_norm: torch.Tensor
    cosine: torch.Tensor
    behavior_kl: torch.Tensor
    metrics: dict[str, torch.Tensor]
    parameters: torch.Tensor
    policy: nn.Module

    @property
    def updates(self) -> int:
        """The number of updates run.

        Returns
        -------
        int
        """
        return int(self.gradient_norm.numel())

    def policy_at(self, t: int) -> nn.Module:
        """A copy of the policy after ``t`` updates (``t = 0``: the initial policy).

        Parameters
        ----------
        t : int
            ``0 <= t <= updates``; negative values count from the end, as in Python.

        Returns
        -------
        nn.Module
            A deep copy of ``policy`` with parameters ``θ_t`` (differentiable, as
            ``policy``: ``moments`` and ``gradient`` take it).
        """
        if isinstance(t, bool) or not isinstance(t, int):
            raise TypeError(f"t: expected an int, got {type(t).__name__}")
        if not -self.parameters.shape[0] <= t < self.parameters.shape[0]:
            raise ValueError(f"t: expected 0 <= t <= {self.updates}, got {t}")
        copy_ = copy.deepcopy(self.policy)
        vector_to_parameters(self.parameters[t].clone(), copy_.parameters())
        return copy_

    @property
    def final_objective(self) -> float:
        """The exact ``J`` after the last update.

        Returns
        -------
        float
        """
        return float(self.objective[-1])

    @property
    def max_drawdown(self) -> float:
        """The largest fall of ``J`` below its best value so far, ``max_t (max_{s≤t} J_s − J_t)``.

        0 for a run whose ``J`` never decreases: a measure of (in)stability.

        Returns
        -------
        float
        """
        best = torch.cummax(self.objective, dim=0).values
        return float((best - self.objective).max())


def _check_count(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name}: must be >= {minimum}, got {value}")
    return value


def _frozen(policy: nn.Module) -> nn.Module:
    return copy.deepcopy(policy).requires_grad_(False)


def train_exact(mdp: TokenMDP, policy: nn.Module, estimator: Estimator, *, updates: int,
                group_size: int, generator: torch.Generator, lr: float | None = None,
                optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer] | None = None,
                groups_per_update: int = 1, staleness: int = 0,
                engine: Callable[[nn.Module], nn.Module] | None = None,
                reference: nn.Module | None = None) -> ExactTrainingRun:
    """Train a copy of ``policy`` by sampled updates of ``estimator``; exact ``J`` after each.

    Update ``t`` (see the module docstring for the batch): ``π_old = θ_{max(t − staleness, 0)}``,
    ``μ = engine(π_old)`` (or ``π_old``), a batch of ``groups_per_update`` groups of
    ``group_size`` responses from ``μ``, ``prepare`` then ``loss`` of ``estimator`` on it, and one
    optimizer step on the loss. With ``lr`` the step is plain gradient ascent,
    ``θ ← θ + lr · ĝ`` with ``ĝ = −∇_θ loss`` (``torch.optim.SGD``).

    Parameters
    ----------
    mdp : TokenMDP
        The exact MDP.
    policy : PrefixPolicy
        The initial policy (float64; copied, not modified).
    estimator : Estimator
        Any composition (a registry entry or your own).
    updates : int
        The number of updates, ``>= 0``.
    group_size : int
        ``G``, responses per prompt.
    generator : torch.Generator
        The only source of randomness (the batches).
    lr : float, optional
        Step size of plain gradient ascent (``> 0``); give exactly one of ``lr`` and
        ``optimizer``.
    optimizer : callable, optional
        ``optimizer(parameters) -> torch.optim.Optimizer`` (for example
        ``lambda p: torch.optim.Adam(p, lr=0.05)``); it minimizes the loss.
    groups_per_update : int, default 1
        Groups (prompt draws) per batch.
    staleness : int, default 0
        ``k``: the rollout of update ``t`` comes from the policy of update ``t − k`` (from the
        initial policy while ``t < k``).
    engine : callable, optional
        ``engine(π_old) -> μ``, a prefix policy that samples in place of ``π_old`` (e.g.
        ``lambda p: inference_copy(p, rounding="fp8_e4m3")``); called once per update.
    reference : policy module, optional
        ``π_ref`` of a KL penalty (required when ``estimator`` has one).

    Returns
    -------
    ExactTrainingRun
        The exact ``J`` curve, the per-update gradient norms, cosines, sampler KLs and loss
        metrics, and the trained policy.

    Raises
    ------
    TypeError
        A wrong type of ``estimator``, ``generator``, ``engine``, ``optimizer`` or of a count;
        a policy (or an engine's output) that is not a float64 prefix policy of ``mdp``.
    ValueError
        Counts out of range, a bad ``lr``, both or neither of ``lr`` and ``optimizer``, a KL
        penalty without ``reference``.
    FloatingPointError
        An update whose loss or gradient is not finite (naming the update).
    """
    check_policy(mdp, policy)
    if not isinstance(policy, PrefixPolicy):
        raise TypeError(f"policy: expected a PrefixPolicy (it samples), got {type(policy).__name__}")
    if not isinstance(estimator, Estimator):
        raise TypeError(f"estimator: expected an Estimator, got {type(estimator).__name__}")
    if not isinstance(generator, torch.Generator):
        raise TypeError(f"generator: expected a torch.Generator, got {type(generator).__name__}")
    updates = _check_count("updates", updates, 0)
    group_size = _check_count("group_size", group_size, 1)
    groups_per_update = _check_count("groups_per_update", groups_per_update, 1)
    staleness = _check_count("staleness", staleness, 0)
    if engine is not None and not callable(engine):
        raise TypeError(f"engine: expected a callable π_old -> μ, got {type(engine).__name__}")
    needs_ref = "ref_logprob" in estimator.requires("prepare") + estimator.requires("loss")
    if needs_ref and reference is None:
        raise ValueError(f"reference: estimator {estimator.name!r} has a KL penalty and needs a "
                         "reference policy")
    if reference is not None:
        check_policy(mdp, reference, name="reference")
        reference = _frozen(reference) if needs_ref else None   # no log-probs nobody reads
    trained = copy.deepcopy(policy).requires_grad_(True)
    params = [p for p in trained.parameters() if p.requires_grad]
    opt = _make_optimizer(params, lr, optimizer)

    with torch.no_grad():
        J = [float(objective(mdp, trained))]
    thetas = [parameters_to_vector(trained.parameters()).detach().clone()]
    # the policies of the last `staleness` updates (on-policy: the trained policy itself)
    history = collections.deque([_frozen(trained)], maxlen=staleness + 1) if staleness else None
    rows: dict[str, list[float]] = collections.defaultdict(list)
    metrics: dict[str, list[float]] = {}
    for t in range(updates):
        old = trained if history is None else history[0]
        mu = old if engine is None else _engine(engine, old, mdp)
        batch = _batch(mdp, old, mu, reference, estimator, group_size, groups_per_update,
                       generator)
        value, step_metrics = loss(trained.token_logprobs(batch), batch, estimator)
        grads = torch.autograd.grad(value, params, allow_unused=True) if value.requires_grad \
            else [None] * len(params)
        ascent = -torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1)
                             for p, g in zip(params, grads)])
        if not (torch.isfinite(value) and torch.isfinite(ascent).all()):
            raise FloatingPointError(f"update {t}: the loss or its gradient is not finite "
                                     f"(loss {float(value.detach()):g})")
        true = gradient(mdp, trained)
        with torch.no_grad():
            rows["gradient_norm"].append(float(ascent.norm()))
            rows["true_gradient_norm"].append(float(true.norm()))
            denom = ascent.norm() * true.norm()
            rows["cosine"].append(float(ascent @ true / denom) if denom > 0 else 0.0)
            rows["behavior_kl"].append(0.0 if mu is trained else float(sequence_kl(mdp, trained,
                                                                                 mu)))
        for key, v in step_metrics.items():
            metrics.setdefault(key, []).append(float(v))
        opt.zero_grad(set_to_none=True)
        for p, g in zip(params, grads):
            p.grad = torch.zeros_like(p) if g is None else g
        opt.step()
        with torch.no_grad():
            J.append(float(objective(mdp, trained)))
        thetas.append(parameters_to_vector(trained.parameters()).detach().clone())
        if history is not None:
            history.append(_frozen(trained))

    def as_tensor(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float64)

    return ExactTrainingRun(objective=as_tensor(J),
                            **{k: as_tensor(rows[k]) for k in ("gradient_norm",
                                                               "true_gradient_norm", "cosine",
                                                               "behavior_kl")},
                            metrics={k: as_tensor(v) for k, v in metrics.items()},
                            parameters=torch.stack(thetas), policy=trained)


def _make_optimizer(params, lr, optimizer) -> torch.optim.Optimizer:
    if (lr is None) == (optimizer is None):
        raise ValueError("lr, optimizer: give exactly one of them")
    if optimizer is None:
        return torch.optim.SGD(params, lr=check_number("lr", lr, strict=True))
    if not callable(optimizer):
        raise TypeError(f"optimizer: expected a callable parameters -> Optimizer, got "
                        f"{type(optimizer).__name__}")
    opt = optimizer(params)
    if not isinstance(opt, torch.optim.Optimizer):
        raise TypeError(f"optimizer: must return a torch.optim.Optimizer, got "
                        f"{type(opt).__name__}")
    return opt


def _engine(engine, old: nn.Module, mdp: TokenMDP) -> nn.Module:
    mu = engine(old)
    check_policy(mdp, mu, name="engine(π_old)")
    if not isinstance(mu, PrefixPolicy):
        raise TypeError(f"engine: must return a PrefixPolicy (it samples), got "
                        f"{type(mu).__name__}")
    return mu


def _batch(mdp, old, mu, reference, estimator, group_size, groups, generator):
    """One update's prepared batch: drawn from ``mu``, with the old and reference log-probs."""
    batch = sample(mdp, mu, groups * group_size, generator=generator, group_size=group_size)
    with torch.no_grad():
        fields = {"old_logprob": batch.behavior_logprob if old is mu
                  else old.token_logprobs(batch)}
        if reference is not None:
            fields["ref_logprob"] = reference.token_logprobs(batch)
    return prepare(batch.replace(**fields), estimator, max_len=mdp.max_len)

