"""Exact at long lengths: a finite-state token MDP whose reward is computed by an automaton.

Responses are paths through a lattice of ``T × K`` nodes (position, automaton state), so the
ground truth and the moments of token-level estimators are forward/backward recursions in
``O(T·K·V)`` instead of sums over ``V^T`` responses (docs: Concepts › Long responses):

* :mod:`~tokenmdp.exact.lattice.automaton` — reward automata (exact match, token counts,
  "a pattern appeared");
* :mod:`~tokenmdp.exact.lattice.mdp` — :class:`LatticeMDP` and its enumerable twin
  (:func:`to_token_mdp`);
* :mod:`~tokenmdp.exact.lattice.policy` and :mod:`~tokenmdp.exact.lattice.behavior` — policies
  tabular over ``(t, z)``, stale and engine-like copies;
* :mod:`~tokenmdp.exact.lattice.shared` — policies whose positions share parameters
  (``logits = features @ W``; time-homogeneous by default);
* :mod:`~tokenmdp.exact.lattice.ground_truth` — ``J``, ``∇J``, values, visitation, KL, χ²,
  entropy, the trust-region surrogate and bound;
* :mod:`~tokenmdp.exact.lattice.coefficients` and :mod:`~tokenmdp.exact.lattice.structure` —
  what an estimator computes per token, read off the library, and the form (kind, normalizer)
  in which the lattice computes it exactly (:func:`exact_support` says why not otherwise);
* :mod:`~tokenmdp.exact.lattice.laplace` — random normalizers ``1/N`` and ``1/N²`` as sums of
  exponentials with a proven error bound (the Laplace identity);
* :mod:`~tokenmdp.exact.lattice.sweep` and :mod:`~tokenmdp.exact.lattice.node_passes` —
  tilted forward/backward passes under ``μ κ^p e^{−sν}`` for every Laplace node at once, and
  one node's tables and the full ``E[X Xᵀ]`` of small lattices;
* :mod:`~tokenmdp.exact.lattice.second_moments` — one response's ``E‖DᵀX‖²`` (and its
  matrix) in a policy's own parameter, by vector-valued forward messages;
* :mod:`~tokenmdp.exact.lattice.exact_moments` and :mod:`~tokenmdp.exact.lattice.moments` —
  exact mean and variance of estimators over class counts (Monte Carlo on the lattice where
  not exact).

Floors, top to bottom::

    behavior, moments
    exact_moments
    node_passes, second_moments
    sweep
    ground_truth, shared
    monte_carlo, policy, structure
    mdp
    automaton, coefficients, laplace

It imports the exact world's MDP, policies and behaviour copies, the lab's
:class:`~tokenmdp.exact.Moments` and :mod:`tokenmdp.estimators`; never an analysis.
"""

from tokenmdp.exact.lattice.automaton import (
    RewardAutomaton,
    exact_match,
    pattern_appeared,
    token_count,
)
from tokenmdp.exact.lattice.behavior import inference_copy, stale_copy
from tokenmdp.exact.lattice.coefficients import (
    length_weights,
    token_coefficients,
    token_table,
    weight_form,
)
from tokenmdp.exact.lattice.exact_moments import form_moments
from tokenmdp.exact.lattice.ground_truth import (
    LatticeValues,
    chi_square,
    entropy,
    expected_length,
    gradient,
    log_second_moment,
    max_node_tv,
    objective,
    sequence_kl,
    surrogate,
    transition_matrices,
    trust_region_bound,
    values,
    visitation,
)
from tokenmdp.exact.lattice.laplace import LaplaceRule, laplace_rule
from tokenmdp.exact.lattice.mdp import LatticeMDP, to_token_mdp
from tokenmdp.exact.lattice.moments import moments
from tokenmdp.exact.lattice.monte_carlo import group_batch, sample, step_gradients
from tokenmdp.exact.lattice.policy import LatticePolicy, as_prefix_policy, check_lattice_policy
from tokenmdp.exact.lattice.second_moments import member_square, member_square_matrix
from tokenmdp.exact.lattice.shared import (
    SharedLatticePolicy,
    check_features,
    node_features,
    state_features,
)
from tokenmdp.exact.lattice.structure import LatticeForm, exact_support, lattice_form

__all__ = [
    "RewardAutomaton", "exact_match", "token_count", "pattern_appeared", "LatticeMDP",
    "to_token_mdp", "LatticePolicy", "check_lattice_policy", "as_prefix_policy", "stale_copy",
    "inference_copy", "transition_matrices", "visitation", "expected_length", "objective",
    "gradient", "values", "LatticeValues", "entropy", "sequence_kl", "log_second_moment",
    "chi_square", "surrogate", "max_node_tv", "trust_region_bound", "moments", "exact_support",
    "length_weights", "token_coefficients", "sample", "group_batch", "step_gradients",
    "weight_form", "token_table", "LatticeForm", "lattice_form", "LaplaceRule", "laplace_rule",
    "SharedLatticePolicy", "state_features", "node_features", "check_features", "member_square",
    "member_square_matrix", "form_moments",
]
