"""Corrections of the training–inference gap: the detached factor ``w = π_old / μ`` and its kin.

Floors, top to bottom::

    rejection, self_normalized
    diagnostics, factor

* :mod:`~tokenmdp.estimators.corrections.factor` — none, IS, truncated IS, masked IS at the
  token, sequence and geometric-mean levels;
* :mod:`~tokenmdp.estimators.corrections.rejection` — verl's rejection masks (k1/k2/k3 bands
  per token or sequence, factor 1);
* :mod:`~tokenmdp.estimators.corrections.self_normalized` — the weights over their step mean;
* :mod:`~tokenmdp.estimators.corrections.diagnostics` — the weights' effective sample size and
  χ² (the ``is_ess`` and ``is_chi2`` metrics).

It imports the batch and the library's tensor helpers only; names are reached through
:mod:`tokenmdp.estimators`.
"""
