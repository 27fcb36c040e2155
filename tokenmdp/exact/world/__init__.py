"""The world: the token MDP, its rewards and policies, behaviour copies and the ground truth.

Floors, top to bottom::

    behavior, chi_square
    ground_truth
    _tree_objective, sampling
    policies
    mdp, rewards
    _enumeration, _hashing, budget, engine_mismatch

* :mod:`~tokenmdp.exact.world.budget` — the memory budget: oversized worlds refused before
  allocating;
* :mod:`~tokenmdp.exact.world.mdp` — :class:`~tokenmdp.exact.TokenMDP`: prompts, EOS,
  truncation, sizes, state indexing (its enumeration and batches in ``_enumeration``);
* :mod:`~tokenmdp.exact.world.rewards` — exact match, pattern, count, parity, length, random
  (hashed in ``_hashing``), overlong;
* :mod:`~tokenmdp.exact.world.policies` — the policy protocol; tabular, log-linear, neural;
* :mod:`~tokenmdp.exact.world.sampling` — Monte Carlo draws of responses;
* :mod:`~tokenmdp.exact.world.ground_truth` — ``J``, ``∇J`` (by one pass down the prefix tree,
  ``_tree_objective``), sequence probabilities, V/Q/A, KL, entropy, ``L_μ(π)``;
* :mod:`~tokenmdp.exact.world.engine_mismatch` — the engine mismatch modes (fresh, fixed,
  heavy-tailed, growing): :class:`~tokenmdp.exact.EngineMismatch` and the per-(context, token)
  perturbation the rollout engine and the copies below share;
* :mod:`~tokenmdp.exact.world.behavior` — stale copies (``π_old``) and inference-engine copies
  (``μ``); :mod:`~tokenmdp.exact.world.chi_square` — exact χ² per token, response and group.

It imports the narrow waist only; names are reached through :mod:`tokenmdp.exact`.
"""
