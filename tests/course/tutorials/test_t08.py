"""Tests of tokenmdp.course.tutorials.t08 (tutorial 8's placements and tables): the k3+ rows
against k2's and k3's, and the trainer-options table against the matches it is given."""

from __future__ import annotations

import pytest

from tokenmdp.course.tutorials import t08
from tokenmdp.exact.analysis.kl_gradients import kl_gradients

#: Two float64 computations of one quantity.
EXACT_TOL = 1e-10


@pytest.fixture(scope="module")
def bandit():
    mdp, pi, ref, _ = t08.kl_world(1)
    return t08.kl_placement_moments(mdp, pi, ref, coef=0.1), kl_gradients(mdp, pi, ref).targets()


def test_every_estimator_in_both_placements_with_trainer_options(bandit):
    placements, _ = bandit
    assert list(placements) == [f"{k} in {where}" for k in t08.KL_ESTIMATORS
                                for where in ("reward", "loss")]
    assert set(placements) == set(t08.TRAINER_OPTIONS)


def test_k3_plus_is_k2_in_the_loss_and_k3_in_the_reward(bandit):
    placements, targets = bandit
    scale = float(targets["reverse KL"].norm())
    for plus, same in (("k3+ in loss", "k2 in loss"), ("k3+ in reward", "k3 in reward")):
        assert float((placements[plus].mean - placements[same].mean).norm()) <= EXACT_TOL * scale
        assert abs(placements[plus].total_variance - placements[same].total_variance) < EXACT_TOL


def test_the_option_table_has_one_row_per_placement_with_what_it_delivers(bandit):
    placements, targets = bandit
    matches = t08.kl_matches(placements, targets, coef=0.1, tol=EXACT_TOL)
    text = str(t08.kl_option_table(matches))
    lines = text.splitlines()
    assert len(lines) == 1 + len(placements)
    for name, line in zip(placements, lines[1:]):
        verl, trl = t08.TRAINER_OPTIONS[name]
        assert line.split()[:3] == name.split() and verl in line and trl in line
        assert (" = ".join(matches[name]) or "none of these") in line
    assert "kl_loss_type=k3 (low_var_kl)" in lines[1 + list(placements).index("k3 in loss")]


def test_the_option_table_refuses_a_placement_without_options(bandit):
    placements, targets = bandit
    matches = t08.kl_matches(placements, targets, coef=0.1, tol=EXACT_TOL)
    with pytest.raises(ValueError, match="no trainer options for k9 in loss"):
        t08.kl_option_table({**matches, "k9 in loss": ()})
