"""The mean and covariance of an estimator's gradient over tree draws, and their cost in tokens.

One step's batch is one tree (one prompt ``x ~ D``, its leaves one group), grown by a schedule
from the sampler ``μ``. Its gradient is the library's ``ĝ = −∇_θ loss(prepare(batch))`` on the
expanded tree batch (:class:`~tokenmdp.exact.branching.gradients.TreeStepGradients`), compared
with the true ``∇J``:

* ``method="exact"``: ``E[ĝ] = Σ_trees P(tree) ĝ(tree)`` (and ``E‖ĝ‖²``, ``E[ĝ ĝ^T]``) over the
  exact law (:func:`~tokenmdp.exact.branching.law.tree_law`);
* ``method="monte_carlo"``: sampled trees (:func:`~tokenmdp.exact.branching.sampler.sample_trees`)
  folded into the lab's running sums (:class:`~tokenmdp.exact.lab.monte_carlo.MonteCarloSums`),
  with standard errors;
* ``method="auto"``: exact unless the law has more than ``max_trees`` trees.

The result is a :class:`TreeMoments`: a :class:`~tokenmdp.exact.Moments` (every figure of the
lab) that also carries the cost — the expected *generated* tokens per step (a tree's nodes; an
i.i.d. group's ``Σ|y_i|``), the expanded tokens and the leaves. :meth:`TreeWorkspace.iid` gives an
i.i.d. group's moments with the same cost fields, and :func:`at_budget` puts any two on one
budget of generated tokens.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch
from torch import nn

from tokenmdp.estimators import Estimator, get
from tokenmdp.exact.branching.gradients import TreeStepGradients, pack
from tokenmdp.exact.branching.law import MAX_TREES, TreeLaw, tree_law
from tokenmdp.exact.branching.process import StateTable
from tokenmdp.exact.branching.sampler import sample_trees
from tokenmdp.exact.lab._world_tables import WorldTables
from tokenmdp.exact.lab.moments import MAX_COVARIANCE_DIM, MomentsWorkspace
from tokenmdp.exact.lab.moments_result import Moments, _exact_moments
from tokenmdp.exact.lab.monte_carlo import NUM_CHUNKS, MonteCarloSums
from tokenmdp.exact.world.mdp import TokenMDP
from tokenmdp.exact.world.policies import check_policy
from tokenmdp.tree_schedules import FixedForks, as_schedule
from tokenmdp.trees import TREE_NODE

__all__ = ["TREE_METHODS", "TreeMoments", "TreeWorkspace", "at_budget", "tree_moments"]

TREE_METHODS = ("auto", "exact", "monte_carlo")
#: Monte Carlo trees when ``num_samples`` is not given.
DEFAULT_TREES = 4096
#: Seed of the Monte Carlo generator when none is given.
DEFAULT_SEED = 0


@dataclasses.dataclass(frozen=True)
class TreeMoments(Moments):
    """:class:`~tokenmdp.exact.Moments` of one step's gradient, with the step's cost.

    Its parameters are :class:`~tokenmdp.exact.Moments`' and the following.

    Parameters
    ----------
    generated_tokens : float
        Expected tokens the sampler generates per step (a tree's nodes, shared prefixes once;
        an i.i.d. group's ``Σ|y_i|``).
    expanded_tokens : float
        Expected response tokens of the step's sequences (the leaves' paths).
    leaves : float
        Expected sequences per step.
    generated_tokens_se : float or None
        Monte Carlo: standard error of ``generated_tokens``.
    label : str
        What was drawn (the schedule, or ``iid:G``).
    skipped : float
        Probability (Monte Carlo: fraction) of the steps whose one-leaf tree the estimator
        refuses (RLOO's leave-one-out needs two sequences): they count with ``ĝ = 0``, as a
        trainer drops a group it cannot score.
    """

    generated_tokens: float = math.nan
    expanded_tokens: float = math.nan
    leaves: float = math.nan
    generated_tokens_se: float | None = None
    label: str = ""
    skipped: float = 0.0


def _with_cost(m: Moments, **cost) -> TreeMoments:
    return TreeMoments(**{f.name: getattr(m, f.name) for f in dataclasses.fields(Moments)},
                       **cost)


def at_budget(m: TreeMoments, budget: float) -> TreeMoments:
    """The moments of the mean of ``budget / m.generated_tokens`` independent steps.

    A budget of generated tokens buys ``k = budget / cost`` independent draws; their mean has
    the same expectation and ``Cov/k`` (``k`` taken as a real number: the variance per token).
    So two estimators compare at equal budget by their bias, and their variance times their
    cost.

    Parameters
    ----------
    m : TreeMoments
        One step's moments and cost.
    budget : float
        Generated tokens, ``> 0``.

    Returns
    -------
    TreeMoments
        Same mean; ``total_variance`` and ``covariance`` times ``cost / budget``;
        ``generated_tokens = budget`` (``expanded_tokens`` and ``leaves`` scaled alike).
    """
    if not budget > 0 or not m.generated_tokens > 0:
        raise ValueError(f"budget: expected > 0 tokens (and a step that costs some), got "
                         f"{budget!r} for a step of {m.generated_tokens!r}")
    f = m.generated_tokens / budget
    return dataclasses.replace(
        m, total_variance=m.total_variance * f,
        covariance=None if m.covariance is None else m.covariance * f,
        total_variance_se=None if m.total_variance_se is None else m.total_variance_se * f,
        mse_se=None, generated_tokens=budget, expanded_tokens=m.expanded_tokens / f,
        leaves=m.leaves / f, generated_tokens_se=None, monte_carlo_sums=None)


class TreeWorkspace:
    """Tree moments of many estimators and schedules at one ``θ``.

    The policies' log-probs over the enumeration, the map to parameters and ``∇J`` are computed
    once (the lab's tables); each schedule's exact law once; then each estimator costs only its
    own batches. Build a new workspace after changing a policy.

    Parameters
    ----------
    mdp : TokenMDP
    policy : policy module
        ``π_θ``, whose gradient is estimated (float64).
    behavior : policy module, optional
        ``μ``, the sampler (default ``π_θ``: on-policy).
    old : policy module, optional
        ``π_old`` for ratios (default ``behavior``).
    reference : policy module, optional
        ``π_ref``, for estimators with a KL penalty.
    jacobian : Tensor, optional
        The state-action Jacobian of ``policy`` (non-tabular policies), when already computed.
    """

    def __init__(self, mdp: TokenMDP, policy: nn.Module, *, behavior: nn.Module | None = None,
                 old: nn.Module | None = None, reference: nn.Module | None = None,
                 jacobian: torch.Tensor | None = None) -> None:
        check_policy(mdp, policy)
        behavior = policy if behavior is None else behavior
        old = behavior if old is None else old
        for name, module in (("behavior", behavior), ("old", old), ("reference", reference)):
            if module is not None:
                check_policy(mdp, module, name=name)
        self.mdp, self.policy, self.behavior, self.old = mdp, policy, behavior, old
        self.reference = reference
        self.tables = WorldTables(mdp, policy, behavior, old, reference, jacobian)
        self.state_table = StateTable(mdp, behavior)
        self._iid = MomentsWorkspace(mdp, policy, behavior=behavior, old=old, reference=reference,
                                     jacobian=jacobian)
        self._laws: dict = {}
        self._steps: dict = {}
        lengths = mdp.terminal_lengths.to(torch.float64)
        self.mean_length = float((self.tables.mu_probs * lengths
                                  * mdp.prompt_probs[mdp.terminal_prompt_index]).sum())

    def law(self, schedule, *, max_trees: int = MAX_TREES) -> TreeLaw:
        """The exact law of ``schedule``'s trees under ``μ`` (computed once, then reused).

        Parameters
        ----------
        schedule : FixedForks, EntropyForks, RandomForks or str
            The fork schedule (or its text form).
        max_trees : int
            The most trees the law may hold (:func:`tree_law`).

        Returns
        -------
        TreeLaw
        """
        schedule = as_schedule(schedule)
        if schedule not in self._laws:
            self._laws[schedule] = tree_law(self.mdp, self.behavior, schedule,
                                            max_trees=max_trees, table=self.state_table)
        return self._laws[schedule]

    def _estimator(self, estimator) -> Estimator:
        if isinstance(estimator, str):
            estimator = get(estimator)
        if not isinstance(estimator, Estimator):
            raise TypeError(f"estimator: expected an Estimator or a registry name, got "
                            f"{type(estimator).__name__} (loss callables: tokenmdp.exact.moments)")
        needs = estimator.requires("prepare") + estimator.requires("loss")
        if "ref_logprob" in needs and self.reference is None:
            raise ValueError(f"reference: estimator {estimator.name!r} has a KL penalty and needs "
                             "a reference policy")
        return estimator

    def _gradients(self, estimator, n: int) -> TreeStepGradients:
        key = (id(estimator), n)
        if key not in self._steps:
            self._steps[key] = (estimator, TreeStepGradients(
                self.mdp, self.policy, estimator, self.tables.fields, n,
                tables=self.tables.steps))
        return self._steps[key][1]

    def moments(self, estimator, schedule, *, method: str = "auto",
                num_samples: int | None = None,
                generator: torch.Generator | np.random.Generator | None = None,
                max_trees: int = MAX_TREES, group_size: int | None = None) -> TreeMoments:
        """Moments of ``estimator`` on one tree per step, grown by ``schedule``.

        Parameters
        ----------
        estimator : Estimator or str
            Any registry estimator (a leaf-level one reads the leaves as a group; a tree one
            reads the node ids too).
        schedule : FixedForks, RandomForks or EntropyForks
        method : {"auto", "exact", "monte_carlo"}
            See the module docstring.
        num_samples : int, optional
            Monte Carlo trees (default 4096).
        generator : torch.Generator or numpy.random.Generator, optional
            Monte Carlo's randomness (default: a torch generator seeded with 0).
        max_trees : int
            The largest exact law tried (``"auto"`` falls back to Monte Carlo past it).
        group_size : int, optional
            ``G``, checked to be the schedule's nominal leaves.

        Returns
        -------
        TreeMoments
        """
        estimator = self._estimator(estimator)
        schedule = as_schedule(schedule)
        schedule.check(self.mdp.max_len, group_size)
        if method not in TREE_METHODS:
            raise ValueError(f"method: expected one of {', '.join(TREE_METHODS)}, got {method!r}")
        if method != "monte_carlo":
            try:
                law = self.law(schedule, max_trees=max_trees)
            except ValueError:
                if method == "exact":
                    raise
                law = None
            if law is not None:
                return self._exact(estimator, law, str(schedule))
        if generator is None:
            generator = torch.Generator().manual_seed(DEFAULT_SEED)
        n = DEFAULT_TREES if num_samples is None else num_samples
        if isinstance(n, bool) or not isinstance(n, int) or n < 2:
            raise ValueError(f"num_samples: need an int >= 2, got {num_samples!r}")
        drawn = sample_trees(self.mdp, self.behavior, schedule, n, generator=generator,
                             table=self.state_table).grown
        return self._monte_carlo(estimator, drawn, str(schedule))

    def _exact(self, estimator, law: TreeLaw, label: str) -> TreeMoments:
        d = self.tables.steps.num_params
        keep_cov = d <= MAX_COVARIANCE_DIM
        mean = torch.zeros(d, dtype=torch.float64)
        second = torch.zeros((), dtype=torch.float64)
        outer = torch.zeros(d, d, dtype=torch.float64) if keep_cov else None
        skipped = 0.0
        for n, (packed, index) in pack(law.trees, self.mdp.max_len).items():
            steps = self._gradients(estimator, n)
            prob = law.prob[index]
            if not self._scores(steps, packed, n):
                skipped += float(prob.sum())
                continue
            for sl, g in steps.blocks(packed):
                p = prob[sl]
                mean += p @ g
                second += p @ (g * g).sum(1)
                if keep_cov:
                    outer += (g * p[:, None]).T @ g
        m = _exact_moments(mean, second, outer, self.tables.true_grad.clone(), law.num_trees,
                           1.0, "enumeration")
        return _with_cost(m, generated_tokens=law.expected("generated_tokens"),
                          expanded_tokens=law.expected("expanded_tokens"),
                          leaves=law.expected("leaves"), label=label, skipped=skipped)

    @staticmethod
    def _scores(steps, packed, n: int) -> bool:
        """Whether the estimator scores ``n``-leaf trees (False: it refuses one-leaf groups)."""
        if n > 1:
            return True
        try:
            steps.coefficients(packed[:1])
        except ValueError:
            return False
        return True

    def _monte_carlo(self, estimator, drawn, label: str) -> TreeMoments:
        N = len(drawn)
        sums = MonteCarloSums(self.tables.true_grad.clone(),
                              self.tables.steps.num_params <= MAX_COVARIANCE_DIM)
        chunk = torch.arange(N) * NUM_CHUNKS // N
        skipped = 0
        for n, (packed, index) in pack(drawn, self.mdp.max_len).items():
            steps = self._gradients(estimator, n)
            if not self._scores(steps, packed, n):        # ĝ = 0: only the count moves
                skipped += int(index.numel())
                zero = torch.zeros(0, dtype=torch.long)
                sums.add_rows(zero, zero[:, None], torch.zeros(0, 1, dtype=torch.float64),
                              int(index.numel()), chunk[index])
                continue
            for sl, (draw, pair, coef) in steps.sparse_blocks(packed, block=steps.chunk):
                rows = int(packed[sl].shape[0])
                sums.add_rows(*steps.gradient_rows(draw, pair, coef, rows), rows,
                              chunk[index[sl]])
        nodes = torch.tensor([len(t.tokens) for t in drawn], dtype=torch.float64)
        expanded = torch.tensor([sum(t.depth[v] for v in t.leaves()) for t in drawn],
                                dtype=torch.float64)
        leaves = torch.tensor([len(t.leaves()) for t in drawn], dtype=torch.float64)
        return _with_cost(sums.moments(), generated_tokens=float(nodes.mean()),
                          expanded_tokens=float(expanded.mean()), leaves=float(leaves.mean()),
                          generated_tokens_se=float(nodes.std() / N ** 0.5), label=label,
                          skipped=skipped / N)

    def iid(self, estimator, group_size: int, **options) -> TreeMoments:
        """:func:`tokenmdp.exact.moments` of an i.i.d. group of ``group_size`` from ``μ``, with
        its cost ``G · E_μ|y|`` generated tokens.

        An estimator that needs a tree batch (its parts refuse a batch without
        ``token_extras["tree_node"]``) gets the same group as the tree that forks at the prompt
        into ``G`` (:meth:`moments` of ``FixedForks((0,), (G,))``, exact when its law has at
        most ``max_trees`` trees, else Monte Carlo).

        Parameters
        ----------
        estimator : Estimator or str
        group_size : int
        **options
            Further keywords of :meth:`~tokenmdp.exact.MomentsWorkspace.moments` (``method``,
            ``num_samples``, ``generator``, ...); for a tree estimator ``num_samples`` and
            ``generator`` only.

        Returns
        -------
        TreeMoments
        """
        estimator = self._estimator(estimator)
        try:
            m = self._iid.moments(estimator, group_size=group_size, **options)
        except ValueError as err:
            if TREE_NODE not in str(err):
                raise
            tree = {k: v for k, v in options.items() if k in ("num_samples", "generator")}
            m = self.moments(estimator, FixedForks((0,), (group_size,)), **tree)
            return dataclasses.replace(m, label=f"iid:{group_size}")
        cost = group_size * self.mean_length
        return _with_cost(m, generated_tokens=cost, expanded_tokens=cost,
                          leaves=float(group_size), label=f"iid:{group_size}")


def tree_moments(mdp: TokenMDP, policy: nn.Module, estimator, schedule, *,
                 behavior: nn.Module | None = None, old: nn.Module | None = None,
                 reference: nn.Module | None = None, jacobian: torch.Tensor | None = None,
                 **options) -> TreeMoments:
    """Moments of ``estimator`` over tree draws: one :class:`TreeWorkspace`'s one call.

    Parameters
    ----------
    mdp, policy, behavior, old, reference, jacobian
        As for :class:`TreeWorkspace`.
    estimator : Estimator or str
    schedule : FixedForks, RandomForks or EntropyForks
    **options
        ``method``, ``num_samples``, ``generator``, ``max_trees``, ``group_size``
        (:meth:`TreeWorkspace.moments`).

    Returns
    -------
    TreeMoments

    Examples
    --------
    >>> m = tree_moments(mdp, pi, "rloo", FixedForks((1,), (4,)))       # doctest: +SKIP
    >>> m.relative_bias, m.total_variance, m.generated_tokens           # doctest: +SKIP
    """
    return TreeWorkspace(mdp, policy, behavior=behavior, old=old, reference=reference,
                         jacobian=jacobian).moments(estimator, schedule, **options)
