"""One-line hints on the surprising rows of a comparison, each computed, none canned.

:func:`hints` looks for

* a clip band far narrower than the ratios it meets (:func:`clip_band_share`: most of the tokens
  or sequences sampled from ``μ`` have ``π_θ/π_old`` outside ``[1 − ε_low, 1 + ε_high]``);
* estimators whose moments coincide (what distinguishes them never acts on this MDP);
* an estimator whose bias comes mostly from the training–inference discrepancy (its bias when the
  same estimator samples from ``π_old`` instead of ``μ``);
* a negative cosine (the expected step lowers ``J``);
* a raw-MSE winner that wins only because its mean gradient is short.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tokenmdp import estimators
from tokenmdp.estimators import GSPO, GSPOToken
from tokenmdp.exact import Moments, sequence_probs
from tokenmdp.reports.comparison import Lab, measure, rescaled_mse

__all__ = ["clip_band_share", "coinciding", "hints"]

#: A clip band is "far below the staleness" when at least this share lies outside it.
CLIP_SHARE = 0.5
#: Two estimators coincide when their means and total variances agree to this relative tolerance.
COINCIDE_RTOL = 1e-12
#: The discrepancy hint needs at least this relative bias (smaller biases are not surprising).
MIN_RELATIVE_BIAS = 0.05
#: A raw-MSE winner is "short" when ``‖E ĝ‖ < SHORT_MEAN ‖∇J‖``.
SHORT_MEAN = 0.5
_COMPONENTS = ("surrogate", "advantage", "correction", "aggregation", "kl")


def clip_band_share(lab: Lab, estimator: estimators.Estimator) -> tuple[float, float, str] | None:
    """How much of what ``μ`` samples falls outside the estimator's clip band.

    The ratio is ``r_t = π_θ/π_old`` per token, or GSPO's ``s = exp(mean_t log r_t)`` per sequence.

    Parameters
    ----------
    lab : Lab
        The built comparison (``π_θ``, ``π_old``, ``μ`` and the MDP enumerated).
    estimator : Estimator
        Its surrogate's ``eps_low`` / ``eps_high`` give the band.

    Returns
    -------
    (share, mean_deviation, unit) or None
        ``share``: the ``μ``-expected fraction of loss tokens (``unit = "tokens"``) or of sequences
        (``"sequences"``) with a ratio outside ``[1 − ε_low, 1 + ε_high]``; ``mean_deviation``: the
        ``μ``-expected ``|ratio − 1|`` over the same units. None for surrogates without a band.
    """
    sur = estimator.surrogate
    if not (hasattr(sur, "eps_low") and hasattr(sur, "eps_high")):
        return None
    mdp = lab.mdp
    enum = mdp.enumerate()                                   # one sequence per row
    with torch.no_grad():
        log_r_RC = lab.policy.token_logprobs(enum) - lab.old.token_logprobs(enum)
        mu_S = sequence_probs(mdp, lab.behavior) * mdp.prompt_probs[enum.prompt_index]
    log_r_RC = torch.where(enum.loss_mask, log_r_RC, 0.0)
    lower, upper = 1.0 - sur.eps_low, 1.0 + sur.eps_high
    if isinstance(sur, (GSPO, GSPOToken)):
        ratio_S = (enum.sequence_sum(log_r_RC) / enum.length.clamp(min=1)).exp()
        outside_S = ((ratio_S < lower) | (ratio_S > upper)).to(torch.float64)
        dev_S = (ratio_S - 1).abs()
        total = mu_S.sum()
        return float(mu_S @ outside_S / total), float(mu_S @ dev_S / total), "sequences"
    ratio_RC = log_r_RC.exp()
    counted = enum.loss_mask.to(torch.float64)
    outside_RC = ((ratio_RC < lower) | (ratio_RC > upper)).to(torch.float64) * counted
    tokens = mu_S @ enum.sequence_sum(counted)
    return (float(mu_S @ enum.sequence_sum(outside_RC) / tokens),
            float(mu_S @ enum.sequence_sum((ratio_RC - 1).abs() * counted) / tokens), "tokens")


def _same(a: Moments, b: Moments) -> bool:
    scale = float(a.true_gradient.norm())
    var_scale = max(a.total_variance, b.total_variance, 1e-300)
    return (float((a.mean - b.mean).abs().max()) <= COINCIDE_RTOL * scale
            and abs(a.total_variance - b.total_variance) <= COINCIDE_RTOL * var_scale)


def coinciding(names: Sequence[str], results: Sequence[Moments]) -> list[list[str]]:
    """Groups (two or more names, in table order) whose moments coincide to ``COINCIDE_RTOL``.

    Parameters
    ----------
    names : sequence of str
        The estimators' names, in table order.
    results : sequence of Moments
        Their moments, aligned with ``names``.

    Returns
    -------
    list of list of str
        One list per group of coinciding names (empty when no two coincide).
    """
    groups: list[list[int]] = []
    for i in range(len(names)):
        for group in groups:
            if _same(results[group[0]], results[i]):
                group.append(i)
                break
        else:
            groups.append([i])
    return [[names[i] for i in g] for g in groups if len(g) > 1]


def _differences(names: Sequence[str]) -> str:
    """The components that differ between registry estimators, with their settings for two."""
    ests = [estimators.get(n) for n in names]

    def text(est, part):
        value = getattr(est, part)
        if value is None:
            return "none"
        return value.value if part == "aggregation" else value.describe()

    parts = [p for p in _COMPONENTS if len({text(e, p) for e in ests}) > 1]
    if len(ests) == 2:
        return "; ".join(f"{p}: {text(ests[0], p)} vs {text(ests[1], p)}" for p in parts)
    return ", ".join(parts)


def hints(lab: Lab, names: Sequence[str], results: Sequence[Moments]) -> list[str]:
    """The hints for a comparison of registry estimators ``names`` with moments ``results``.

    The discrepancy hint re-measures an estimator with ``μ = π_old``; it is given only when the
    scenario has a discrepancy and the moments are exact (not Monte Carlo).

    Parameters
    ----------
    lab : Lab
        The built comparison the moments were computed in.
    names : sequence of str
        Registry names, in table order.
    results : sequence of Moments
        Their moments, aligned with ``names``.

    Returns
    -------
    list of str
        One line per finding, each naming the estimators it is about (empty when none).
    """
    out = []
    clipped: dict[str, list[str]] = {}                      # one line per distinct finding
    for name in names:
        found = clip_band_share(lab, estimators.get(name))
        if found is not None and found[0] >= CLIP_SHARE:
            share, dev, unit = found
            sur = estimators.get(name).surrogate
            width = min(sur.eps_low, sur.eps_high)
            text = (f"{share:.0%} of the {unit} sampled from μ have π_θ/π_old outside the clip "
                    f"band [1−{sur.eps_low:g}, 1+{sur.eps_high:g}] (mean |ratio − 1| = {dev:.2g}, "
                    f"{dev / width:.3g}× its narrower side): the clip acts on "
                    f"{'almost all' if share > 0.9 else 'most'} samples")
            clipped.setdefault(text, []).append(name)
    out += [f"{', '.join(group)}: {text}" for text, group in clipped.items()]
    for group in coinciding(names, results):
        diff = _differences(group)
        what = f" ({diff})" if diff else ""
        out.append(f"{' = '.join(group)}: identical moments (to {COINCIDE_RTOL:g}); what differs"
                   f"{what} never acts on this MDP and scenario")
    if lab.setup.discrepant and lab.behavior is not lab.old:
        for name, m in zip(names, results):
            if m.method == "monte_carlo" or m.relative_bias < MIN_RELATIVE_BIAS:
                continue
            without = measure(lab, estimators.get(name), behavior=lab.old)
            part = float((m.mean - without.mean).norm() / m.true_gradient.norm())
            if part > without.relative_bias:
                out.append(f"{name}: its bias is mostly the training–inference discrepancy: "
                           f"rel. bias {m.relative_bias:.3g} sampling from μ, "
                           f"{without.relative_bias:.3g} sampling from π_old (the discrepancy "
                           f"moves E ĝ by {part:.3g} ‖∇J‖)")
    downhill = [f"{name} ({m.cosine:.3g})" for name, m in zip(names, results) if m.cosine < 0]
    if downhill:
        out.append(f"cosine < 0 for {', '.join(downhill)}: the expected step lowers J, so c* = 0 "
                   f"and no step at all (MSE = ‖∇J‖²) is better")
    if len(names) > 1:
        raw = min(range(len(names)), key=lambda i: results[i].mse)
        scaled = min(range(len(names)), key=lambda i: rescaled_mse(results[i])[1])
        m = results[raw]
        ratio = float(m.mean.norm() / m.true_gradient.norm())
        if raw != scaled and ratio < SHORT_MEAN:
            out.append(f"{names[raw]} has the lowest raw MSE only because its mean gradient is "
                       f"{ratio:.2g} × ‖∇J‖ long; after the best rescaling c*, {names[scaled]} "
                       f"is best (MSE(c*) {rescaled_mse(results[scaled])[1]:.4g} vs "
                       f"{rescaled_mse(m)[1]:.4g})")
    return out
