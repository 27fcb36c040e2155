"""The exact lab: :func:`~tokenmdp.exact.moments`, the exact bias and variance of any estimator.

Floors, top to bottom::

    moments
    method_choice
    _world_tables, exchangeability, loss_fn_gradients
    monte_carlo, step_gradients
    _stacked, _watch, group_draws, moments_result

* :mod:`~tokenmdp.exact.lab.moments_result` — :class:`~tokenmdp.exact.Moments`, the figures,
  from exact sums or Monte Carlo draws (with standard errors);
* :mod:`~tokenmdp.exact.lab.group_draws` — enumerated and sampled group draws, exchangeable
  types; ``_stacked`` — many steps as one stacked batch;
* :mod:`~tokenmdp.exact.lab.step_gradients` — per-batch estimator gradients for many batches at
  once; :mod:`~tokenmdp.exact.lab.loss_fn_gradients` — the same for any loss callable;
* :mod:`~tokenmdp.exact.lab.exchangeability` — exact moments from response types, and their
  cost; :mod:`~tokenmdp.exact.lab.monte_carlo` — streamed Monte Carlo, running sums;
* :mod:`~tokenmdp.exact.lab.method_choice` — which method ``auto`` runs: exact when cheaper,
  else the Monte Carlo run that reaches the asked precision (a pilot measures the spread);
* :mod:`~tokenmdp.exact.lab.moments` — :func:`~tokenmdp.exact.moments` and
  :class:`~tokenmdp.exact.MomentsWorkspace` (its tables in ``_world_tables``, what it watches
  in ``_watch``): the method chosen, the budget checked.

It imports the world and :mod:`tokenmdp.estimators`; names are reached through
:mod:`tokenmdp.exact`.
"""
