"""Tutorial 2's tables, figures and moment cache (baselines and groups).

* :func:`aligned_table` — rows under fixed-width columns, as text and HTML (:class:`Table`);
* :func:`response_table`, :func:`score_report`, :func:`variance_table`,
  :func:`advantage_table`, :func:`scaled_mean_table`, :func:`grpo_scale_table`,
  :func:`effective_reward_table`, :func:`peeking_bias_table` and :func:`group_size_table` —
  the notebook's printouts, from numbers and moments the notebook computed;
* :class:`ExactCache` — the exact moments of each (estimator, ``G``) pair, computed once;
* :func:`baseline_parabola_figure`, :func:`grpo_scale_figure` and
  :func:`bias_variance_figure` — its three figures, returned (the notebook shows them).
"""

from __future__ import annotations

import html
import math
from collections.abc import Mapping, Sequence

import torch

from tokenmdp.course.display import Printout, Table
from tokenmdp.exact import TokenMDP, moments

__all__ = ["ExactCache", "advantage_table", "aligned_table", "effective_reward_table", "group_size_table",
           "grpo_scale_table", "peeking_bias_table", "response_table",
           "scaled_mean_table", "score_report", "variance_table"]


def aligned_table(rows: Sequence[Sequence], columns: Sequence[tuple[str, int, str]], *,
                  title: str | None = None) -> Table:
    """Rows under right-aligned, fixed-width columns, one space apart.

    Parameters
    ----------
    rows : sequence of sequences
        One value per column: a number (formatted), a str (kept) or None (left blank).
    columns : sequence of (str, int, str)
        ``(header, width, format spec)`` of each column, e.g. ``("tr Cov", 10, ".6f")``.
    title : str, optional
        A line above the table (``""``: a blank line).

    Returns
    -------
    Table
        The aligned text, an HTML ``<table>``, and the rows as given.
    """
    return Table(columns, rows, title=title)


def response_table(mdp: TokenMDP, probs_N: torch.Tensor, J_P: torch.Tensor, J: float) -> Table:
    """Every response with its probability and reward, then each prompt's success rate and ``J``.

    Parameters
    ----------
    mdp : TokenMDP
    probs_N : Tensor ``[N]``
        ``π(y|x)`` of every response, in :meth:`TokenMDP.responses` order.
    J_P : Tensor ``[P]``
        ``J_x``, the success probability of each prompt.
    J : float
        The objective ``Σ_x D(x) J_x``.

    Returns
    -------
    Table
        Columns prompt, response (EOS spelled out), ``π(y|x)``, ``R``; the summary lines below.
    """
    rows = [(str(x), " ".join("EOS" if t == mdp.eos else str(t) for t in y), q, r)
            for (x, y), q, r in zip(mdp.responses(), probs_N.tolist(), mdp.rewards.tolist(),
                                    strict=True)]
    out = aligned_table(rows, [("prompt", 6, ""), ("response", 9, ""), ("π(y|x)", 8, ".4f"),
                               ("R", 3, ".0f")])
    summary = [f"prompt {mdp.prompts[x]}: D(x) = {float(mdp.prompt_probs[x]):.1f}, success "
               f"probability p_x = J_x = {float(J_P[x]):.4f}" for x in range(mdp.num_prompts)]
    summary.append(f"J = {J:.6f}")
    out.text += "\n" + "\n".join(summary)
    out.html += "<p>" + "<br>".join(html.escape(s) for s in summary) + "</p>"
    return out


def score_report(residuals: Mapping[str, torch.Tensor], g_P: torch.Tensor,
                 prompt_of_param: torch.Tensor, prompts: Sequence[tuple]) -> Table:
    """The score identities' residuals, and how each ``g_x`` stays on its prompt's logits.

    Parameters
    ----------
    residuals : mapping of str to Tensor
        A label and the residual of each identity (e.g. ``Σ_y π(y|x) σ(y)``, zero in exact
        arithmetic); a line shows its largest absolute entry.
    g_P : Tensor ``[P, D]``
        The per-prompt gradients ``g_x``.
    prompt_of_param : Tensor ``[D]``
        The prompt that owns each logit.
    prompts : sequence of tuple
        The prompts, for the row labels.

    Returns
    -------
    Table
        One line per residual, then one row per prompt: the norm of ``g_x`` and its largest
        entry outside the prompt's block of logits.
    """
    lines = [f"{'max |' + label + '|':<33}= {float(r.abs().max()):.1e}"
             for label, r in residuals.items()]
    rows = [(str(prompts[x]), float(g_P[x].norm()), float(g_P[x][prompt_of_param != x].abs().max()))
            for x in range(len(prompts))]
    lines += [f"g_x of prompt {p}: norm {n:.4f}, largest entry outside its block {o:.1e}"
              for p, n, o in rows]
    text = "\n".join(lines)
    return Printout(text, rows, ["prompt", "norm of g_x", "largest entry outside its block"])


class ExactCache:
    """The exact moments of each (estimator, ``G``) pair, computed once and kept.

    Several sections look at the same pairs; ``cache(name, G)`` is
    ``moments(mdp, policy, estimators[name], group_size=G, method="exact")``, computed on the
    first call. ``estimators`` is read at call time, so entries added to the same dict later
    are found.

    Parameters
    ----------
    mdp : TokenMDP
    policy : torch.nn.Module
        The policy ``π_θ`` (samples the groups and is differentiated).
    estimators : mapping of str to Estimator
        The estimators by name.
    """

    def __init__(self, mdp: TokenMDP, policy: torch.nn.Module, estimators: Mapping):
        self.mdp, self.policy, self.estimators = mdp, policy, estimators
        self._cache: dict = {}

    def __call__(self, name: str, group_size: int):
        """The exact moments of ``estimators[name]`` with groups of ``group_size``.

        Parameters
        ----------
        name : str
            A key of ``estimators``.
        group_size : int
            ``G``, the responses per group.

        Returns
        -------
        Moments
            As :func:`tokenmdp.exact.moments` returns them (the same object on every call).
        """
        if name not in self.estimators:
            raise ValueError(f"name: no estimator {name!r}; known: {sorted(self.estimators)}")
        key = (name, int(group_size))
        if key not in self._cache:
            self._cache[key] = moments(self.mdp, self.policy, self.estimators[name],
                                       group_size=int(group_size), method="exact")
        return self._cache[key]


def variance_table(rows: Sequence[tuple], *, label: str, label_width: int) -> Table:
    """Bias and exact variance next to the closed form, and their difference.

    Parameters
    ----------
    rows : sequence of (label, float, float, float)
        ``(label, ‖E ĝ − ∇J‖, exact tr Cov, closed-form tr Cov)`` of each estimator.
    label, label_width : str, int
        The header and width of the first column.

    Returns
    -------
    Table
        The rows with a last column ``exact − closed form``.
    """
    return aligned_table([(name, bias, var, closed, var - closed)
                          for name, bias, var, closed in rows],
                         [(label, label_width, ""), ("‖E ĝ − ∇J‖", 11, ".1e"),
                          ("tr Cov (exact moments)", 23, ".8f"), ("closed form", 12, ".8f"),
                          ("difference", 11, "+.1e")])


def advantage_table(batch, advantages: Mapping[str, torch.Tensor], *, scaled: str, scale: float,
                    header: str, compare: str | None = None,
                    fmt: str | Sequence[str] = ".6f") -> Table:
    """Each sampled sequence's group, reward and advantages, one advantage scaled.

    Parameters
    ----------
    batch : TokenBatch
        The sampled batch (``group`` and ``reward`` per sequence).
    advantages : mapping of str to Tensor ``[S]``
        Column header and per-sequence advantage of each estimator, in column order.
    scaled : str
        The key of the advantage to scale.
    scale : float
        The factor applied to ``advantages[scaled]`` in an extra column.
    header : str
        The extra column's header.
    compare : str, optional
        A key whose column is then compared with the scaled one (a last column
        ``advantages[compare] − scale · advantages[scaled]``).
    fmt : str or sequence of str
        The format of the advantage columns (one for all, or one per column); the scaled
        column has ``".6f"``.

    Returns
    -------
    Table
        Columns group, R, every advantage, the scaled one (and the difference).
    """
    if scaled not in advantages or (compare is not None and compare not in advantages):
        raise ValueError(f"scaled, compare: expected keys of advantages {list(advantages)}")
    columns = [("group", 5, ""), ("R", 4, ".0f")]
    fmts = [fmt] * len(advantages) if isinstance(fmt, str) else list(fmt)
    if len(fmts) != len(advantages):
        raise ValueError(f"fmt: expected {len(advantages)} formats, got {len(fmts)}")
    columns += [(h, max(len(h) + 1, 7), f) for h, f in zip(advantages, fmts, strict=True)]
    columns += [(header, max(len(header) + 1, 7), ".6f")]
    if compare is not None:
        columns += [("difference", 11, "+.1e")]
    rows = []
    for s in range(batch.num_sequences):
        values = [float(a[s]) for a in advantages.values()]
        row = [int(batch.group[s]), float(batch.reward[s]), *values,
               scale * float(advantages[scaled][s])]
        if compare is not None:
            row.append(float(advantages[compare][s]) - row[-1])
        rows.append(row)
    return aligned_table(rows, columns)


def scaled_mean_table(entries: Sequence[tuple], true_grad: torch.Tensor, *,
                      title: str = "estimator") -> Table:
    """How far each expected gradient is from ``c ∇J``, with its variance.

    Parameters
    ----------
    entries : sequence of (str, float, Moments)
        ``(name, c, moments)``: the estimator, the predicted factor ``c``, its exact moments.
    true_grad : Tensor ``[D]``
        ``∇J``.
    title : str
        The first column's header.

    Returns
    -------
    Table
        Columns name, ``max|E ĝ − c ∇J|``, ``c``, ``tr Cov``.
    """
    rows = [(name, float((m.mean - c * true_grad).abs().max()), c, m.total_variance)
            for name, c, m in entries]
    return aligned_table(rows, [(title, 22, ""), ("max|E ĝ − c ∇J|", 16, ".1e"),
                                ("c", 8, ".6f"), ("tr Cov", 10, ".6f")], title="")


def grpo_scale_table(rows: Sequence[tuple]) -> Table:
    """GRPO's factor ``c(p_x)`` on each prompt, from the exact moments and the closed form.

    Parameters
    ----------
    rows : sequence of (str, int, str, float, float, float, float or None)
        ``(estimator, G, prompt, p_x, c from moments, c closed form, cosine)``; the cosine of
        ``E ĝ`` with ``∇J`` once per (estimator, ``G``), None on the other prompts' rows.

    Returns
    -------
    Table
        The rows with the difference of the two ``c`` and the angle ``acos(cosine)`` in degrees.
    """
    out = []
    for name, G, prompt, p, c_moments, c_closed, cosine in rows:
        angle = (None if cosine is None
                 else f"{math.degrees(math.acos(min(1.0, cosine))):>5.2f}°")
        out.append((name, G, prompt, p, c_moments, c_closed, c_moments - c_closed, cosine, angle))
    return aligned_table(out, [("estimator", 20, ""), ("G", 3, ""), ("prompt", 6, ""),
                               ("p_x", 6, ".3f"), ("c (exact moments)", 18, ".12f"),
                               ("c (closed form)", 16, ".12f"), ("difference", 11, "+.1e"),
                               ("cosine", 9, ".6f"), ("angle", 6, "")])


def effective_reward_table(entries: Sequence[tuple]) -> Table:
    """Exact moments against the effective-reward formula ``Σ_y π h σ``, and the cosine.

    Parameters
    ----------
    entries : sequence of (str, int, Moments, Tensor)
        ``(estimator, G, moments, Σ_y π(y) h(y) σ(y))``.

    Returns
    -------
    Table
        Columns estimator, ``G``, ``max|E ĝ − Σ π h σ|``, cosine with ``∇J``.
    """
    rows = [(name, G, float((m.mean - via_h).abs().max()), m.cosine)
            for name, G, m, via_h in entries]
    return aligned_table(rows, [("estimator", 20, ""), ("G", 2, ""),
                                ("max|E ĝ − Σ π h σ|", 19, ".1e"),
                                ("cosine(E ĝ, ∇J)", 16, ".6f")], title="")


def peeking_bias_table(entries: Sequence[tuple]) -> Table:
    """Each peeking baseline's exact bias against its predicted bias.

    Parameters
    ----------
    entries : sequence of (str, int, str, Moments, Tensor)
        ``(estimator, G, formula of the prediction, moments, predicted E ĝ − ∇J)``.

    Returns
    -------
    Table
        Columns estimator, ``G``, the formula, ``max|bias − predicted|``, relative bias, cosine.
    """
    rows = [(name, G, label, float((m.bias - predicted).abs().max()), m.relative_bias, m.cosine)
            for name, G, label, m, predicted in entries]
    return aligned_table(rows, [("estimator", 18, ""), ("G", 2, ""), ("predicted bias", 22, ""),
                                ("max|bias − predicted|", 22, ".1e"),
                                ("relative bias", 14, ".6f"), ("cosine", 9, ".6f")])


def group_size_table(moments_by_name: Mapping[str, Sequence], group_sizes: Sequence[int]) -> Table:
    """Bias, cosine, variance and best-rescaled variance of every estimator at every ``G``.

    Parameters
    ----------
    moments_by_name : mapping of str to sequence of Moments
        The exact moments of each estimator, one per group size.
    group_sizes : sequence of int
        The group sizes, in the same order.

    Returns
    -------
    Table
        Columns estimator, ``G``, relative bias, cosine, ``tr Cov``, ``c* = Moments.scale`` and
        ``c*² tr Cov``.
    """
    rows = [(name, G, m.relative_bias, m.cosine, m.total_variance, m.scale,
             m.scale ** 2 * m.total_variance)
            for name, ms in moments_by_name.items()
            for G, m in zip(group_sizes, ms, strict=True)]
    return aligned_table(rows, [("estimator", 21, ""), ("G", 2, ""), ("rel. bias", 10, ".6f"),
                                ("cosine", 9, ".6f"), ("tr Cov", 9, ".5f"), ("c*", 7, ".4f"),
                                ("c*² tr Cov", 11, ".5f")])


# ---------------------------------------------------------------------------------- figures


