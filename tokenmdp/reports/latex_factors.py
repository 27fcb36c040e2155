"""Advantages, corrections and KL penalties in LaTeX, for the estimator cards' formulas.

Each function turns one part (with its hyperparameters) into a
:class:`~tokenmdp.reports.latex_terms.Term`: its symbol and the lines defining it, in the notation
of the Concepts › Estimators page (``R_i`` the reward of sequence ``i``, ``g(i)`` its group,
``w_{i,t} = π_old/μ`` the training–inference weight, ``k_{i,t}`` the KL estimate). A part this
module does not know is written as its ``describe()`` label (``known`` False).
"""

from __future__ import annotations

import dataclasses

from tokenmdp import estimators
from tokenmdp.estimators.advantages.baselines import (
    GroupMeanBatchStd,
    OPOBaseline,
    ReinforcePPBaseline,
)
from tokenmdp.estimators.advantages.group import (
    BatchNormalized,
    GroupMean,
    GroupNormalized,
    LeaveOneOut,
    RewardAsAdvantage,
)
from tokenmdp.estimators.advantages.token import RewardToGo
from tokenmdp.estimators.advantages.tree import NodeValueDifference, ReturnMinusNodeValue, TreeLeaves
from tokenmdp.estimators.advantages.tree_credit import TreeRLAdvantage, VinePPOTree
from tokenmdp.estimators.corrections.factor import (
    ImportanceSampling,
    Level,
    MaskedIS,
    NoCorrection,
    TruncatedIS,
)
from tokenmdp.estimators.corrections.rejection import RejectionSampling
from tokenmdp.estimators.corrections.self_normalized import SelfNormalizedIS
from tokenmdp.estimators.kl import KLPenalty, kl_abs, kl_k1, kl_k2, kl_k3, kl_k3_plus
from tokenmdp.reports.latex_terms import MU, N_DEF, OLD, REF, ROW, Term, number, text

__all__ = ["Correction", "advantage_term", "correction_term", "kl_definition"]

W_DEF = rf"w_{{i,t}} &= \frac{{{OLD}(y_{{i,t}})}}{{{MU}(y_{{i,t}})}}"
_MEAN_G = r"\operatorname{mean}_{j\in g(i)} R_j"
_LEAVE = r"&(\text{a rejected token leaves the loss and the counts } N,\ |y_i|)"


# ---------------------------------------------------------------------- KL
def kl_definition(kl: KLPenalty, policy: str) -> Term:
    """``k_{i,t}`` of a KL penalty, and ``β``, as one definition line.

    Parameters
    ----------
    kl : KLPenalty
        The penalty (its estimator and coefficient).
    policy : str
        The LaTeX of the policy the estimate is taken at: ``\\pi_\\theta`` in the loss,
        ``\\pi_{\\text{old}}`` in the reward.

    Returns
    -------
    Term
        ``k_{i,t}`` and the line ``k_{i,t} &= ..., β = ...``.
    """
    y = "(y_{i,t})"
    log_ratio = rf"\log\frac{{{REF}{y}}}{{{policy}{y}}}"
    k3 = rf"\frac{{{REF}{y}}}{{{policy}{y}}} - 1 - {log_ratio}"
    forms = {
        kl_k1: rf"\log\frac{{{policy}{y}}}{{{REF}{y}}}",
        kl_k2: rf"\tfrac{{1}}{{2}}\Big({log_ratio}\Big)^2",
        kl_k3: k3,
        kl_k3_plus: rf"{k3}\quad(\text{{value of }} k_3\text{{, gradient of }} k_2)",
        kl_abs: rf"\Big|\log\frac{{{policy}{y}}}{{{REF}{y}}}\Big|",
    }
    form = forms.get(kl.estimator)
    known = form is not None
    if form is None:
        form = text(getattr(kl.estimator, "__name__", repr(kl.estimator)))
    return Term("k_{i,t}", (rf"k_{{i,t}} &= {form},\qquad \beta = {number(kl.coef)}",),
                known=known)


# ---------------------------------------------------------------------- advantages
def _over(ddof: int) -> str:
    """``1/N`` or, with ``ddof``, ``1/(N - ddof)``."""
    return r"\frac{1}{N}" if ddof == 0 else rf"\frac{{1}}{{N-{ddof}}}"


def _std(ddof: int) -> str:
    return {0: "population std", 1: "sample std"}.get(ddof, f"std with ddof {ddof}")


def _sequence_advantage(part, reward: str) -> tuple[str, str] | None:
    """``(symbol, definition lines joined by ROW)`` of a per-sequence advantage, None for an
    unknown part."""
    stem = reward.removesuffix("_i")                 # R, or \tilde{R} after a KL penalty
    a, group_mean = r"\hat{A}_i", rf"{reward} - {_MEAN_G.replace('R_j', f'{stem}_j')}"
    if isinstance(part, RewardAsAdvantage):
        return reward, ""
    if isinstance(part, GroupMean):
        return a, rf"{a} &= {group_mean}"
    if isinstance(part, GroupNormalized):
        return a, (rf"{a} &= \frac{{{group_mean}}}{{\operatorname{{std}}_{{j\in g(i)}} {stem}_j + "
                   rf"{number(part.eps)}}}\quad(\text{{{_std(part.ddof)}}})")
    if isinstance(part, LeaveOneOut):
        return a, (rf"{a} &= {reward} - \frac{{1}}{{|g(i)|-1}}\sum_{{j\in g(i),\,j\ne i}} {stem}_j")
    if isinstance(part, BatchNormalized):
        return a, (rf"{a} &= \frac{{{reward} - \operatorname{{mean}}_{{j\le S}} {stem}_j}}"
                   rf"{{\operatorname{{std}}_{{j\le S}} {stem}_j + {number(part.eps)}}}"
                   rf"\quad(\text{{{_std(part.ddof)} over the step}})")
    if isinstance(part, GroupMeanBatchStd):
        return a, (rf"{a} &= \frac{{{group_mean}}}{{\operatorname{{std}}_{{j\le S}} {stem}_j + "
                   rf"{number(part.eps)}}}\quad(\text{{{_std(part.ddof)} over the step}})")
    if isinstance(part, OPOBaseline):
        return a, (rf"{a} &= {reward} - \frac{{\sum_{{j\in g(i)}} |y_j|\,{stem}_j}}"
                   rf"{{\sum_{{j\in g(i)}} |y_j|}}")
    if isinstance(part, ReinforcePPBaseline):
        return a, (rf"{a} &= \frac{{d_i - m}}{{\sqrt{{v + {number(part.eps)}}}}},\quad d_i = "
                   rf"{group_mean}{ROW}"
                   rf"m &= \frac{{1}}{{N}}\sum_j |y_j|\,d_j,\quad v = {_over(part.ddof)}"
                   rf"\sum_j |y_j|\,(d_j - m)^2{ROW}{N_DEF}")
    return None


def _reward_to_go(part: RewardToGo, kl: KLPenalty | None) -> Term:
    a, x = r"\hat{A}_{i,t}", "a_{i,t}"
    base = "R_i" if part.baseline == "none" else rf"R_i - {_MEAN_G}"
    penalty = kl_definition(kl, OLD) if kl is not None and kl.in_reward else Term("")
    if penalty.defs:
        base = rf"{base} - \beta\sum_{{s\ge t}} k_{{i,s}}"
    if not part.whiten:
        return Term(a, (rf"{a} &= {base}", *penalty.defs), known=penalty.known)
    return Term(a, (
        rf"{a} &= \frac{{{x} - m}}{{\sqrt{{v + {number(part.eps)}}}}},\quad {x} = {base}",
        rf"m &= \frac{{1}}{{N}}\sum_{{j,s}} a_{{j,s}},\quad v = {_over(part.ddof)}"
        r"\sum_{j,s} (a_{j,s} - m)^2\quad(\text{over the loss tokens})", N_DEF,
        *penalty.defs), known=penalty.known)


_NODE = "n_{i,t}"
_V_DEF = (r"\hat{V}(n) &= \frac{1}{|L(n)|}\sum_{j\in L(n)} R_j"
          r"\quad(\text{the leaves below tree node } n)")


def _tree_advantage(part) -> Term | None:
    """A tree part's ``\\hat{A}_{i,t}`` from node values (``n_{i,t}`` the node of token t,
    ``p(n)`` its parent); None for a part that is not one."""
    a = r"\hat{A}_{i,t}"
    if isinstance(part, NodeValueDifference):
        return Term(a, (rf"{a} &= \hat{{V}}({_NODE}) - \hat{{V}}(p({_NODE}))", _V_DEF))
    if isinstance(part, ReturnMinusNodeValue):
        return Term(a, (rf"{a} &= R_i - \hat{{V}}(p({_NODE}))", _V_DEF))
    if isinstance(part, TreeRLAdvantage):
        top = r"2\hat{V}(n) - \hat{V}(\text{root}) - \hat{V}(p_{\text{seg}}(n))"
        form = rf"\frac{{{top}}}{{\sqrt{{|L(n)|}}}}" if part.reweight else top
        return Term(a, (rf"{a} &= {form},\quad n = {_NODE}", _V_DEF,
                        r"&(p_{\text{seg}}(n)\text{: the fork above the segment of } n)"))
    if isinstance(part, VinePPOTree):
        return Term(a, (rf"{a} &= \hat{{V}}_{{-i}}({_NODE}) - \hat{{V}}_{{-i}}(p({_NODE}))",
                        r"\hat{V}_{-i}(n) &= \operatorname{mean}_{j\in L(n),\,j\ne i} R_j"
                        r"\quad(R_i\text{ if no other leaf})"))
    return None


def advantage_term(part: estimators.Advantage, kl: KLPenalty | None = None) -> Term:
    """The advantage's symbol (``\\hat{A}_i``, ``\\hat{A}_{i,t}`` or ``R_i``) and definition.

    Parameters
    ----------
    part : Advantage
        The estimator's advantage.
    kl : KLPenalty, optional
        The estimator's KL penalty: when it is in the reward, the advantage is that of the
        penalized reward (defined on a line of its own).

    Returns
    -------
    Term
        The symbol as ``tex`` and its definition lines.
    """
    if isinstance(part, RewardToGo):
        return _reward_to_go(part, kl)
    tree = _tree_advantage(part)
    if tree is not None:
        return tree
    if isinstance(part, TreeLeaves):             # the inner advantage, g(i) the tree's leaves
        inner = advantage_term(part.inner, kl)
        return dataclasses.replace(inner, defs=(*inner.defs,
                                                r"&(g(i)\text{: the leaves of the tree of } i)"))
    penalized = kl is not None and kl.in_reward
    reward = r"\tilde{R}_i" if penalized else "R_i"
    found = _sequence_advantage(part, reward)
    if found is None:
        return Term(r"\hat{A}_i", (rf"\hat{{A}}_i &= {text(part.describe())}",), known=False)
    symbol, definition = found
    defs = tuple(definition.split(ROW)) if definition else ()
    if penalized:
        k = kl_definition(kl, OLD)
        defs += (r"\tilde{R}_i &= R_i - \beta\sum_{t} k_{i,t}", *k.defs)
        return Term(symbol, defs, known=k.known)
    return Term(symbol, defs)


# ---------------------------------------------------------------------- corrections
@dataclasses.dataclass(frozen=True)
class Correction:
    """A correction in LaTeX: the factor on the surrogate and the keep mask on the whole term.

    Parameters
    ----------
    factor : str
        Multiplies the surrogate term (``""``: none).
    keep : str
        Multiplies the surrogate and the KL-in-loss term alike, the rejected tokens leaving the
        normalizers (``""``: none).
    defs : tuple of str
        Definition lines.
    sequence : bool
        True when ``factor`` and ``keep`` are the same for every token of sequence ``i``.
    known : bool, default True
        False when the part was not recognised.
    """

    factor: str
    keep: str
    defs: tuple[str, ...]
    sequence: bool
    known: bool = True


def _weight(level: Level) -> tuple[str, tuple[str, ...]]:
    """The weight at ``level``: ``w_{i,t}``, or ``W_i`` (product or geometric mean)."""
    if level == Level.TOKEN:
        return "w_{i,t}", (W_DEF,)
    if level == Level.SEQUENCE:
        return "W_i", (r"W_i &= \prod_{t} w_{i,t}", W_DEF)
    return "W_i", (r"W_i &= \exp\Big(\frac{1}{|y_i|}\sum_{t}\log w_{i,t}\Big)", W_DEF)


def _band(x: str, low: float | None, high: float) -> str:
    """``1[low <= x <= high]`` (``1[x <= high]`` without ``low``), tall brackets round a
    fraction or a product."""
    left, right = (r"\Big[", r"\Big]") if any(m in x for m in (r"\frac", r"\prod", r"\sum")) \
        else ("[", "]")
    inside = rf"{x} \le {number(high)}" if not low else rf"{number(low)} \le {x} \le {number(high)}"
    return rf"\mathbf{{1}}{left}{inside}{right}"


def _rejection(part: RejectionSampling) -> tuple[str, tuple[str, ...], bool]:
    """verl's rejection mask: ``(mask, definitions, per sequence)``."""
    token = part.reduce == "token"
    if part.statistic == "k1":      # bounds on the ratio μ/π_old (its product, geometric mean)
        ratio = rf"\frac{{{MU}(y_{{i,t}})}}{{{OLD}(y_{{i,t}})}}"
        x = {"token": ratio, "sum": rf"\prod_{{t}} {ratio}",
             "mean": rf"\exp\Big(\frac{{1}}{{|y_i|}}\sum_{{t}}\log{ratio}\Big)"}[part.reduce]
        return _band(x, part.low, part.high), (), not token
    kappa = {"k2": r"\tfrac{1}{2}(\log w_{i,t})^2", "k3": r"w_{i,t} - 1 - \log w_{i,t}"}
    x = {"token": r"\kappa_{i,t}", "sum": r"\sum_{t}\kappa_{i,t}",
         "mean": r"\frac{1}{|y_i|}\sum_{t}\kappa_{i,t}", "max": r"\max_{t}\kappa_{i,t}"}
    return (_band(x[part.reduce], None, part.high),
            (rf"\kappa_{{i,t}} &= {kappa[part.statistic]}", W_DEF), not token)


def correction_term(part: estimators.Correction) -> Correction:
    """The training–inference correction of an estimator, in LaTeX.

    Parameters
    ----------
    part : Correction
        The estimator's correction.

    Returns
    -------
    Correction
        The factor on the surrogate, the keep mask of rejections that leave the normalizers,
        their definitions and whether they are per sequence.
    """
    if isinstance(part, NoCorrection):
        return Correction("", "", (), True)
    if isinstance(part, RejectionSampling):
        mask, defs, sequence = _rejection(part)
        chi = r"\chi_i" if sequence else r"\chi_{i,t}"
        if part.masked_in_normalizer:
            return Correction(chi, "", (rf"{chi} &= {mask}", *defs), sequence)
        return Correction("", chi, (rf"{chi} &= {mask}", _LEAVE, *defs), sequence)
    level = getattr(part, "level", Level.TOKEN)
    x, defs = _weight(level)
    sequence = level != Level.TOKEN
    if isinstance(part, ImportanceSampling):
        return Correction(x, "", defs, sequence)
    if isinstance(part, TruncatedIS):
        factor = rf"\min({x},\ {number(part.cap)})"
        if part.floor is not None:
            factor = rf"\max\big({number(part.floor)},\ {factor}\big)"
        return Correction(factor, "", defs, sequence)
    if isinstance(part, MaskedIS):
        band = _band(x, part.low, part.high)
        if part.masked_in_normalizer:
            return Correction(rf"{x}\,{band}", "", defs, sequence)
        chi = r"\chi_i" if sequence else r"\chi_{i,t}"
        return Correction(x, chi, (rf"{chi} &= {band}", _LEAVE, *defs), sequence)
    if isinstance(part, SelfNormalizedIS):
        if part.cap is not None:
            capped = x.replace("w", r"\tilde{w}").replace("W", r"\tilde{W}")
            defs = (rf"{capped} &= \min({x},\ {number(part.cap)})", *defs)
            x = capped
        over = (r"\text{the step's } N \text{ loss tokens}" if level == Level.TOKEN
                else r"\text{the step's sequences}")
        mean = rf"\overline{{{x.removesuffix('_{i,t}').removesuffix('_i')}}}"
        return Correction(rf"\frac{{{x}}}{{{mean}}}", "",
                          (rf"{mean} &= \text{{mean of }} {x} \text{{ over }} {over}", *defs),
                          sequence)
    return Correction(text(part.describe()), "", (), False, known=False)
