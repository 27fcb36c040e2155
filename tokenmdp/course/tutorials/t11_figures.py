"""Tutorial 11's figure: the law of a tree's leaves against the sampler's, exact beside Monte Carlo.

:func:`leaf_law_figure` draws, for each schedule, the difference between the leaf law (exact, as
bars) and the sampler's response law, with the Monte Carlo estimate of the same difference and
its two-standard-error bars: a leaf is a sample of ``μ`` where the bars vanish.
"""

from __future__ import annotations

from collections.abc import Mapping

import matplotlib.pyplot as plt
import torch

__all__ = ["leaf_law_figure"]


def leaf_law_figure(mu_N: torch.Tensor, panels: Mapping[str, tuple], *, labels=None):
    """One panel per schedule: ``q(y) − μ(y)`` over the responses ``y``.

    Parameters
    ----------
    mu_N : Tensor ``[N]``
        The sampler's law of one response (``D(x) μ(y | x)``).
    panels : mapping of str to (Tensor ``[N]``, Tensor ``[N]``, Tensor ``[N]``)
        Title → (exact leaf law, Monte Carlo estimate, its standard errors).
    labels : sequence of str, optional
        The responses' names (x-axis ticks).

    Returns
    -------
    matplotlib.figure.Figure
    """
    n = len(panels)
    fig, axes = plt.subplots(n, 1, figsize=(9, 2.2 * n), sharex=True, squeeze=False)
    x = torch.arange(mu_N.numel()).numpy()
    mu = mu_N.detach().numpy()
    for ax, (title, (exact, sampled, se)) in zip(axes[:, 0], panels.items()):
        exact, sampled, se = (t.detach().numpy() for t in (exact, sampled, se))
        ax.bar(x, exact - mu, color="#4c72b0", alpha=0.6, label="exact q − μ")
        ax.errorbar(x, sampled - mu, yerr=2 * se, fmt="o", ms=3, color="#c44e52",
                    label="Monte Carlo ± 2 s.e.")
        ax.axhline(0.0, color="gray", lw=0.8)
        ax.set_title(title, fontsize=9)
        ax.set_ylabel("q(y) − μ(y)")
    axes[0, 0].legend(fontsize=8, loc="upper right")
    if labels is not None:
        axes[-1, 0].set_xticks(x, labels, rotation=90, fontsize=7)
    axes[-1, 0].set_xlabel("response y (prompt | tokens, E = EOS)")
    fig.tight_layout()
    return fig
