"""The fused loss path of :func:`~tokenmdp.estimators.loss` (not part of the public API).

Each part's kernel gives the loss value and one per-token gradient coefficient in one pass; a
small ``autograd.Function`` attaches the coefficient, so the backward pass is one product.

Floors, top to bottom::

    sequence
    kl, surrogates
    core

* :mod:`~tokenmdp.estimators.fused.core` — the request, the binding of kernels to parts and the
  ``autograd.Function``;
* :mod:`~tokenmdp.estimators.fused.surrogates`, :mod:`~tokenmdp.estimators.fused.kl`,
  :mod:`~tokenmdp.estimators.fused.sequence` — the kernels of the per-token surrogates, of the
  KL-in-loss term and of the sequence-coupled surrogates.

It imports the parts it serves (surrogates, corrections, KL) and nothing above them.
"""
