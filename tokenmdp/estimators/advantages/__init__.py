"""Advantages: rewards and groups → the advantage of each sequence (or of each token).

Floors, top to bottom::

    token
    baselines
    group

* :mod:`~tokenmdp.estimators.advantages.group` — none, group mean, group mean/std,
  leave-one-out, batch normalization (the :class:`Advantage` protocol);
* :mod:`~tokenmdp.estimators.advantages.baselines` — REINFORCE++-baseline (token-weighted
  whitening), TRL's batch-std GRPO, OPO's optimal baseline;
* :mod:`~tokenmdp.estimators.advantages.token` — per-token advantages through ``prepare``:
  reward-to-go, a KL in every token's reward.

It imports the batch and the library's tensor helpers only; names are reached through
:mod:`tokenmdp.estimators`.
"""
