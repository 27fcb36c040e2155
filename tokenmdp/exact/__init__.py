"""The exact world: an enumerable token MDP, its policies, its ground truth and the exact lab.

This package is the exact world's front door: ``from tokenmdp.exact import TokenMDP, moments``.

Floors, top to bottom::

    analysis, branching, lattice
    lab
    world

* :mod:`~tokenmdp.exact.world` — the MDP and its state/terminal indexing, rewards, the policy
  protocol (tabular, log-linear, neural), stale and inference-engine behaviour policies (with
  the engine mismatch modes, :class:`~tokenmdp.exact.EngineMismatch`), the
  ground truth (``J``, ``∇J``, values, KL, entropy, χ²) and Monte Carlo draws;
* :mod:`~tokenmdp.exact.lab` — :func:`~tokenmdp.exact.moments`: the exact mean, variance and
  bias of any estimator or loss callable, by enumeration, exchangeability or streamed Monte
  Carlo, with its :class:`~tokenmdp.exact.Moments` result;
* :mod:`~tokenmdp.exact.analysis` — what the lab answers: the trust-region approximation
  (first order), length bias, the KL gradients, training by sampled updates;
* :mod:`~tokenmdp.exact.branching` — branching (tree) rollouts: fork schedules, tree samplers,
  the exact law of trees and the moments of any estimator over tree draws, at equal
  generated-token budget against i.i.d. groups;
* :mod:`~tokenmdp.exact.lattice` — exact at 4096-token responses: reward automata on a
  ``(t, z)`` lattice, recursions instead of enumeration.

It imports the narrow waist and :mod:`tokenmdp.estimators`; never the model, the trainer or a
front end (the trainer's model is analysed exactly by :mod:`tokenmdp.rl`, which imports this).
"""

from tokenmdp.exact.analysis.first_order import PathPoint, first_order_path, trust_region_bound
from tokenmdp.exact.analysis.length_bias import (
    aggregation_gradients,
    expected_length,
    length_drift,
    length_normalized_objective,
)
from tokenmdp.exact.analysis.training import ExactTrainingRun, train_exact  # noqa: F401  (own API page)
from tokenmdp.exact.lab.group_draws import count_draws
from tokenmdp.exact.lab.moments import MomentsWorkspace, moments
from tokenmdp.exact.lab.moments_result import Moments
from tokenmdp.exact.world import rewards
from tokenmdp.exact.world.behavior import InferencePolicy, inference_copy, round_logits, stale_copy
from tokenmdp.exact.world.engine_mismatch import EngineMismatch
from tokenmdp.exact.world.ground_truth import (
    ValueTables,
    flat_grad,
    gradient,
    objective,
    sequence_kl,
    sequence_logprobs,
    sequence_probs,
    state_logprobs,
    state_visitation,
    surrogate,
    token_entropy,
    values,
)
from tokenmdp.exact.world.mdp import TokenMDP
from tokenmdp.exact.world.policies import (
    LogLinearPolicy,
    NeuralPolicy,
    PrefixPolicy,
    TabularPolicy,
    check_policy,
)
from tokenmdp.exact.world.sampling import sample

__all__ = [
    "TokenMDP", "rewards", "PrefixPolicy", "TabularPolicy", "LogLinearPolicy", "NeuralPolicy",
    "check_policy", "objective", "gradient", "flat_grad", "sequence_logprobs", "sequence_probs",
    "state_logprobs", "state_visitation", "values", "ValueTables", "token_entropy", "sequence_kl",
    "surrogate", "InferencePolicy", "inference_copy", "stale_copy", "round_logits",
    "EngineMismatch", "sample",
    "Moments", "MomentsWorkspace", "moments", "count_draws", "PathPoint", "first_order_path",
    "trust_region_bound", "expected_length", "length_normalized_objective",
    "aggregation_gradients", "length_drift",
]
