"""Exact bias and variance of any registry estimator, or any loss callable, against the true ``∇J``.

The convention. One optimizer step's batch is ``prompts_per_batch`` groups; each group draws a
prompt ``x ~ D`` and ``G`` responses ``y_1..y_G ~ μ(·|x)`` i.i.d. The estimator's gradient on the
batch is the ascent direction ``ĝ = −∇_θ loss(prepare(batch))``, with the aggregation's counts
those of the batch. Its expectation (with one prompt per batch) is ``Σ_x D(x) E[ĝ | x]`` and is
compared with ``∇J`` of :func:`~tokenmdp.exact.gradient`. Per-batch gradients come from
:class:`~tokenmdp.exact.lab.step_gradients.StepGradients`, which runs the library's own ``prepare``
and ``loss``.

Methods:

* ``"enumeration"``: every multiset of ``G`` responses per prompt with its multinomial probability
  (:mod:`~tokenmdp.exact.lab.group_draws`);
* ``"exchangeability"`` (one prompt per batch): ``ĝ = Σ_i g_i`` where ``g_i`` is sample ``i``'s own
  term, which depends on the other samples only through their *types* (effective reward, counted
  tokens). So ``E[ĝ] = G E[g_1]`` needs only ``y_1`` and the type distribution of the others, and
  ``E‖ĝ‖² = G E‖g_1‖² + G(G−1) E<g_1, g_2>``, where, given all types, ``y_1`` and ``y_2`` are
  independent: ``E<g_1, g_2> = E_types <E[g_1 | types], E[g_2 | types]>``. Every own term is
  evaluated once, up to ``G`` of them per batch (packed by type): at most
  ``n · C(K+G−2, G−1)`` batches, instead of ``C(n+G−1, G)`` for ``n`` responses
  and ``K`` types (:mod:`~tokenmdp.exact.lab.exchangeability`);
* ``"exact"``: the cheaper of the two; ``"monte_carlo"``: sampled batches with standard errors;
  ``"auto"``: exact when its estimated time is at most that of the Monte Carlo run and it fits
  the memory budget (:mod:`~tokenmdp.exact.world.budget`), else Monte Carlo; ``Moments.method`` says
  which ran, and a Monte Carlo result carries standard errors. Monte Carlo is streamed: running
  sums, memory O(parameters), results of several calls pooled by
  :func:`~tokenmdp.exact.lab.monte_carlo.pool` (:mod:`~tokenmdp.exact.lab.monte_carlo`).

In place of an estimator, any loss callable ``loss_fn(logprobs_RC, batch) -> scalar`` (with an
optional ``prepare``): its per-token coefficients come from autograd on each enumerated batch,
and every *ordered* draw is enumerated unless ``order_invariant=True``
(:mod:`~tokenmdp.exact.lab.loss_fn_gradients`, which says what the callable sees).

:class:`MomentsWorkspace` computes what no estimator changes (the policies' log-probs of the
enumeration, the sampling probabilities, the map to parameters, ``∇J``) once for many
estimators at one ``θ``; :func:`moments` is one workspace's one call.

The result, :class:`Moments`, and its exact and Monte Carlo builders are in
:mod:`~tokenmdp.exact.lab.moments_result`; both modules' public names are re-exported here.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from tokenmdp.estimators import Estimator
from tokenmdp.exact.lab._watch import _same, _settings
from tokenmdp.exact.lab._world_tables import WorldTables
from tokenmdp.exact.lab.exchangeability import _by_exchangeability
from tokenmdp.exact.lab.group_draws import exact_draws, sampled_draws
from tokenmdp.exact.lab.loss_fn_gradients import (
    LossFnGradients,
    _check_loss_fn,
    _resolve_prepare,
    ordered_draws,
)
from tokenmdp.exact.lab.method_choice import (
    BYTES_PER_DRAWN_RESPONSE,
    DEFAULT_NUM_SAMPLES,
    MAX_EXACT_CALLS,
    MC_COST_PER_BATCH,
    METHODS,
    PILOT_SAMPLES,
    TARGET_RSE,
    choose,
    samples_for,
)
from tokenmdp.exact.lab.moments_result import Moments, _exact_moments
from tokenmdp.exact.lab.monte_carlo import NUM_CHUNKS, MonteCarloSums
from tokenmdp.exact.lab.step_gradients import StepGradients
from tokenmdp.exact.world import budget
from tokenmdp.exact.world.mdp import TokenMDP
from tokenmdp.exact.world.policies import check_policy

__all__ = ["MomentsWorkspace", "moments"]

#: Seed of the Monte Carlo generator when ``moments`` is given none.
DEFAULT_MC_SEED = 0
#: Seed of the pilot run of ``method="auto"`` (a stream of its own: the run keeps its draws).
PILOT_SEED = 1
#: The full covariance matrix is kept when the policy has at most this many parameters.
MAX_COVARIANCE_DIM = 512
#: Monte Carlo batches folded into the running sums at once.
MC_BLOCK = 8192


def moments(mdp: TokenMDP, policy: nn.Module, estimator: Estimator | Callable, *,
            group_size: int, behavior: nn.Module | None = None, old: nn.Module | None = None,
            reference: nn.Module | None = None, prompts_per_batch: int = 1,
            method: str = "auto", num_samples: int | None = None,
            generator: torch.Generator | None = None, filter_groups: bool = False,
            max_exact_draws: int | None = None,
            jacobian: torch.Tensor | None = None,
            memory_budget: int | str | None = None,
            prepare: Estimator | str | Callable | None = None,
            order_invariant: bool | None = None,
            target_rse: float | None = TARGET_RSE) -> Moments:
    """Mean, variance and bias of ``estimator``'s gradient against the true ``∇J``.

    Parameters
    ----------
    mdp : TokenMDP
    policy : policy module
        ``π_θ``, whose gradient is estimated (float64).
    estimator : Estimator or callable
        Any composition, e.g. ``tokenmdp.estimators.get("grpo")``; or a loss callable
        ``loss_fn(logprobs_RC, batch) -> scalar tensor`` of one optimizer step, whose gradient
        is ``ĝ = −∇_θ loss`` (:mod:`~tokenmdp.exact.lab.loss_fn_gradients`).
    group_size : int
        ``G``, responses per prompt.
    behavior : policy module, optional
        ``μ``, the engine that samples (default ``π_θ``: on-policy).
    old : policy module, optional
        ``π_old``, the training engine at the rollout weights, for clipping ratios (default
        ``behavior``).
    reference : policy module, optional
        ``π_ref`` for a KL penalty (required when the estimator has one).
    prompts_per_batch : int
        Groups per batch; the aggregation's counts are those of the whole batch.
    method : {"auto", "exact", "enumeration", "exchangeability", "monte_carlo"}
        See the module docstring.
    num_samples : int, optional
        Monte Carlo batches. Default: 4096, or with ``method="auto"`` as many as reach
        ``target_rse`` (:mod:`~tokenmdp.exact.lab.method_choice`).
    generator : torch.Generator, optional
        Source of the Monte Carlo draws; default a CPU generator seeded with
        ``DEFAULT_MC_SEED`` (0; so ``method="auto"`` that resolves to Monte Carlo runs, and
        repeats). ``Moments.method`` says which method ran.
    filter_groups : bool
        DAPO's dynamic sampling (Yu et al. 2025, arXiv 2503.14476, Eq. 11): groups whose rewards
        are all equal are dropped and redrawn, so every group of the batch is drawn from the
        conditional distribution given "rewards not all equal"; ``keep_probability`` reports
        ``P(kept)`` (estimated by the acceptance rate under Monte Carlo). Not with
        exchangeability.
    max_exact_draws : int, optional
        A cap for ``"auto"``: an exact method that evaluates more batches is not picked
        (default none for an Estimator, ``MAX_EXACT_CALLS`` for a loss callable). Below it,
        ``"auto"`` picks the exact method unless its estimated time exceeds that of the Monte
        Carlo run (``num_samples``, or the batches that reach ``target_rse``; each
        ``MC_COST_PER_BATCH`` exact batches) or it does not fit the memory budget, and always
        below ``ALWAYS_EXACT_DRAWS`` batches.
    jacobian : Tensor, optional
        :func:`~tokenmdp.exact.lab.step_gradients.state_action_jacobian` of ``policy`` at its
        current parameters, when the caller compares many estimators at one ``θ``.
    memory_budget : int or str, optional
        Bytes an exact method may need (:func:`~tokenmdp.exact.world.budget.memory_budget`): an exact
        method over it is refused before allocating (``"auto"`` then picks Monte Carlo).
    prepare : callable, Estimator or str, optional
        With a loss callable only: run on each batch before it, ``batch -> batch`` (filling
        ``advantage``, ``loss_weight``, ...; not changing the layout), or that estimator's
        :func:`~tokenmdp.estimators.prepare` with ``max_len = mdp.max_len``. Default: none
        (``advantage`` and ``loss_weight`` are 1 on the response tokens).
    target_rse : float or None, default ``TARGET_RSE`` (0.01)
        The precision ``method="auto"`` reaches when ``num_samples`` is not given: the standard
        error of the mean gradient relative to ``‖∇J‖`` (``Moments.relative_se``). A pilot of
        ``PILOT_SAMPLES`` batches estimates how many Monte Carlo batches that takes; the exact
        method runs when it costs less. None: the fixed 4096 batches.
    order_invariant : bool, optional
        Whether the gradient ignores the order of a group's responses, so that an exact method
        may enumerate multisets (each standing for its orderings) instead of every ordered draw.
        Default True for an Estimator (the registry's are), False for a loss callable; the
        exchangeability method needs an Estimator and True.

    Returns
    -------
    Moments
        ``mean`` is ``E[ĝ] = Σ_batches P(batch) ĝ(batch)``; with one prompt per batch that is
        ``Σ_x D(x) E[ĝ | x]``.

    Raises
    ------
    TypeError
        ``estimator`` neither an Estimator nor a callable of ``(logprobs_RC, batch)``; a loss
        callable that returns anything but a floating-point scalar tensor; a bad ``prepare``.
    ValueError
        Bad sizes or options, naming the argument; an exact method whose draws would exceed the
        memory budget (naming ``group_size``, the count and the bytes).
    """
    return MomentsWorkspace(mdp, policy, behavior=behavior, old=old, reference=reference,
                            jacobian=jacobian).moments(
        estimator, group_size=group_size, prompts_per_batch=prompts_per_batch, method=method,
        num_samples=num_samples, generator=generator, filter_groups=filter_groups,
        max_exact_draws=max_exact_draws, memory_budget=memory_budget, prepare=prepare,
        order_invariant=order_invariant, target_rse=target_rse)


class MomentsWorkspace:
    """:func:`moments` of many estimators at one ``θ``, the estimator-independent work done once.

    The enumeration's log-probs under the policy, the behaviour, ``π_old`` and ``π_ref``, the
    sampling probabilities, the state-action map to parameters (a Jacobian for a non-tabular
    policy) and the true ``∇J`` are computed at the first call and reused by every later one,
    which then costs only the estimator's own batches; the results equal those of
    :func:`moments` bit for bit. The policies may change between calls (a tabular policy
    trained in place): every call compares their parameters and buffers with a copy taken when
    the tables were built, and the public attributes of the MDP, of the policies and of their
    submodules (numbers and strings such as a temperature or a rounding, unregistered tensors
    such as ``prompt_probs``, by value; anything else, and the policies held, by identity), and
    rebuilds the tables when any differs (a ``jacobian`` given here is then dropped, as it was
    for the old parameters); the inside of an attribute compared by identity (a reward
    object's fields, a list's items) is not watched.

    Parameters
    ----------
    mdp : TokenMDP
    policy : policy module
        ``π_θ``, whose gradient is estimated (float64).
    behavior, old, reference : policy module, optional
        ``μ``, ``π_old`` and ``π_ref``, as for :func:`moments`.
    jacobian : Tensor, optional
        :func:`~tokenmdp.exact.lab.step_gradients.state_action_jacobian` of ``policy`` now.

    Examples
    --------
    >>> ws = MomentsWorkspace(mdp, pi, behavior=mu, old=old, reference=old)  # doctest: +SKIP
    >>> table = {name: ws.moments(get(name), group_size=8) for name in names()}  # doctest: +SKIP
    """

    def __init__(self, mdp: TokenMDP, policy: nn.Module, *, behavior: nn.Module | None = None,
                 old: nn.Module | None = None, reference: nn.Module | None = None,
                 jacobian: torch.Tensor | None = None) -> None:
        check_policy(mdp, policy)
        behavior = policy if behavior is None else behavior
        old = behavior if old is None else old
        check_policy(mdp, behavior, name="behavior")
        check_policy(mdp, old, name="old")
        if reference is not None:
            check_policy(mdp, reference, name="reference")
        self.mdp, self.policy, self.behavior, self.old = mdp, policy, behavior, old
        self.reference, self.jacobian = reference, jacobian
        self._built: WorldTables | None = None
        self._settings: list = []

    def build(self) -> MomentsWorkspace:
        """Compute the tables now (else the first :meth:`moments` does), or again after a change.

        Returns
        -------
        MomentsWorkspace
            ``self``.
        """
        self._tables()
        return self

    def _tables(self) -> WorldTables:
        """The tables at the policies' present parameters and settings (built, or rebuilt after
        a change)."""
        held = (self.mdp, self.policy, self.behavior, self.old, self.reference)
        if self._built is None or not _same(_settings(held), self._settings) \
                or not self._built.current():
            if self._built is not None:
                self.jacobian = None
            self._built = WorldTables(*held, self.jacobian)
            self._settings = _settings(held)    # after the build (a policy may cache in it)
        return self._built

    def moments(self, estimator: Estimator | Callable, *, group_size: int,
                **options) -> Moments:
        """:func:`moments` of ``estimator`` with this workspace's MDP and policies.

        Parameters
        ----------
        estimator : Estimator or callable
            As for :func:`moments`.
        group_size : int
            ``G``, responses per prompt.
        **options
            Any other keyword of :func:`moments` but the policies and ``jacobian``:
            ``prompts_per_batch``, ``method``, ``num_samples``, ``generator``,
            ``filter_groups``, ``max_exact_draws``, ``memory_budget``, ``prepare``,
            ``order_invariant``, ``target_rse``.

        Returns
        -------
        Moments
            Equal to ``moments(mdp, policy, estimator, group_size=..., ...)``.
        """
        return self._moments(estimator, group_size=group_size, **options)

    def _moments(self, estimator, *, group_size, prompts_per_batch=1, method="auto",
                 num_samples=None, generator=None, filter_groups=False, max_exact_draws=None,
                 memory_budget=None, prepare=None, order_invariant=None,
                 target_rse=TARGET_RSE) -> Moments:
        mdp, policy, reference = self.mdp, self.policy, self.reference
        custom = not isinstance(estimator, Estimator)
        if custom:
            _check_loss_fn(estimator)
        elif prepare is not None:
            raise TypeError("prepare: only with a loss callable (an Estimator prepares itself)")
        if order_invariant is None:
            order_invariant = not custom
        elif not isinstance(order_invariant, bool):
            raise TypeError(f"order_invariant: expected a bool or None, got {order_invariant!r}")
        if max_exact_draws is None:
            max_exact_draws = MAX_EXACT_CALLS if custom else None
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
            raise ValueError(f"group_size: expected an int >= 1, got {group_size!r}")
        if isinstance(prompts_per_batch, bool) or not isinstance(prompts_per_batch, int) \
                or prompts_per_batch < 1:
            raise ValueError(f"prompts_per_batch: expected an int >= 1, got {prompts_per_batch!r}")
        if method not in METHODS:
            raise ValueError(f"method: expected one of {', '.join(METHODS)}, got {method!r}")
        needs_ref = not custom and "ref_logprob" in (estimator.requires("prepare")
                                                     + estimator.requires("loss"))
        if needs_ref and reference is None:
            raise ValueError(f"reference: estimator {estimator.name!r} has a KL penalty and needs a "
                             "reference policy")
        tables = self._tables()
        mu_probs, fields = tables.mu_probs, tables.fields
        if custom:
            steps = LossFnGradients(mdp, policy, estimator, _resolve_prepare(prepare, mdp), fields,
                                    group_size, tables=tables.steps)
        else:
            steps = StepGradients(mdp, policy, estimator, fields, group_size, tables=tables.steps)
        if target_rse is not None and (isinstance(target_rse, bool) or not
                                       isinstance(target_rse, (int, float)) or not target_rse > 0):
            raise ValueError(f"target_rse: expected a number > 0 or None, got {target_rse!r}")
        requested, precise = method, num_samples is None and target_rse is not None
        num_samples = DEFAULT_NUM_SAMPLES if num_samples is None else num_samples

        def resolve(num_samples):
            return choose(requested, steps, mdp, mu_probs,
                          group_size, prompts_per_batch, filter_groups, max_exact_draws,
                          memory_budget, num_samples=num_samples,
                          mc_cost=1.0 if custom else MC_COST_PER_BATCH,
                          ordered=not order_invariant, typed=not custom)
        method = resolve(num_samples)
        if requested == "auto" and method == "monte_carlo" and precise:
            # how many batches reach the precision? a pilot measures the spread; then exact
            # is taken if it costs less than that run (and fits), else that run, as far as
            # the memory budget allows (the result's relative_se says what it reached)
            pilot = self._moments(estimator, group_size=group_size,
                                  prompts_per_batch=prompts_per_batch, method="monte_carlo",
                                  num_samples=PILOT_SAMPLES, filter_groups=filter_groups,
                                  generator=torch.Generator().manual_seed(PILOT_SEED),
                                  memory_budget=memory_budget, prepare=prepare,
                                  order_invariant=order_invariant, target_rse=None)
            per_batch = BYTES_PER_DRAWN_RESPONSE * group_size * prompts_per_batch + 16
            fits = max(2, budget.memory_budget(memory_budget) // per_batch)
            num_samples = min(samples_for(pilot.relative_se, target_rse), fits)
            method = resolve(num_samples)
        d = steps.num_params
        keep_cov = d <= MAX_COVARIANCE_DIM
        true_grad = tables.true_grad.clone()
        if method == "exchangeability":
            mean, second, outer, evaluated = _by_exchangeability(steps, mdp, mu_probs, group_size,
                                                                 keep_cov)
            return _exact_moments(mean, second, outer, true_grad, evaluated, 1.0, method)
        if method == "enumeration":
            draws = exact_draws if order_invariant else ordered_draws
            ids, prob, p_keep = draws(mdp, mu_probs, group_size, prompts_per_batch, filter_groups)
        else:
            if generator is None:
                generator = torch.Generator().manual_seed(DEFAULT_MC_SEED)
            if not isinstance(generator, torch.Generator):
                raise TypeError(f"generator: expected a torch.Generator (or None), got "
                                f"{type(generator).__name__}")
            if num_samples < 2:
                raise ValueError(f"num_samples: need at least 2, got {num_samples}")
            ids, prob, p_keep = sampled_draws(mdp, mu_probs, group_size, prompts_per_batch,
                                              num_samples, generator, filter_groups)
        if method == "monte_carlo":
            return _streamed_monte_carlo(steps, ids, true_grad, keep_cov, p_keep)
        mean = torch.zeros(d, dtype=torch.float64)
        second = torch.zeros((), dtype=torch.float64)
        outer = torch.zeros(d, d, dtype=torch.float64) if keep_cov else None
        if keep_cov:                                      # dense per-batch gradients are small here
            for sl, g in steps.blocks(ids):
                p = prob[sl]
                mean += p @ g
                second += p @ (g * g).sum(1)
                outer += (g * p[:, None]).T @ g
        else:                                             # large models: stay in coefficient space
            mean_C = torch.zeros(1, steps.num_pairs, dtype=torch.float64)
            for sl, (draw, pair, coef) in steps.sparse_blocks(ids):
                p = prob[sl]
                mean_C[0].index_add_(0, pair, coef * p[draw])
                second += p @ steps.sq_norms(draw, pair, coef, int(p.numel()))
            mean = steps.to_params(mean_C)[0]
        return _exact_moments(mean, second, outer, true_grad, int(ids.shape[0]), p_keep, method)


def _streamed_monte_carlo(steps, ids, true_grad, keep_cov, p_keep) -> Moments:
    """Fold the sampled batches into running sums block by block (:mod:`~tokenmdp.exact.lab.monte_carlo`)."""
    sums = MonteCarloSums(true_grad, keep_cov, p_keep)
    N = ids.shape[0]
    chunk = torch.arange(N) * NUM_CHUNKS // N                  # the stream's batch-means chunks
    block = max(1, min(MC_BLOCK, steps.chunk if steps.jacobian is not None or keep_cov
                       else MC_BLOCK))
    for sl, (draw, pair, coef) in steps.sparse_blocks(ids, block=block):
        n = int(ids[sl].shape[0])
        sums.add_rows(*steps.gradient_rows(draw, pair, coef, n), n, chunk[sl])
    return sums.moments()
