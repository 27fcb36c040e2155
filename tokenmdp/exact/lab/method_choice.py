"""Which method :func:`~tokenmdp.exact.moments` runs: exact when it is cheaper, or the Monte
Carlo run that reaches the asked precision.

``method="auto"`` compares the cost of the cheaper exact method (its batches, counted in closed
form) with that of Monte Carlo (its batches, each ``MC_COST_PER_BATCH`` exact ones). How many
Monte Carlo batches? With ``num_samples`` given, that many. Without it, as many as reach
``target_rse``, the standard error of the mean gradient relative to ``‖∇J‖``
(:attr:`Moments.relative_se <tokenmdp.exact.Moments.relative_se>`): a pilot run of
``PILOT_SAMPLES`` batches measures the estimator's spread, and since the error falls like
``1/√N``, ``N = N_pilot (rse_pilot / target_rse)²`` batches reach the target (at least the
default 4096). Exact wins whenever it is cheaper than that run or below ``ALWAYS_EXACT_DRAWS``
batches, and fits the memory budget: ``auto`` never returns a Monte Carlo answer less precise
than asked where the exact one would have cost less.
"""

from __future__ import annotations

import math

from tokenmdp.exact.lab.exchangeability import _type_keys, exchangeability_cost, reduces_to_types
from tokenmdp.exact.lab.group_draws import count_draws
from tokenmdp.exact.lab.loss_fn_gradients import count_ordered_draws
from tokenmdp.exact.world import budget

__all__ = ["ALWAYS_EXACT_DRAWS", "BYTES_PER_DRAWN_RESPONSE", "DEFAULT_NUM_SAMPLES",
           "MAX_EXACT_CALLS", "MC_COST_PER_BATCH", "METHODS", "PILOT_SAMPLES", "TARGET_RSE",
           "check_sampled", "choose", "samples_for"]

METHODS = ("auto", "exact", "enumeration", "exchangeability", "monte_carlo")
#: For a loss callable, which runs once per batch in Python: above this many batches to
#: evaluate, ``method="auto"`` switches to Monte Carlo.
MAX_EXACT_CALLS = 20_000
#: Time of one streamed Monte Carlo batch of an Estimator relative to one exact batch
#: (sampling, every parameter row of its gradient, the running sums; measured on one CPU thread
#: with ``benchmarks/moments.py``: about 13,000 against 110,000 batches per second at G = 4).
MC_COST_PER_BATCH = 8.0
#: ``method="auto"`` takes an exact method of at most this many batches whatever the Monte Carlo
#: run would cost (a few seconds at most, and no sampling error).
ALWAYS_EXACT_DRAWS = 200_000
#: Estimated bytes per evaluated batch and response of an exact method (ids, probabilities,
#: the multiset tuples they are built from, per-draw coefficients).
BYTES_PER_DRAWN_RESPONSE = 32
#: The relative standard error ``‖SE(E ĝ)‖ / ‖∇J‖`` that ``auto`` reaches by default.
TARGET_RSE = 0.01
#: Monte Carlo batches of the pilot run that measures an estimator's spread.
PILOT_SAMPLES = 512
#: Monte Carlo batches when neither ``num_samples`` nor a precision asks for more.
DEFAULT_NUM_SAMPLES = 4096


def samples_for(pilot_rse: float, target_rse: float, *, pilot: int = PILOT_SAMPLES) -> int:
    """Monte Carlo batches that reach ``target_rse``, from a pilot of ``pilot`` batches.

    Parameters
    ----------
    pilot_rse : float
        The pilot's :attr:`~tokenmdp.exact.Moments.relative_se`.
    target_rse : float
        The precision asked, ``> 0``.
    pilot : int
        The pilot's batches.

    Returns
    -------
    int
        ``max(DEFAULT_NUM_SAMPLES, ceil(pilot · (pilot_rse / target_rse)²))``.
    """
    if not math.isfinite(pilot_rse):
        return DEFAULT_NUM_SAMPLES
    return max(DEFAULT_NUM_SAMPLES, math.ceil(pilot * (pilot_rse / target_rse) ** 2))

def choose(method, steps, mdp, mu_probs, group_size, prompts_per_batch, filter_groups,
            max_exact_draws, memory_budget=None, *, num_samples=4096, mc_cost=1.0,
            ordered=False, typed=True) -> str:
    """Resolve ``auto`` / ``exact`` to a concrete method, check the requested one applies and
    that it fits the memory budget (refused from its closed-form count).

    Parameters
    ----------
    method : str
        One of :data:`METHODS`.
    steps : StepGradients or LossFnGradients
        The per-batch gradients of the estimator (its types, for the exchangeability cost).
    mdp : TokenMDP
        The MDP.
    mu_probs : Tensor
        The sampler's sequence probabilities.
    group_size, prompts_per_batch : int
        ``G`` and the groups per batch.
    filter_groups : bool
        DAPO's dynamic sampling.
    max_exact_draws : int or None
        The cap of ``auto`` on exact batches.
    memory_budget : int, float or str, optional
        The budget (:func:`~tokenmdp.exact.world.budget.memory_budget`).
    num_samples : int
        The Monte Carlo run ``auto`` compares the exact cost with.
    mc_cost : float
        Exact batches one Monte Carlo batch costs.
    ordered : bool
        Whether the enumeration takes every ordered draw.
    typed : bool
        Whether the gradient is an Estimator's (whose types the exchangeability method reads).

    Returns
    -------
    str
        ``"enumeration"``, ``"exchangeability"`` or ``"monte_carlo"``.
    """
    width = group_size * prompts_per_batch
    if method == "monte_carlo":
        return check_sampled(num_samples, width, group_size, prompts_per_batch, memory_budget)
    if method == "exchangeability" and not (typed and not ordered):
        raise ValueError("method: exchangeability needs an Estimator and order_invariant=True "
                         "(it reduces the other samples to an estimator's types)")
    by_types = typed and reduces_to_types(steps.estimator)
    if method == "exchangeability" and not by_types:
        raise ValueError(f"method: exchangeability is not exact for {steps.estimator.name!r}: a "
                         "part couples the sequences of a group beyond their types "
                         "(couples_sequences); use method='enumeration'")
    exchangeable_ok = (prompts_per_batch == 1 and not filter_groups and group_size >= 2
                       and not ordered and by_types)
    if method == "exchangeability" and not exchangeable_ok:
        raise ValueError("method: exchangeability needs prompts_per_batch=1, group_size >= 2 "
                         "and no filter_groups")
    count = count_ordered_draws if ordered else count_draws
    costs = {"enumeration": count(mdp, group_size, prompts_per_batch)}
    if exchangeable_ok and method != "enumeration":
        costs["exchangeability"] = exchangeability_cost(mdp, _type_keys(steps), mu_probs,
                                                        group_size)
    if method in costs:
        best = method
    else:
        best = min(costs, key=costs.get)
    need = costs[best] * (BYTES_PER_DRAWN_RESPONSE * width + 16)
    if method == "auto":
        # exact is never less precise: Monte Carlo only when exact would take longer (batches
        # times their relative cost), would not fit the budget, or exceeds a cap the caller set
        slower = costs[best] > max(mc_cost * num_samples, ALWAYS_EXACT_DRAWS)
        capped = max_exact_draws is not None and costs[best] > max_exact_draws
        if slower or capped or need > budget.memory_budget(memory_budget):
            return check_sampled(num_samples, width, group_size, prompts_per_batch,
                                  memory_budget)
    budget.check_budget(f"method={best}, group_size={group_size}, prompts_per_batch="
                        f"{prompts_per_batch}, {mdp.responses_per_prompt} responses per prompt",
                        costs[best], "batches", need, memory_budget=memory_budget)
    return best


def check_sampled(num_samples, width, group_size, prompts_per_batch, memory_budget) -> str:
    """``"monte_carlo"``, once its sampled batches are known to fit the memory budget.

    Parameters
    ----------
    num_samples : int
        The sampled batches.
    width : int
        Responses per batch (``group_size · prompts_per_batch``).
    group_size, prompts_per_batch : int
        Named by the refusal.
    memory_budget : int, float or str, optional
        The budget (:func:`~tokenmdp.exact.world.budget.memory_budget`).

    Returns
    -------
    str
        ``"monte_carlo"``.

    Raises
    ------
    ValueError
        The batches (their ids and per-block work, as an exact draw's) exceed the budget.
    """
    budget.check_budget(f"method=monte_carlo, num_samples={num_samples}, group_size={group_size}, "
                        f"prompts_per_batch={prompts_per_batch}", num_samples, "sampled batches",
                        num_samples * (BYTES_PER_DRAWN_RESPONSE * width + 16),
                        memory_budget=memory_budget)
    return "monte_carlo"
