"""Estimator cards: generated from the registry, with a live row equal to an independent moments
computation on the reference MDP (``tokenmdp compare``'s defaults)."""

import re

import pytest
import torch

from tokenmdp import estimators
from tokenmdp.exact import TabularPolicy, TokenMDP, inference_copy, moments, stale_copy
from tokenmdp.exact.world import rewards
from tokenmdp.reports.cards import REFERENCE, WIDTH, card_markdown, card_text, reference_rows

#: The same float64 computation through two routes (shared Jacobian or not).
RTOL = 1e-10


@pytest.fixture(scope="module")
def rows():
    return reference_rows()


def _formula(name: str) -> str:
    doc = estimators.describe(name)
    return " ".join(doc.split("Formula: ")[1].split("\n\n")[0].split())


def test_reference_is_the_compare_defaults_with_exact_moments():
    from tokenmdp.cli import make_parser

    args = vars(make_parser().parse_args(["compare"]))
    for field, value in vars(REFERENCE.setup).items():
        assert value == ("exact" if field == "method" else args[field]), field
    assert "exact moments" in REFERENCE.description and "std 0.3" in REFERENCE.description


def test_reference_rows_equal_an_independent_moments_computation(rows):
    # the reference MDP built by hand from its description, no shared Jacobian
    mdp = TokenMDP(3, 3, rewards.RandomTable(seed=0), prompts=[(0,), (1,)])
    policy = TabularPolicy(mdp, generator=torch.Generator().manual_seed(0))
    old = stale_copy(mdp, policy, distance=0.5)
    mu = inference_copy(old, noise_std=0.3, generator=torch.Generator().manual_seed(1))
    for name in ("grpo", "minirl", "gspo"):
        m = moments(mdp, policy, estimators.get(name), group_size=4, behavior=mu, old=old,
                    reference=old, method="exact")
        for key, value in m.summary().items():
            assert rows[name][key] == pytest.approx(value, rel=RTOL, abs=1e-14), (name, key)
    assert set(rows) == set(estimators.names())


def test_every_card_renders_as_text_and_markdown(rows):
    assert len(rows) == len(estimators.names())
    for name in estimators.names():
        text = card_text(name, rows[name])
        assert text.startswith(f"{name}\n")
        assert max(len(line) for line in text.splitlines()) <= WIDTH
        assert _formula(name) in " ".join(text.split())
        assert f"{rows[name]['mse_c_star']:.4g}" in text
        md = card_markdown(name, rows[name])
        assert md.startswith(f"# {name}\n") and md.count("\n# ") == 0
        assert f"```text\n{_formula(name)}\n```" in md
        assert "| part | what it does | hyperparameters |" in md
        assert f"| {rows[name]['relative_bias']:.4f} | {rows[name]['cosine']:.4f} |" in md
        # only references to public names of tokenmdp.estimators (the docs are nitpicky)
        for target in re.findall(r"\{py:\w+\}`([^`]+)`", md):
            module, _, attr = target.rpartition(".")
            assert module == "tokenmdp.estimators" and attr in estimators.__all__
        assert "On the reference MDP" not in card_markdown(name)       # no row, no section


def test_cards_list_each_frameworks_name_and_what_the_estimator_needs(rows):
    md = card_markdown("ppo")
    # the ';' inside verl's parentheses does not split the item
    assert ("- verl policy_loss.loss_mode=vanilla (clip_ratio; its dual clip at clip_ratio_c, "
            "default 3, is always on: ppo_verl)\n") in md
    assert "- Tinker loss_fn='ppo'" in md
    assert "| needs | old_logprob |" in md
    assert "ref_logprob" in card_markdown("grpo") and "ref_logprob" not in md
    assert "none recorded" in card_text("minirl")


def test_bad_names_fail_clearly():
    with pytest.raises(ValueError, match="did you mean grpo"):
        reference_rows(["grpoo"])
    with pytest.raises(TypeError, match="names"):
        reference_rows("grpo")
    with pytest.raises(ValueError, match="did you mean"):
        card_text("dapoo")
    with pytest.raises(ValueError, match="row: missing"):
        card_markdown("grpo", {"relative_bias": 0.1})
