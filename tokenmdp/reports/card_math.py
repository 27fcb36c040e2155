"""An estimator's loss in LaTeX, composed from its five parts: the estimator cards' math block.

The loss of :mod:`~tokenmdp.estimators.token_loss`,
``L = -Σ_{loss tokens} loss_weight · (c · surrogate - β k)``, written out for one estimator: the
aggregation gives the sums and their normalizer, :mod:`~tokenmdp.reports.latex_terms` the
surrogate's term, :mod:`~tokenmdp.reports.latex_factors` the advantage inside it, the correction
factor ``c`` and the KL penalty. Nothing is written per registry entry: a new entry, or any
:class:`~tokenmdp.estimators.Estimator`, gets its formula from its parts, with their
hyperparameters as numbers. A term the same for every token of a sequence (GSPO's, sequence IS's)
is summed over the tokens by hand, so it reads as the papers write it.

* :func:`loss_latex` — the ``aligned`` block of an estimator and whether every part was known;
* :func:`math_block` — the MyST ``$$`` block of a registry entry, for its card.
"""

from __future__ import annotations

import dataclasses

from tokenmdp import estimators
from tokenmdp.estimators.aggregation import Aggregation
from tokenmdp.reports.latex_factors import advantage_term, correction_term, kl_definition
from tokenmdp.reports.latex_terms import (
    MU,
    N_DEF,
    ROW,
    THETA,
    Term,
    surrogate_term,
    text,
    width,
)

__all__ = ["NOTATION", "WIDE", "loss_latex", "math_block"]

#: The widest loss line (:func:`~tokenmdp.reports.latex_terms.width`, about 8 px a character at
#: MathJax's size) before the surrogate's term moves to a line of its own: the docs' content
#: column is about 600-750 px wide.
WIDE = 58

#: One sentence under every card's formula: the symbols every formula shares.
NOTATION = ("Sequence $i$ of the step's $S$ has $|y_i|$ loss tokens $y_{i,t}$; "
            r"$\operatorname{sg}$ is stop-gradient, $\mathbf{1}[\cdot]$ an indicator; "
            "notation as in {doc}`/concepts/estimators`.")

_ALL = r"\sum_{i=1}^{S}"
#: Per aggregation: the sum over sequences with its normalizer, whether each sequence's tokens
#: are averaged (``1/|y_i|``) rather than summed, and a line defining its symbols.
_AGGREGATIONS = {
    Aggregation.TOKEN_MEAN: (rf"\frac{{1}}{{N}}{_ALL}", False, N_DEF),
    Aggregation.SEQUENCE_MEAN_TOKEN_MEAN: (rf"\frac{{1}}{{S}}{_ALL}", True, ""),
    Aggregation.SEQUENCE_MEAN_TOKEN_SUM: (rf"\frac{{1}}{{S}}{_ALL}", False, ""),
    Aggregation.CONSTANT: (rf"\frac{{1}}{{S\,L_{{\max}}}}{_ALL}", False,
                           r"L_{\max} &= \text{the longest response allowed (given to prepare)}"),
    Aggregation.TOKEN_SUM: (_ALL, False, ""),
    Aggregation.PROMPT_MEAN_TOKEN_MEAN: (
        r"\frac{1}{P}\sum_{g}\frac{1}{N_g}\sum_{i\in g}", False,
        r"P &= \text{the step's groups},\quad N_g = \sum_{i\in g} |y_i|"),
}


def _bracket(tex: str) -> str:
    return rf"\Big[{tex}\Big]"


def _body(estimator: estimators.Estimator, surrogate: Term, factor: str, keep: str
          ) -> tuple[str, bool, tuple[str, ...], bool]:
    """The summand ``keep · [factor · term - β k]``: its LaTeX, whether it is a sum, the KL
    definitions and whether a KL-in-loss term is part of it."""
    term = surrogate.tex
    if surrogate.sequence == "split":               # this token's share of the sequence's term
        term = rf"\frac{{{term}}}{{|y_i|}}"
    if factor:
        term = rf"{factor}\,\big({term}\big)" if surrogate.sum else rf"{factor}\,{term}"
    is_sum, defs, kl = surrogate.sum and not factor, (), estimator.kl
    in_loss = kl is not None and not kl.in_reward
    if in_loss:
        k = kl_definition(kl, THETA)
        weight = (rf"\operatorname{{sg}}\Big(\frac{{{THETA}(y_{{i,t}})}}{{{MU}(y_{{i,t}})}}\Big)\,"
                  if kl.importance_weighted else "")
        term, is_sum, defs = rf"{term} - \beta\,{weight}k_{{i,t}}", True, k.defs
    if keep:
        term, is_sum = rf"{keep}\,{_bracket(term)}", False
    return term, is_sum, defs, in_loss


def _loss(estimator: estimators.Estimator, surrogate: Term, correction) -> tuple[str, tuple]:
    """The loss line's right-hand side and the KL-in-loss definitions."""
    outer, token_mean, _ = _AGGREGATIONS.get(
        estimator.aggregation, (rf"{text(str(estimator.aggregation.value))}{_ALL}", False, ""))
    body, is_sum, kl_defs, in_loss = _body(estimator, surrogate, correction.factor,
                                           correction.keep)
    if surrogate.sequence and correction.sequence and not in_loss:
        # the same value on every token of sequence i: its token sum or mean written out
        split = surrogate.sequence == "split"
        body, is_sum, _, _ = _body(estimator, dataclasses.replace(surrogate, sequence=None),
                                   correction.factor, correction.keep)
        value = _bracket(body) if is_sum else body
        if not split and not token_mean:
            value = rf"|y_i|\,{value}"
        elif split and token_mean:
            value = rf"\frac{{{body}}}{{|y_i|}}"
        return rf"-{outer}{value}", kl_defs
    tokens = (r"\frac{1}{|y_i|}" if token_mean else "") + r"\sum_{t=1}^{|y_i|}"
    return rf"-{outer}{tokens}{_bracket(body) if is_sum else body}", kl_defs


def loss_latex(estimator: estimators.Estimator) -> Term:
    """The loss of ``estimator`` as a LaTeX ``aligned`` block, composed from its parts.

    Parameters
    ----------
    estimator : Estimator
        Any estimator (a registry entry's, or one built by hand).

    Returns
    -------
    Term
        ``tex``: ``\\begin{aligned} \\mathcal{L}(\\theta) &= ... \\\\ symbol &= ... \\end{aligned}``,
        the loss on the first line and one definition a line below it (the surrogate's term
        ``f`` on a line of its own when the loss line would be wider than :data:`WIDE`);
        ``known``: False when a part was not recognised and stands as its ``describe()`` label.
    """
    advantage = advantage_term(estimator.advantage, estimator.kl)
    surrogate = surrogate_term(estimator.surrogate, advantage.tex)
    correction = correction_term(estimator.correction)
    loss, kl_defs = _loss(estimator, surrogate, correction)
    lines = [rf"\mathcal{{L}}(\theta) &= {loss}"]
    if width(lines[0]) > WIDE:
        symbol = "f_i" if surrogate.sequence else "f_{i,t}"
        loss, kl_defs = _loss(estimator, dataclasses.replace(surrogate, tex=symbol, sum=False),
                              correction)
        lines = [rf"\mathcal{{L}}(\theta) &= {loss}", rf"{symbol} &= {surrogate.tex}"]
    normalizer = _AGGREGATIONS.get(estimator.aggregation, ("", False, ""))[2]
    for line in (*surrogate.defs, *advantage.defs, *correction.defs, *kl_defs, normalizer):
        if line and line not in lines:
            lines.append(line)
    known = (surrogate.known and advantage.known and correction.known
             and estimator.aggregation in _AGGREGATIONS)
    return Term("\\begin{aligned}\n" + ROW.join(lines) + "\n\\end{aligned}", known=known)


def math_block(name: str) -> str:
    """The formula of registry entry ``name`` as a MyST ``$$`` block (rendered by MathJax).

    Parameters
    ----------
    name : str
        A registry name.

    Returns
    -------
    str
        ``$$``, the :func:`loss_latex` block of the entry's estimator, ``$$``, one a line.
    """
    return f"$$\n{loss_latex(estimators.get(name)).tex}\n$$"
