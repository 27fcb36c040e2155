"""Advantages: rewards and groups → the advantage of each sequence (or of each token).

Floors, top to bottom::

    tree_credit
    tree
    token
    baselines
    group

* :mod:`~tokenmdp.estimators.advantages.group` — none, group mean, group mean/std,
  leave-one-out, batch normalization (the :class:`Advantage` protocol);
* :mod:`~tokenmdp.estimators.advantages.baselines` — REINFORCE++-baseline (token-weighted
  whitening), TRL's batch-std GRPO, OPO's optimal baseline;
* :mod:`~tokenmdp.estimators.advantages.token` — per-token advantages through ``prepare``:
  reward-to-go, a KL in every token's reward;
* :mod:`~tokenmdp.estimators.advantages.tree` — advantages of a tree batch
  (:mod:`tokenmdp.trees`) from node values: leaf-level group advantages, ``V̂(s_{t+1}) -
  V̂(s_t)``, ``R - V̂(s_t)``; :mod:`~tokenmdp.estimators.advantages.tree_credit` — TreeRL's
  process reward and VinePPO-style values from a tree's other leaves.

It imports the batch, :mod:`tokenmdp.trees` and the library's tensor helpers only; names are
reached through :mod:`tokenmdp.estimators`.
"""
