"""What the exact lab reports to a reader: the compare table and its hints, estimator cards, plots.

Floors, top to bottom::

    cards, hints
    card_math, comparison, plots
    latex_factors
    latex_terms

* :mod:`~tokenmdp.reports.comparison` — what ``tokenmdp compare`` computes: the setup, ``c*``
  and ``MSE(c*)``, the legend;
* :mod:`~tokenmdp.reports.hints` — the computed one-line hints under the compare table;
* :mod:`~tokenmdp.reports.cards` — estimator cards (terminal and docs) with a live row;
* :mod:`~tokenmdp.reports.card_math` — an estimator's loss in LaTeX, composed from its parts
  (:mod:`~tokenmdp.reports.latex_terms`: the surrogates' terms;
  :mod:`~tokenmdp.reports.latex_factors`: advantages, corrections, KL penalties);
* :mod:`~tokenmdp.reports.plots` — comparison, first-order and length-drift plots.

It imports the exact world and the estimators; never the trainer or the course.
"""
