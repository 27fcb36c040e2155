"""The registry of published estimators: names → compositions, with papers and aliases.

A new published estimator is an entry here, built from the parts below; a peer framework's
defaults are entries of their own (``*_verl``, ``cispo_tinker``, ``*_trl_mis``).

Floors, top to bottom::

    lookup
    trees
    baselines
    zoo
    classic
    entry

* :mod:`~tokenmdp.estimators.registry.entry` — :class:`Entry`, registration and the variant
  rule (±TIS/MIS);
* :mod:`~tokenmdp.estimators.registry.classic` — REINFORCE to MiniRL and their variants;
* :mod:`~tokenmdp.estimators.registry.zoo` — the newer surrogates (SAPO, DPPO, GMPO, OPSM, ...);
* :mod:`~tokenmdp.estimators.registry.baselines` — the newer advantages (REINFORCE++, OPO, ...);
* :mod:`~tokenmdp.estimators.registry.trees` — estimators that need a tree batch (TreeRL,
  VinePPO-style values, node-value differences, GRPO/RLOO over a tree's leaves);
* :mod:`~tokenmdp.estimators.registry.lookup` — :func:`~tokenmdp.estimators.get`,
  :func:`~tokenmdp.estimators.names`, :func:`~tokenmdp.estimators.describe`,
  :func:`~tokenmdp.estimators.registry.lookup.resolve` (an estimator or its name).

The entry modules import each other in registration order (the order of
:func:`~tokenmdp.estimators.names`). It
imports :class:`~tokenmdp.estimators.Estimator` and the parts; never ``prepare`` or ``loss``,
which resolve names through it.
"""
