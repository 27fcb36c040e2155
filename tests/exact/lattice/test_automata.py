"""Reward automata against direct definitions on every response of a small lattice, and the
clear errors of bad automata, rewards, lengths, budgets and policies."""

import itertools

import numpy as np
import pytest
import torch

from tokenmdp.exact import lattice as L


def responses(V, T):
    """Every response of the lattice: k non-EOS tokens then EOS (k < T), or T non-EOS tokens."""
    body = range(V - 1)
    for k in range(T):
        for prefix in itertools.product(body, repeat=k):
            yield (*prefix, V - 1)
    yield from itertools.product(body, repeat=T)


def check_rewards(automaton, T, direct):
    mdp = L.LatticeMDP(automaton, T)
    V = automaton.vocab_size
    for y in responses(V, T):
        ended = y[-1] == V - 1
        assert mdp.reward(y) == direct(y[:-1] if ended else y, ended), y


@pytest.mark.parametrize("target", [(), (0,), (1, 0, 1)])
def test_exact_match(target):
    check_rewards(L.exact_match(target, 3), 4,
                  lambda body, ended: float(ended and tuple(body) == tuple(target)))


@pytest.mark.parametrize("modulus", [2, 3])
def test_token_count_modulo(modulus):
    check_rewards(L.token_count(1, 4, modulus=modulus), 4,
                  lambda body, ended: float(list(body).count(1) % modulus == 0))


def test_token_count_capped():
    check_rewards(L.token_count(0, 3, cap=2), 5,
                  lambda body, ended: float(min(list(body).count(0), 2)))


@pytest.mark.parametrize("pattern", [(0,), (0, 0, 1), (0, 1, 0, 1), (1, 1, 0)])
def test_pattern_appeared(pattern):
    m = len(pattern)
    check_rewards(L.pattern_appeared(pattern, 3), 6,
                  lambda body, ended: float(any(tuple(body[i:i + m]) == tuple(pattern)
                                                for i in range(len(body) - m + 1))))


def test_length_reward_and_truncation_reward():
    aut = L.RewardAutomaton([[1, 0], [1, 1]], [0.0, 1.0], truncation_reward=[5.0, 7.0])
    mdp = L.LatticeMDP(aut, 3, length_reward=-0.5)
    assert mdp.reward((0, 2)) == 1.0 - 1.0            # 0 -> state 1, length 2
    assert mdp.reward((1, 0, 2)) == 1.0 - 1.5
    assert mdp.reward((0, 0, 0)) == 7.0 - 1.5         # truncated in state 1
    assert mdp.reward((1, 1, 1)) == 5.0 - 1.5         # truncated in state 0
    table = L.LatticeMDP(aut, 3, length_reward=[0.0, 0.1, 0.2, 0.4])
    assert table.reward((0, 0, 1)) == 7.0 + 0.4


def test_absorbing_states_end_by_eos_or_truncation():
    """A state all of whose tokens loop to itself traps nothing: EOS is always available and
    ends the response, and truncation ends it after T tokens."""
    aut = L.pattern_appeared([0], 3)                      # state 1 absorbing
    assert (aut.transitions[1] == 1).all()
    mdp = L.LatticeMDP(aut, 3)
    assert mdp.reward((0, 1, 2)) == 1.0 and mdp.reward((0, 1, 1)) == 1.0


@pytest.mark.parametrize("kwargs,match", [
    (dict(transitions=[[0, 2], [1, 1]], eos_reward=[0, 1]), r"transitions: entries must be "
                                                             r"states in \[0, 2\)"),
    (dict(transitions=[[0, 0], [1, 0]], eos_reward=[0, 1]), r"transitions: states \[1\] cannot "
                                                             r"be reached"),
    (dict(transitions=[[1, 1], [1, 1], [0, 0]], eos_reward=[0, 1, 0]),
     r"transitions: states \[2\] cannot be reached"),
    (dict(transitions=[[0.5, 0]], eos_reward=[0]), "transitions: entries must be integer"),
    (dict(transitions=[0, 1], eos_reward=[0, 1]), r"transitions: expected a \[K, V - 1\] table"),
    (dict(transitions=[[1, 0], [0, 1]], eos_reward={2: 1.0}),
     r"eos_reward: reward for state 2, outside the automaton's states \[0, 2\)"),
    (dict(transitions=[[1, 0], [0, 1]], eos_reward=[0, 1, 1]),
     r"eos_reward: expected one reward per state \(2\)"),
    (dict(transitions=[[1, 0], [0, 1]], eos_reward=[0, 1], truncation_reward={-1: 1.0}),
     "truncation_reward: reward for state -1"),
    (dict(transitions=[[1, 0], [0, 1]], eos_reward=[0, float("nan")]),
     "eos_reward: rewards must be finite"),
    (dict(transitions=[[1, 0], [0, 1]], eos_reward=[0, 1], start=2),
     r"start: must be a state in \[0, 2\)"),
])
def test_bad_automata(kwargs, match):
    with pytest.raises(ValueError, match=match):
        L.RewardAutomaton(kwargs.pop("transitions"), kwargs.pop("eos_reward"), **kwargs)


def test_bad_constructor_arguments():
    with pytest.raises(ValueError, match="target: tokens must be non-EOS"):
        L.exact_match([2], 3)
    with pytest.raises(ValueError, match="modulus, cap: give exactly one"):
        L.token_count(0, 3)
    with pytest.raises(ValueError, match="modulus: must be >= 2"):
        L.token_count(0, 3, modulus=1)
    with pytest.raises(ValueError, match="pattern: must not be empty"):
        L.pattern_appeared([], 3)
    with pytest.raises(ValueError, match="vocab_size: must be >= 2"):
        L.exact_match([], 1)


def test_bad_lattices_and_policies():
    aut = L.token_count(0, 8, modulus=4)
    with pytest.raises(ValueError, match="max_len: must be >= 1"):
        L.LatticeMDP(aut, 0)
    with pytest.raises(TypeError, match="automaton: expected a RewardAutomaton"):
        L.LatticeMDP(np.zeros((2, 2)), 3)
    with pytest.raises(ValueError, match=r"max_len=100000, num_states=4 \(automaton\), "
                                         r"vocab_size=8: .*memory budget"):
        L.LatticeMDP(aut, 100_000, memory_budget="64M")
    ring = np.tile(((np.arange(5000) + 1) % 5000)[:, None], (1, 7))    # K = 5000, all reachable
    big = L.RewardAutomaton(ring, np.zeros(5000))
    with pytest.raises(ValueError, match=r"num_states=5000 \(automaton\).*memory budget"):
        L.LatticeMDP(big, 4096)
    with pytest.raises(ValueError, match=r"length_reward: expected a float or 4 values"):
        L.LatticeMDP(aut, 3, length_reward=[0.0, 1.0])
    mdp = L.LatticeMDP(aut, 3)
    with pytest.raises(ValueError, match=r"logits: expected shape \(3, 4, 8\)"):
        L.LatticePolicy(mdp, logits=torch.zeros(3, 4, 7))
    with pytest.raises(TypeError, match="generator: a torch.Generator is required"):
        L.LatticePolicy(mdp)
    other = L.LatticePolicy(L.LatticeMDP(aut, 4), generator=torch.Generator())
    with pytest.raises(ValueError, match="policy: built for a lattice of shape"):
        L.objective(mdp, other)
    with pytest.raises(TypeError, match="behavior: expected a LatticePolicy"):
        L.log_second_moment(mdp, L.LatticePolicy(mdp, generator=torch.Generator()), None)
    with pytest.raises(ValueError, match="level: expected 'sequence' or 'token'"):
        pi = L.LatticePolicy(mdp, generator=torch.Generator())
        L.chi_square(mdp, pi, pi, level="word")
    with pytest.raises(ValueError, match="distance, steps: give exactly one"):
        L.stale_copy(mdp, pi)
    with pytest.raises(TypeError, match="generator: a torch.Generator is required when noise"):
        L.inference_copy(pi, noise_std=0.1)
    with pytest.raises(ValueError, match=r"response: without EOS it must have exactly max_len"):
        mdp.reward((0, 1))
