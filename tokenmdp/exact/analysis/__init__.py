"""What the exact lab answers: first order, length bias, KL gradients, training.

Floors, top to bottom::

    first_order, kl_gradients, length_bias, training

* :mod:`~tokenmdp.exact.analysis.first_order` — the trust-region approximation along a path,
  and its bound;
* :mod:`~tokenmdp.exact.analysis.length_bias` — what each aggregation ascends; length drift
  under ascent;
* :mod:`~tokenmdp.exact.analysis.kl_gradients` — the gradients a KL penalty could mean (reverse,
  forward, per state), and the one it delivers;
* :mod:`~tokenmdp.exact.analysis.training` — :func:`~tokenmdp.exact.analysis.training.train_exact`: sampled
  updates of any estimator with the exact ``J`` after each.

Each imports the world and the lab, none another analysis; names are reached through
:mod:`tokenmdp.exact`.
"""
