"""Estimator cards' formulas as math: every registry entry's card has a MathJax block composed
from its parts, the LaTeX is balanced and uses only macros MathJax's TeX input knows, the plain
text stays, and the terminal card has no math."""

import dataclasses
import inspect
import re
from pathlib import Path

import pytest

from tokenmdp import estimators
from tokenmdp.estimators import Aggregation, Estimator, KLPenalty, Level
from tokenmdp.estimators import kl as kl_module
from tokenmdp.reports.card_math import NOTATION, WIDE, loss_latex, math_block
from tokenmdp.reports.cards import card_markdown, card_text
from tokenmdp.reports.latex_terms import number, text, width

#: Every macro the formulas may use: TeX's base and the AMS package, both in MathJax's
#: ``tex-chtml.js`` without any extension to load (checked below against the bundled file).
ALLOWED_MACROS = {
    # structure and spacing
    "begin", "end", "frac", "tfrac", "sqrt", "text", "mathrm", "mathbf", "mathcal",
    "operatorname", "hat", "bar", "tilde", "overline", "quad", "qquad", ",", " ", "\\",
    "big", "Big", "ldots", "textstyle",
    # operators and relations
    "sum", "prod", "min", "max", "exp", "log", "le", "ge", "ne", "in", "times", "cdot",
    "lfloor", "rfloor",
    # Greek
    "pi", "theta", "mu", "rho", "sigma", "tau", "beta", "chi", "kappa", "ell",
    # escaped characters of \text (latex_terms.text)
    "{", "}", "_", "#", "%", "&", "$", "^", "~", "backslash",
}
#: Environments the formulas may open (``aligned`` is in MathJax's AMS package).
ALLOWED_ENVIRONMENTS = {"aligned"}
#: The MathJax bundled into the site (sphinx-mathjax-offline), when installed.
MATHJAX = next((p / "sphinx-mathjax-offline" / "static" / "mathjax" / "tex-chtml.js"
                for p in map(Path, __import__("sys").path)
                if (p / "sphinx-mathjax-offline" / "static" / "mathjax" / "tex-chtml.js").exists()),
               None)

MACRO = re.compile(r"\\([A-Za-z]+|.)")


def macros(tex: str) -> set[str]:
    return set(MACRO.findall(tex))


def check_latex(tex: str) -> None:
    """Balanced braces, brackets, parentheses, environments and \\left/\\right; allowed macros."""
    unknown = macros(tex) - ALLOWED_MACROS
    assert not unknown, f"macros outside the allow-list: {sorted(unknown)}\n{tex}"
    assert set(re.findall(r"\\begin\{(\w+)\}", tex)) <= ALLOWED_ENVIRONMENTS
    assert re.findall(r"\\begin\{(\w+)\}", tex) == re.findall(r"\\end\{(\w+)\}", tex)
    assert tex.count(r"\left") == tex.count(r"\right"), tex
    bare = re.sub(r"\\[{}]", "", tex)               # \{ and \} are characters, not groups
    stack, pairs = [], {"}": "{", ")": "(", "]": "["}
    for char in bare:
        if char in "{([":
            stack.append(char)
        elif char in pairs:
            assert stack and stack.pop() == pairs[char], f"unbalanced {char!r} in\n{tex}"
    assert not stack, f"unclosed {stack} in\n{tex}"
    assert "$" not in tex.replace(r"\$", "") and "\n\n" not in tex   # MyST ends $$ there


@pytest.mark.parametrize("name", estimators.names())
def test_every_card_has_its_formula_as_math_beside_the_plain_text(name):
    md = card_markdown(name)
    block = math_block(name)
    assert block in md
    assert block.startswith("$$\n\\begin{aligned}\n\\mathcal{L}(\\theta) &= -")
    assert block.endswith("\\end{aligned}\n$$")
    formula = " ".join(estimators.describe(name).split("Formula: ")[1].split("\n\n")[0].split())
    plain = f"```text\n{formula}\n```"
    assert plain in md and md.index(block) < md.index(NOTATION) < md.index(plain)
    tex = loss_latex(estimators.get(name))
    assert tex.known, f"{name}: a part has no LaTeX form (written as its describe() label)"
    check_latex(tex.tex)


@pytest.mark.parametrize("name", estimators.names())
def test_the_terminal_card_keeps_plain_text_only(name):
    out = card_text(name)
    assert "$$" not in out and "\\begin" not in out and "\\frac" not in out


def test_every_line_fits_the_docs_column():
    # about 8 px a character at MathJax's size: 64 characters fill most of a 600 px column
    for name in estimators.names():
        tex = loss_latex(estimators.get(name)).tex
        lines = [line.removesuffix(" \\\\") for line in tex.split("\n")[1:-1]]
        for line in lines:
            assert width(line) <= 64, (name, line)
        first = lines[0]
        assert width(first) <= WIDE, (name, first)
    assert width(r"\frac{\operatorname{mean}_j R_j}{N}") == len("meanj Rj")


def test_the_allowed_macros_are_in_the_bundled_mathjax():
    if MATHJAX is None:
        pytest.skip("sphinx-mathjax-offline is not installed (pip install -e '.[docs]')")
    js = MATHJAX.read_text(encoding="utf-8", errors="replace")
    missing = [m for m in ALLOWED_MACROS | ALLOWED_ENVIRONMENTS
               if m.isalpha() and not re.search(rf'[,{{]{m}:|"\\\\{m}"', js)]
    assert not missing, f"not in MathJax's TeX input tables: {missing}"


def test_formulas_follow_the_parts_and_their_hyperparameters():
    def tex(name):
        return loss_latex(estimators.get(name)).tex

    assert r"\operatorname{clip}(r_{i,t},\ 0.8,\ 1.28)" in tex("dapo")
    assert r"-\frac{1}{N}\sum_{i=1}^{S}\sum_{t=1}^{|y_i|}" in tex("dapo")
    assert r"-\frac{1}{S}\sum_{i=1}^{S}\frac{1}{|y_i|}\sum_{t=1}^{|y_i|}\Big[" in tex("grpo")
    assert r"\beta = 0.04" in tex("grpo") and r"- \beta\,k_{i,t}" in tex("grpo")
    # a term the same on every token of a sequence is summed by hand (GSPO, LUSPO, sequence IS)
    assert r"-\frac{1}{S}\sum_{i=1}^{S}\min\big(s_i\,\hat{A}_i" in tex("gspo")
    assert r"1-3\times10^{-4},\ 1+4\times10^{-4}" in tex("gspo")
    assert r"-\frac{1}{S}\sum_{i=1}^{S}|y_i|\,\min\big(s_i" in tex("luspo")
    assert r"-\frac{1}{S}\sum_{i=1}^{S}W_i\,\rho(y_i)\,\hat{A}_i" in tex("sequence_is")
    # ... but not when a per-token factor multiplies it
    assert r"\frac{1}{|y_i|}\sum_{t=1}^{|y_i|}\min(w_{i,t},\ 2)\,f_i \\" in tex("gspo_tis")
    assert "\nf_i &= \\min\\big(s_i" in tex("gspo_tis")     # a long term on a line of its own
    assert r"-\sum_{i=1}^{S}\sum_{t=1}^{|y_i|}\operatorname{sg}\big(\operatorname{clip}(r_{i,t},\ 0,\ 4)" \
        in tex("cispo_tinker")
    assert r"3\,\hat{A}_i\,\mathbf{1}[\hat{A}_i<0]" in tex("ppo_verl")
    assert r"3\,\hat{A}_i" not in tex("ppo")
    assert r"\chi_i &= \mathbf{1}\Big[0.5 \le \prod_{t}" in tex("grpo_rs_seq")
    assert r"-\beta\sum_{s\ge t} k_{i,s}" in tex("reinforce_pp_kl").replace(" - ", "-")
    assert r"\frac{W_i}{\overline{W}}" in tex("sequence_snis")
    assert r"10^{-6}" in tex("grpo") and r"10^{-4}" in tex("grpo_batch_std")


def test_numbers_are_written_for_reading():
    assert [number(v) for v in (0.2, 3.0, 1e-6, 3e-4, 2.5e-4, 0.002, 1e7)] == [
        "0.2", "3", "10^{-6}", r"3\times10^{-4}", r"2.5\times10^{-4}", "0.002", "10^{7}"]
    assert text("a_b {c} 50%") == r"\text{a\_b \{c\} 50\%}"


def _parts():
    """One instance of every part class ``tokenmdp.estimators`` exports, in several settings."""
    from tokenmdp.estimators import (
        CISPO,
        DPPO,
        CTPOClip,
        EntropyBonus,
        MaskedIS,
        OffPolicySequenceMask,
        PPOClip,
        RejectionSampling,
        RewardToGo,
        SelfNormalizedIS,
        TruncatedIS,
    )
    special = {
        EntropyBonus: [EntropyBonus(PPOClip()), EntropyBonus(estimators.Reinforce())],
        OffPolicySequenceMask: [OffPolicySequenceMask(PPOClip(), against="old")],
        MaskedIS: [MaskedIS(high=5.0, low=0.5, masked_in_normalizer=False,
                            level=Level.GEOMETRIC)],
        RejectionSampling: [RejectionSampling(statistic=s, high=2.0, reduce=r,
                                              masked_in_normalizer=m)
                            for s, r, m in (("k1", "mean", True), ("k2", "max", False),
                                            ("k3", "sum", True), ("k2", "token", False))],
        TruncatedIS: [TruncatedIS(cap=2.0, floor=0.5, level=Level.SEQUENCE)],
        SelfNormalizedIS: [SelfNormalizedIS(cap=3.0), SelfNormalizedIS(level=Level.GEOMETRIC)],
        DPPO: [DPPO(divergence="kl", cap=3.0)],
        CISPO: [CISPO(mask_eps_low=0.2, mask_eps_high=0.2)],
        CTPOClip: [CTPOClip(power=0.0, against="behavior"), CTPOClip(power=0.3, dual_clip=0.1)],
        RewardToGo: [RewardToGo(baseline="none", whiten=False)],
    }
    bases = (estimators.Surrogate, estimators.Advantage, estimators.Correction)
    out = []
    for name in estimators.__all__:
        cls = getattr(estimators, name)
        if not inspect.isclass(cls) or not issubclass(cls, bases) or inspect.isabstract(cls) \
                or cls in bases or cls is estimators.TokenAdvantage:
            continue
        out += special.get(cls, []) + ([] if cls in (EntropyBonus, OffPolicySequenceMask,
                                                     MaskedIS, RejectionSampling) else [cls()])
    return out


def test_any_composition_of_the_exported_parts_gets_balanced_math():
    surrogate_types = (estimators.Surrogate,)
    parts = _parts()
    surrogates = [p for p in parts if isinstance(p, surrogate_types)]
    advantages = [p for p in parts if isinstance(p, estimators.Advantage)]
    corrections = [p for p in parts if isinstance(p, estimators.Correction)]
    kls = [None] + [KLPenalty(coef=0.1, in_reward=r, estimator=k, importance_weighted=w)
                    for k in (kl_module.kl_k1, kl_module.kl_k2, kl_module.kl_k3,
                              kl_module.kl_k3_plus, kl_module.kl_abs)
                    for r, w in ((True, False), (False, False), (False, True))]
    count = 0
    for i, surrogate in enumerate(surrogates):
        for j, advantage in enumerate(advantages):
            correction = corrections[(i + j) % len(corrections)]
            kl = kls[(i * 7 + j) % len(kls)]
            aggregation = list(Aggregation)[(i + 2 * j) % len(Aggregation)]
            est = Estimator(surrogate=surrogate, advantage=advantage, correction=correction,
                            aggregation=aggregation, kl=kl)
            tex = loss_latex(est)
            assert tex.known, est
            check_latex(tex.tex)
            count += 1
    assert count >= 100


def test_a_part_without_a_latex_form_is_written_as_its_label():
    @dataclasses.dataclass(frozen=True)
    class Mine(estimators.Surrogate):
        def __call__(self, logprobs_RC, batch):
            raise NotImplementedError

        def describe(self):
            return "my_term {x} & 5%"

    tex = loss_latex(Estimator(surrogate=Mine(), advantage=estimators.GroupMean()))
    assert not tex.known
    assert r"\text{my\_term \{x\} \& 5\%}\,\hat{A}_i" in tex.tex
    check_latex(tex.tex)


def test_a_composition_by_hand_reads_as_its_parts_say():
    from tokenmdp.estimators import ImportanceSampling, LeaveOneOut, SequenceRatio, TruncatedIS

    # a penalized reward feeds every reward of the baseline
    tex = loss_latex(Estimator(surrogate=estimators.TokenRatio(), advantage=LeaveOneOut(),
                               kl=KLPenalty(coef=0.1, in_reward=True,
                                            estimator=kl_module.kl_k2))).tex
    assert r"\hat{A}_i &= \tilde{R}_i - \frac{1}{|g(i)|-1}\sum_{j\in g(i),\,j\ne i} \tilde{R}_j" \
        in tex
    assert r"\tilde{R}_i &= R_i - \beta\sum_{t} k_{i,t}" in tex and r"\pi_{\text{old}}" in tex
    # sequence IS spreads rho(y_i) A_i over the tokens: a per-token factor keeps the share
    tex = loss_latex(Estimator(surrogate=SequenceRatio(), advantage=estimators.GroupMean(),
                               correction=TruncatedIS(cap=2.0),
                               aggregation=Aggregation.SEQUENCE_MEAN_TOKEN_SUM)).tex
    assert r"\sum_{t=1}^{|y_i|}\min(w_{i,t},\ 2)\,\frac{\rho(y_i)\,\hat{A}_i}{|y_i|}" in tex
    tex = loss_latex(Estimator(surrogate=SequenceRatio(), advantage=estimators.GroupMean(),
                               correction=ImportanceSampling(level=Level.SEQUENCE),
                               aggregation=Aggregation.SEQUENCE_MEAN_TOKEN_MEAN)).tex
    assert r"-\frac{1}{S}\sum_{i=1}^{S}\frac{W_i\,\rho(y_i)\,\hat{A}_i}{|y_i|}" in tex
