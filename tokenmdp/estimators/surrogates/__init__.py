"""Surrogates: the per-token term whose weighted sum is the (negated) loss.

Floors, top to bottom::

    covariance, ctpo, sequence
    clipped, per_decision, soft, trust_region_masks
    token

* :mod:`~tokenmdp.estimators.surrogates.token` — the :class:`Surrogate` protocol, REINFORCE
  and the token ratio;
* :mod:`~tokenmdp.estimators.surrogates.clipped` — PPO's clip (clip-higher, dual clip), CISPO,
  MiniRL;
* :mod:`~tokenmdp.estimators.surrogates.sequence` — sequence IS, GSPO, GSPO-token;
* :mod:`~tokenmdp.estimators.surrogates.soft` — SAPO, GMPO, an entropy bonus;
* :mod:`~tokenmdp.estimators.surrogates.trust_region_masks` — DPPO's masks, OPSM;
* :mod:`~tokenmdp.estimators.surrogates.per_decision` — per-decision IS (the cumulative ratio);
* :mod:`~tokenmdp.estimators.surrogates.ctpo` — CTPO-LA's clipped cumulative ratio;
* :mod:`~tokenmdp.estimators.surrogates.covariance` — Clip-Cov and KL-Cov.

It imports the batch, the library's tensor helpers and :mod:`~tokenmdp.estimators.kl`; names
are reached through :mod:`tokenmdp.estimators`.
"""
