"""The surrogates' per-token terms in LaTeX, for the estimator cards' formulas.

:func:`surrogate_term` turns a surrogate part (with its hyperparameters) into a :class:`Term`:
the LaTeX of the term of token ``t`` of sequence ``i`` and the lines that define its symbols.
The notation is that of the Concepts › Estimators page: ``r_{i,t} = π_θ/π_old``, ``μ`` the
sampler, ``sg`` stop-gradient. A surrogate this module does not know is written as its
``describe()`` label in ``\\text{...}`` (``Term.known`` False), so a new part still gets a
formula, and the tests list the parts that need one.
"""

from __future__ import annotations

import dataclasses
import re

from tokenmdp import estimators
from tokenmdp.estimators.surrogates.clipped import CISPO, MiniRL, PPOClip
from tokenmdp.estimators.surrogates.covariance import ClipCov, KLCov
from tokenmdp.estimators.surrogates.ctpo import CTPOClip
from tokenmdp.estimators.surrogates.per_decision import PerDecisionRatio
from tokenmdp.estimators.surrogates.sequence import GSPO, GSPOToken, SequenceRatio
from tokenmdp.estimators.surrogates.soft import GMPO, SAPO, EntropyBonus
from tokenmdp.estimators.surrogates.token import Reinforce, TokenRatio
from tokenmdp.estimators.surrogates.trust_region_masks import DPPO, OffPolicySequenceMask

__all__ = ["Term", "number", "surrogate_term", "text", "width"]

#: The policies, as the Concepts pages write them.
THETA, OLD, MU, REF = r"\pi_\theta", r"\pi_{\text{old}}", r"\mu", r"\pi_{\text{ref}}"
LOGPI = r"\log\pi_\theta(y_{i,t})"
R = "r_{i,t}"
R_DEF = rf"r_{{i,t}} &= \frac{{{THETA}(y_{{i,t}})}}{{{OLD}(y_{{i,t}})}}"
N_DEF = r"N &= \sum_{i} |y_i|\quad(\text{the step's loss tokens})"
#: The end of a row of an ``aligned`` block.
ROW = " \\\\\n"
RHO_DEF = rf"\rho_{{i,t}} &= \frac{{{THETA}(y_{{i,t}})}}{{{MU}(y_{{i,t}})}}"


@dataclasses.dataclass(frozen=True)
class Term:
    """A part's LaTeX: the expression and the ``aligned`` lines that define its symbols.

    Parameters
    ----------
    tex : str
        The expression (a term of token ``t`` of sequence ``i``, or a factor).
    defs : tuple of str, default ()
        Lines ``symbol &= definition`` for an ``aligned`` block, in reading order.
    sequence : {None, 'each', 'split'}, default None
        None: the value varies with ``t``. ``'each'``: every token of sequence ``i`` carries the
        same value ``tex`` (GSPO); ``'split'``: each carries ``tex / |y_i|`` (sequence IS).
    sum : bool, default False
        True when ``tex`` is a sum or difference at its top level (bracketed when multiplied).
    known : bool, default True
        False when the part was not recognised and ``tex`` is its ``describe()`` label.
    """

    tex: str
    defs: tuple[str, ...] = ()
    sequence: str | None = None
    sum: bool = False
    known: bool = True


def text(label: str) -> str:
    """``label`` as ``\\text{...}``, TeX's special characters escaped.

    Parameters
    ----------
    label : str
        Plain text (a part's ``describe()``).

    Returns
    -------
    str
        LaTeX that MathJax prints as the text.
    """
    for char, escaped in (("\\", r"\backslash "), ("{", r"\{"), ("}", r"\}"), ("_", r"\_"),
                          ("#", r"\#"), ("%", r"\%"), ("&", r"\&"), ("$", r"\$"),
                          ("^", r"\^{}"), ("~", r"\~{}")):
        label = label.replace(char, escaped)
    return rf"\text{{{label}}}"


def number(value: float) -> str:
    """A hyperparameter in LaTeX: ``0.2``, ``0.002``, ``10^{-6}``, ``2\\times10^{-4}``.

    Parameters
    ----------
    value : float
        The number.

    Returns
    -------
    str
        Its shortest form (``:g``, six digits at most), under ``10^{-3}`` as a power of ten.
    """
    if value != 0 and abs(value) < 1e-3:        # 3e-4, not 0.0003
        mantissa, exponent = f"{value:e}".split("e")
        mantissa = f"{float(mantissa):g}"
    else:
        mantissa, _, exponent = f"{value:.6g}".partition("e")
    if not exponent:
        return mantissa
    power = f"10^{{{int(exponent)}}}"
    return {"1": power, "-1": f"-{power}"}.get(mantissa, rf"{mantissa}\times{power}")


def width(tex: str) -> int:
    """A rough printed width of one line of LaTeX, in characters (for line breaking and tests).

    A fraction counts as its wider part, a sub- or superscript as half its length, a macro as
    one character, ``\\text`` and ``\\operatorname`` as their words; spacing and braces as none.

    Parameters
    ----------
    tex : str
        One line (no ``\\\\``).

    Returns
    -------
    int
        About the number of characters MathJax sets.
    """
    t = tex
    for _ in range(6):      # innermost groups first, nested ones on later passes
        t = re.sub(r"\\[td]?frac\{([^{}]*)\}\{([^{}]*)\}",
                   lambda m: max(m.group(1), m.group(2), key=len), t)
        t = re.sub(r"\\(?:text|operatorname|mathrm|mathbf|hat|bar|tilde|overline|sqrt)"
                   r"\{([^{}]*)\}", r"\1", t)
        t = re.sub(r"[_^]\{([^{}]*)\}", lambda m: "x" * ((len(m.group(1)) + 1) // 2), t)
    t = re.sub(r"\\(?:big|Big|left|right|quad|qquad|[,;! ])", " ", t)
    t = re.sub(r"\\[A-Za-z]+", "x", t)
    return len(re.sub(r"[{}&_^]", "", t))


def _bound(eps: float, sign: str) -> str:
    """``1 ± ε`` as a number when it is short (``0.8``, ``1.28``, ``0``), else as ``1-ε``."""
    value = 1 - eps if sign == "-" else 1 + eps
    short = f"{round(value, 12):g}"
    return short if len(short) <= 4 else f"1{sign}{number(eps)}"


def _clip(x: str, eps_low: float, eps_high: float) -> str:
    return rf"\operatorname{{clip}}({x},\ {_bound(eps_low, '-')},\ {_bound(eps_high, '+')})"


def _ppo_mask(a: str, eps_low: float, eps_high: float) -> str:
    """PPO's mask ``M_{i,t}``: 0 where the clip removes the token's gradient."""
    return (rf"M_{{i,t}} &= 1 - \mathbf{{1}}[{a}>0,\ {R}>{_bound(eps_high, '+')}]"
            rf" - \mathbf{{1}}[{a}<0,\ {R}<{_bound(eps_low, '-')}]")


def _ppo(part, a: str) -> Term:
    core = rf"\min\big({R}\,{a},\ {_clip(R, part.eps_low, part.eps_high)}\,{a}\big)"
    if getattr(part, "dual_clip", None) is not None:
        core = rf"\max\Big({core},\ {number(part.dual_clip)}\,{a}\,\mathbf{{1}}[{a}<0]\Big)"
    return Term(core, (R_DEF,))


def _cispo(part: CISPO, a: str) -> Term:
    tex = rf"\operatorname{{sg}}\big({_clip(R, part.eps_low, part.eps_high)}\big)\,{a}\,{LOGPI}"
    if part.mask_eps_low is None:
        return Term(tex, (R_DEF,))
    return Term(rf"M_{{i,t}}\,{tex}", (R_DEF, _ppo_mask(a, part.mask_eps_low,
                                                          part.mask_eps_high)))


def _minirl(part: MiniRL, a: str) -> Term:
    return Term(rf"M_{{i,t}}\,\operatorname{{sg}}({R})\,{a}\,{LOGPI}",
                (R_DEF, _ppo_mask(a, part.eps_low, part.eps_high)))


def _geometric(ratio: str = R) -> str:
    return rf"\exp\Big(\frac{{1}}{{|y_i|}}\sum_{{t}}\log {ratio}\Big)"


def _gspo(part: GSPO, a: str) -> Term:
    tex = rf"\min\big(s_i\,{a},\ {_clip('s_i', part.eps_low, part.eps_high)}\,{a}\big)"
    return Term(tex, (rf"s_i &= {_geometric()}", R_DEF), sequence="each")


def _gspo_token(part: GSPOToken, a: str) -> Term:
    clip = _clip("s_{i,t}", part.eps_low, part.eps_high)
    own = rf"\frac{{{THETA}(y_{{i,t}})}}{{\operatorname{{sg}}\big({THETA}(y_{{i,t}})\big)}}"
    return Term(rf"\min\big(s_{{i,t}}\,{a},\ {clip}\,{a}\big)",
                (rf"s_{{i,t}} &= \operatorname{{sg}}(s_i)\,{own},\qquad s_i = {_geometric()}",
                 R_DEF))


def _sapo(part: SAPO, a: str) -> Term:
    tau = r"\tau_{i,t}"
    return Term(rf"\frac{{4}}{{{tau}}}\,\sigma\big({tau}\,({R}-1)\big)\,{a}",
                (rf"{tau} &= {number(part.tau_pos)}\ \text{{if }} {a}>0,\ "
                 rf"\text{{else }} {number(part.tau_neg)},\qquad \sigma(x) = \frac{{1}}{{1+e^{{-x}}}}",
                 R_DEF))


def _dppo(part: DPPO, a: str) -> Term:
    weight = R if part.cap is None else rf"\min({R},\ {number(part.cap)})"
    p, p_old = "p_{i,t}", r"p^{\text{old}}_{i,t}"
    up, down = number(part.delta_high), number(part.delta_low)
    if part.divergence == "tv":
        mask = (rf"M_{{i,t}} &= 1 - \mathbf{{1}}[{a}>0,\ {p}-{p_old}>{up}]{ROW}"
                rf"&\qquad - \mathbf{{1}}[{a}\le 0,\ {p}-{p_old}<-{down}]")
        extra = ()
    else:
        mask = (rf"M_{{i,t}} &= 1 - \mathbf{{1}}[{a}>0,\ {p}>{p_old},\ D_{{i,t}}>{up}]{ROW}"
                rf"&\qquad - \mathbf{{1}}[{a}\le 0,\ {p}<{p_old},\ D_{{i,t}}>{down}]")
        extra = (rf"D_{{i,t}} &= {p_old}\log\frac{{{p_old}}}{{{p}}}"
                 rf" + (1-{p_old})\log\frac{{1-{p_old}}}{{1-{p}}}",)
    return Term(rf"M_{{i,t}}\,\operatorname{{sg}}({weight})\,{a}\,{LOGPI}",
                (mask, *extra, rf"{p} &= {THETA}(y_{{i,t}}),\qquad {p_old} = {OLD}(y_{{i,t}})",
                 R_DEF))


def _gmpo(part: GMPO, a: str) -> Term:
    ell = r"\ell_{i,t}"
    return Term(rf"{a}\,\exp\Big(\frac{{1}}{{|y_i|}}\sum_{{t}}{ell}\Big)",
                (rf"{ell} &= \min(\log {R},\ {number(part.eps_high)})\ \text{{if }} {a}>0,\ "
                 rf"\text{{else }} \max(\log {R},\ -{number(part.eps_low)})", R_DEF),
                sequence="each")


def _ratio_against(against: str) -> tuple[str, str]:
    """The token ratio's symbol and definition: ``r`` against ``π_old``, ``ρ`` against ``μ``."""
    return (R, R_DEF) if against == "old" else (r"\rho_{i,t}", RHO_DEF)


def _per_decision(part: PerDecisionRatio, a: str) -> Term:
    x, definition = _ratio_against(part.against)
    stem = x.removesuffix("_{i,t}")
    return Term(rf"\operatorname{{sg}}\big({stem}_{{i,1:t-1}}\big)\,{x}\,{a}",
                (rf"{stem}_{{i,1:t-1}} &= \prod_{{s<t}} {stem}_{{i,s}}", definition))


def _power(power: float) -> str:
    return {0.0: "", 0.5: r"\sqrt{t}", 1.0: "t"}.get(power, f"t^{{{number(power)}}}")


def _ctpo(part: CTPOClip, a: str) -> Term:
    x, definition = _ratio_against(part.against)
    stem, tau = x.removesuffix("_{i,t}"), _power(part.power)
    lo, hi, c = r"\mathrm{lo}_t", r"\mathrm{hi}_t", "c_t"
    tex = (rf"\max\Big(\min\big(e^{{L_{{i,t}}}}{a},\ e^{{\operatorname{{clamp}}(L_{{i,t}},\,{lo},"
           rf"\,{hi})}}{a}\big),\ e^{{{c}}}{a}\,\mathbf{{1}}[{a}<0]\Big)")
    tau = rf"\,{tau}" if tau else ""
    bounds = (rf"{hi} = {c} = {number(part.clip_high)}{tau}" if part.clip_high == part.dual_clip
              else rf"{hi} = {number(part.clip_high)}{tau},\quad {c} = {number(part.dual_clip)}{tau}")
    return Term(tex, (
        rf"L_{{i,t}} &= \min\Big(\operatorname{{sg}}\Big(\sum_{{s<t}}\log {stem}_{{i,s}}\Big)"
        rf" + \log {x},\ {number(part.max_log_ratio)}\Big)",
        rf"{lo} &= -{number(part.clip_low)}{tau},\qquad {bounds}", definition))


def _covariance(part, a: str) -> tuple[str, ...]:
    """The covariance of a token and ``K``, the number of tokens Clip-Cov / KL-Cov select."""
    mean_log = rf"\overline{{\log {OLD}}}"
    return (rf"\operatorname{{cov}}_{{i,t}} &= ({a} - \bar{{A}})\,\big(\log {OLD}(y_{{i,t}}) - "
            rf"{mean_log}\big)",
            rf"K &= \max(\lfloor {number(part.ratio)}\,N\rfloor,\ 1)\quad(\text{{bars: means over "
            rf"the loss tokens}})", N_DEF)


def _clip_cov(part: ClipCov, a: str) -> Term:
    band = (rf"C &= \{{(i,t) : {number(part.cov_low)} < \operatorname{{cov}}_{{i,t}} < "
            rf"{number(part.cov_high)}\}}")
    if part.selection == "random":
        s = (rf"s_{{i,t}} &= 0 \text{{ on }} K \text{{ tokens drawn from }} C"
             rf" \text{{ (seed {part.seed})}},\ 1 \text{{ elsewhere}}")
    else:
        s = r"s_{i,t} &= 1 - \frac{\min(K,\ |C|)}{|C|} \text{ on } C,\ 1 \text{ elsewhere}"
    ppo = _ppo(PPOClip(part.eps_low, part.eps_high), a)
    return Term(rf"s_{{i,t}}\,{ppo.tex}", (s, band, *_covariance(part, a), R_DEF))


def _kl_cov(part: KLCov, a: str) -> Term:
    return Term(rf"{R}\,{a} - {number(part.coef)}\,m_{{i,t}}\,\big|\log {R}\big|",
                (r"m_{i,t} &= 1 \text{ on the } K \text{ tokens of largest }"
                 r" \operatorname{cov}_{i,t},\ 0 \text{ elsewhere}", *_covariance(part, a), R_DEF),
                sum=True)


def _off_policy_mask(part: OffPolicySequenceMask, a: str) -> Term:
    base = surrogate_term(part.base, a)
    q = MU if part.against == "behavior" else OLD
    divergence = rf"\frac{{1}}{{|y_i|}}\sum_{{t}}\log\frac{{{q}(y_{{i,t}})}}{{{THETA}(y_{{i,t}})}}"
    body = rf"\big({base.tex}\big)" if base.sum else base.tex
    return Term(rf"M_i\,{body}",
                (*base.defs, rf"M_i &= 1 - \mathbf{{1}}\Big[{a}<0,\ {divergence}>"
                             rf"{number(part.delta)}\Big]"),
                sequence=base.sequence, known=base.known)


def _entropy_bonus(part: EntropyBonus, a: str) -> Term:
    base = surrogate_term(part.base, a)
    h = r"\hat{h}_{i,t}"
    ratio = f"{R}\\," if "old_logprob" in part.base.requires else ""
    defs = (*base.defs, rf"{h} &= -{ratio}{LOGPI}\quad(\text{{sampled-token entropy}})")
    if ratio:
        defs = (*defs, R_DEF)
    return Term(rf"{base.tex} + {number(part.coef)}\,{h}", defs, sum=True, known=base.known)


_TERMS = {
    Reinforce: lambda part, a: Term(rf"{a}\,{LOGPI}"),
    TokenRatio: lambda part, a: Term(rf"{R}\,{a}", (R_DEF,)),
    SequenceRatio: lambda part, a: Term(rf"\rho(y_i)\,{a}",
                                        (r"\rho(y_i) &= \prod_{t} r_{i,t}", R_DEF),
                                        sequence="split"),
    PPOClip: _ppo, CISPO: _cispo, MiniRL: _minirl, GSPO: _gspo, GSPOToken: _gspo_token,
    SAPO: _sapo, DPPO: _dppo, GMPO: _gmpo, PerDecisionRatio: _per_decision, CTPOClip: _ctpo,
    ClipCov: _clip_cov, KLCov: _kl_cov, OffPolicySequenceMask: _off_policy_mask,
    EntropyBonus: _entropy_bonus,
}


def surrogate_term(part: estimators.Surrogate, advantage: str) -> Term:
    """The per-token term of a surrogate part, in LaTeX.

    Parameters
    ----------
    part : Surrogate
        The estimator's surrogate (its hyperparameters are written as numbers).
    advantage : str
        The LaTeX of the advantage it multiplies (``\\hat{A}_i`` or ``\\hat{A}_{i,t}``).

    Returns
    -------
    Term
        The term of token ``t`` of sequence ``i`` and its definitions; an unknown part's
        ``describe()`` label with ``known`` False.
    """
    render = _TERMS.get(type(part))
    if render is None:
        return Term(rf"{text(part.describe())}\,{advantage}", known=False)
    term = render(part, advantage)
    if term.sequence and "_{i,t}" in advantage:     # a token-level advantage: per token
        tex = term.tex if term.sequence == "each" else rf"\frac{{{term.tex}}}{{|y_i|}}"
        term = dataclasses.replace(term, tex=tex, sequence=None)
    return term
