"""The exact world: an enumerable token MDP, its policies and its ground truth (float64).

See :mod:`tokenmdp.exact.mdp` for the MDP and its state/terminal indexing,
:mod:`tokenmdp.exact.policies` for the policy protocol, :mod:`tokenmdp.exact.ground_truth` for
``J``, ``∇J``, values, KL and entropy, :mod:`tokenmdp.exact.behavior` for stale and
inference-engine behaviour policies, :mod:`tokenmdp.exact.sampling` for Monte Carlo draws, and
the lab on top: :mod:`tokenmdp.exact.moments` (exact bias and variance of any estimator),
:mod:`tokenmdp.exact.first_order` (the trust-region approximation) and
:mod:`tokenmdp.exact.length_bias` (what each aggregation ascends).
"""

from tokenmdp.exact import rewards
from tokenmdp.exact.behavior import InferencePolicy, inference_copy, round_logits, stale_copy
from tokenmdp.exact.first_order import PathPoint, first_order_path, trust_region_bound
from tokenmdp.exact.ground_truth import (
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
from tokenmdp.exact.group_draws import count_draws
from tokenmdp.exact.length_bias import (
    aggregation_gradients,
    expected_length,
    length_drift,
    length_normalized_objective,
)
from tokenmdp.exact.mdp import TokenMDP
from tokenmdp.exact.moments import Moments, MomentsWorkspace, moments
from tokenmdp.exact.policies import (
    LogLinearPolicy,
    NeuralPolicy,
    PrefixPolicy,
    TabularPolicy,
    check_policy,
)
from tokenmdp.exact.sampling import sample
from tokenmdp.exact.training import ExactTrainingRun, train_exact  # noqa: F401  (own API page)

__all__ = [
    "TokenMDP", "rewards", "PrefixPolicy", "TabularPolicy", "LogLinearPolicy", "NeuralPolicy",
    "check_policy", "objective", "gradient", "flat_grad", "sequence_logprobs", "sequence_probs",
    "state_logprobs", "state_visitation", "values", "ValueTables", "token_entropy", "sequence_kl",
    "surrogate", "InferencePolicy", "inference_copy", "stale_copy", "round_logits", "sample",
    "Moments", "MomentsWorkspace", "moments", "count_draws", "PathPoint", "first_order_path",
    "trust_region_bound", "expected_length", "length_normalized_objective",
    "aggregation_gradients", "length_drift",
]
