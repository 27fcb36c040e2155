"""Tutorial 1 (the exact token MDP): its tables, its two figures and its bookkeeping.

* tables are :class:`tokenmdp.course.display.Table` (rows under right-aligned headers, as text);
* :func:`response_table`, :func:`count_table`, :func:`leaf_table` — the responses, the counts
  of responses and the per-prompt sums of the leaves (sections 1 and 2);
* :func:`prefix_tree_figure` — the MDP drawn as one prefix tree per prompt (section 2);
* :func:`state_names`, :func:`route_table`, :func:`route_agreement_table` — the three routes to
  ``∇J`` side by side, coordinate by coordinate and policy by policy (section 3);
* :func:`flat_grad_retained`, :func:`lemma_table` — the expected grad-log-prob lemma (section 4);
* :func:`response_ids`, :func:`~tokenmdp.course.tutorials.t01_figures.monte_carlo_figure`,
  :func:`monte_carlo_table`, :func:`calibration_table` — Monte Carlo REINFORCE next to the
  exact gradient (section 5).

The gradients themselves (autograd, the enumerated REINFORCE loss, finite differences, the
policy-gradient theorem) are computed in the notebook; a table helper takes them, or the
notebook's functions that compute them, and only arranges and formats the numbers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
from torch import nn

from tokenmdp.batch import TokenBatch
from tokenmdp.course.display import Table
from tokenmdp.exact import TokenMDP, objective

__all__ = ["calibration_table", "count_table", "flat_grad_retained", "leaf_table",
           "lemma_table", "monte_carlo_table", "response_ids", "response_table",
           "route_agreement_table", "route_table", "state_names"]


def _token_name(mdp: TokenMDP, token: int) -> str:
    return "EOS" if token == mdp.eos else str(token)


def response_table(mdp: TokenMDP, first: int = 15) -> Table:
    """The first responses of ``mdp`` in canonical order, with their length and reward.

    Parameters
    ----------
    mdp : TokenMDP
    first : int
        How many responses to list.

    Returns
    -------
    Table
        Rows ``(prompt, response, length, R(x, y))``; the response's tokens are separated by
        spaces, EOS written ``EOS``.
    """
    rows = [(str(x), " ".join(_token_name(mdp, t) for t in y), len(y), r)
            for (x, y), r in zip(mdp.responses()[:first], mdp.rewards[:first].tolist(),
                                 strict=True)]
    return Table([("prompt", 7, ""), ("response", 14, ""), ("length", 6, ""),
                  ("R(x,y)", 7, "+.0f")], rows)


def count_table(cases: Sequence[tuple[int, int]], closed_form: Callable[[int, int], int],
                brute_force: Callable[[int, int], int]) -> Table:
    """Responses per prompt three ways: a closed form, a brute-force count and ``TokenMDP``.

    Parameters
    ----------
    cases : sequence of (int, int)
        The ``(V, L)`` pairs, one row each.
    closed_form, brute_force : callable
        ``(V, L) -> int``: the notebook's two counts.

    Returns
    -------
    Table
        Rows ``(V, L, closed form, brute force, TokenMDP.num_sequences, TokenMDP − closed
        form)``, the MDP with one prompt and zero reward.
    """
    rows = []
    for v, l in cases:
        m = TokenMDP(v, l, lambda x, y: 0.0)      # one prompt, zero reward: only the count matters
        exact = closed_form(v, l)
        rows.append((v, l, exact, brute_force(v, l), m.num_sequences, m.num_sequences - exact))
    return Table([("V", 3, ""), ("L", 3, ""), ("closed form", 12, ""), ("brute force", 12, ""),
                  ("TokenMDP", 9, ""), ("difference", 11, "")], rows)


def leaf_table(mdp: TokenMDP, probs_S: torch.Tensor, values_V: torch.Tensor) -> Table:
    """Per prompt: the leaves' total probability, ``J_x`` from the leaves and ``V(root)``.

    Parameters
    ----------
    mdp : TokenMDP
    probs_S : Tensor ``[num_sequences]``
        ``π(y|x)`` of every response in canonical order (:func:`~tokenmdp.exact.sequence_probs`).
    values_V : Tensor ``[num_states]``
        The state values ``V(s)`` (:func:`~tokenmdp.exact.values`' ``V``).

    Returns
    -------
    Table
        Rows ``(prompt, Σ_y π(y|x), J_x = Σ_y π(y|x) R(x, y), V(root of x), J_x − V(root))``
        with floats.
    """
    rows = []
    for p in range(mdp.num_prompts):
        mine = mdp.terminal_prompt_index == p
        j_x = float((probs_S[mine] * mdp.rewards[mine]).sum())
        root_value = float(values_V[mdp.level_offsets[0] + p])   # depth-0 state of prompt p
        rows.append((str(mdp.prompts[p]), float(probs_S[mine].sum()), j_x, root_value,
                     j_x - root_value))
    return Table([("prompt", 6, ""), ("Σ_y π(y|x)", 12, ".9f"), ("J_x from leaves", 16, ".12f"),
                  ("V(root)", 15, ".12f"), ("difference", 11, ".1e")], rows)


def state_names(mdp: TokenMDP) -> list[str]:
    """``"x | prefix"`` for every non-terminal state, in state-id order.

    States are numbered level by level (depth 0 of every prompt, then depth 1, …), the order of
    ``mdp.level_prefixes(k)``; the empty prefix is written ``·``.

    Parameters
    ----------
    mdp : TokenMDP

    Returns
    -------
    list of str
        ``mdp.num_states`` names.
    """
    names = []
    for k in range(mdp.max_len):
        prompt_index, prefix = mdp.level_prefixes(k)
        for p, pre in zip(prompt_index.tolist(), prefix.tolist(), strict=True):
            names.append(f"{mdp.prompts[p]} | " + (" ".join(map(str, pre)) or "·"))
    return names


def _coordinate(mdp: TokenMDP, names: list[str], j: int) -> tuple[int, str, str]:
    # A tabular policy's coordinate j is the logit of token j mod V at state j // V.
    return j, names[j // mdp.vocab_size], _token_name(mdp, j % mdp.vocab_size)


def route_table(mdp: TokenMDP, g_auto: torch.Tensor, g_enum: torch.Tensor, g_fd: torch.Tensor,
                coords: Sequence[int]) -> Table:
    """The three routes to ``∇J`` side by side at the coordinates ``coords`` of a tabular policy.

    Parameters
    ----------
    mdp : TokenMDP
    g_auto, g_enum, g_fd : Tensor ``[num_states · V]``
        ``∇J`` by autograd, by the enumerated REINFORCE loss and by finite differences.
    coords : sequence of int
        The coordinates to list.

    Returns
    -------
    Table
        Rows ``(coord, state, token, autograd, REINFORCE, finite diff, autograd − REINFORCE,
        autograd − finite diff)``.
    """
    names = state_names(mdp)
    rows = [(*_coordinate(mdp, names, j), float(g_auto[j]), float(g_enum[j]), float(g_fd[j]),
             float(g_auto[j] - g_enum[j]), float(g_auto[j] - g_fd[j])) for j in coords]
    return Table([("coord", 5, ""), ("state", 10, ""), ("token", 5, ""), ("autograd", 13, ".9f"),
                  ("REINFORCE", 13, ".9f"), ("finite diff", 13, ".9f"),
                  ("auto-REINF", 11, ".1e"), ("auto-FD", 10, ".1e")], rows)


def route_agreement_table(mdp: TokenMDP, policies: Mapping[str, nn.Module],
                          grad_autograd: Callable, grad_reinforce: Callable,
                          grad_finite_differences: Callable) -> Table:
    """``J`` two ways and the largest gaps between the three gradient routes, per policy.

    ``J`` by :func:`~tokenmdp.exact.objective` and as ``Σ D(x) π(y|x) R(x, y)`` over the rows of
    ``mdp.enumerate()`` with the policy's token log-probs (no autograd).

    Parameters
    ----------
    mdp : TokenMDP
    policies : mapping of str to nn.Module
        Name → policy, one row each.
    grad_autograd, grad_reinforce, grad_finite_differences : callable
        ``(mdp, policy) -> Tensor [num_params]``: the notebook's three routes.

    Returns
    -------
    Table
        Rows ``(name, num_params, J (objective), J (enumerated batch), max |autograd −
        REINFORCE|, max |autograd − finite diff|)`` with floats.
    """
    rows = []
    for name, pol in policies.items():
        batch = mdp.enumerate()
        with torch.no_grad():
            seq_logprobs_S = batch.sequence_sum(pol.token_logprobs(batch))
            j_batch = (mdp.prompt_probs[batch.prompt_index] * seq_logprobs_S.exp()
                       * batch.reward).sum()
            j_obj = objective(mdp, pol)
        ga = grad_autograd(mdp, pol)
        ge = grad_reinforce(mdp, pol)
        gf = grad_finite_differences(mdp, pol)
        rows.append((name, ga.numel(), float(j_obj), float(j_batch),
                     float((ga - ge).abs().max()), float((ga - gf).abs().max())))
    return Table([("policy", 16, ""), ("params", 6, ""), ("J (objective)", 14, ".10f"),
                  ("J (enumerated batch)", 21, ".10f"), ("|auto-REINF|", 13, ".1e"),
                  ("|auto-FD|", 10, ".1e")], rows)


def flat_grad_retained(output: torch.Tensor, module: nn.Module) -> torch.Tensor:
    """Like :func:`~tokenmdp.exact.flat_grad`, but keeps the graph for the next output.

    Parameters
    ----------
    output : Tensor
        A scalar computed from ``module``'s parameters (with its autograd graph).
    module : nn.Module
        The module whose parameters the gradient is taken in.

    Returns
    -------
    Tensor ``[num_params]``
        ``d output / d θ`` in ``module.parameters()`` order, zeros where ``output`` does not
        depend on a parameter.
    """
    params = list(module.parameters())
    grads = torch.autograd.grad(output, params, retain_graph=True, allow_unused=True)
    return torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1)
                      for p, g in zip(params, grads, strict=True)])


def lemma_table(mdp: TokenMDP, policies: Mapping[str, nn.Module],
                expected_score_per_state: Callable) -> Table:
    """Per policy: the largest entry of ``E_a[∇log π(a|s)]`` over all states, and the scores.

    Parameters
    ----------
    mdp : TokenMDP
    policies : mapping of str to nn.Module
        Name → policy, one row each.
    expected_score_per_state : callable
        ``(mdp, policy) -> (Tensor [num_states, num_params], Tensor [num_states])``: per state
        ``E_a[∇log π(a|s)]`` and ``max_a ‖∇log π(a|s)‖`` (the notebook's function).

    Returns
    -------
    Table
        Rows ``(name, max_s ‖E_a[∇log π(a|s)]‖_∞, exact value 0, difference, min_s max_a
        ‖∇log π(a|s)‖)``.
    """
    rows = []
    for name, pol in policies.items():
        expectation_SN, score_norm_S = expected_score_per_state(mdp, pol)
        violation = float(expectation_SN.abs().max())
        rows.append((name, violation, 0, violation, float(score_norm_S.min())))
    return Table([("policy", 16, ""), ("max_s ||E_a[∇log π(a|s)]||_∞", 29, ".1e"),
                  ("exact", 6, ""), ("difference", 11, ".1e"),
                  ("min_s max_a ||∇log π(a|s)||", 28, ".3f")], rows)


def response_ids(mdp: TokenMDP, batch: TokenBatch) -> torch.Tensor:
    """The canonical response id (position in ``mdp.responses()``) of every sequence of ``batch``.

    Parameters
    ----------
    mdp : TokenMDP
    batch : TokenBatch
        Sequences of ``mdp`` (e.g. from :func:`~tokenmdp.exact.sample`), any layout.

    Returns
    -------
    Tensor ``[num_sequences]`` (long)
        ``mdp.terminal_index`` of each sequence's prompt and response.
    """
    rpos = batch.response_position                                 # [R, C], -1 off the response
    on = rpos >= 0
    responses = torch.full((batch.num_sequences, mdp.max_len), mdp.eos, dtype=torch.long)
    responses[batch.sequence_id[on], rpos[on]] = batch.tokens[on]
    return mdp.terminal_index(batch.prompt_index, responses, batch.length)


def monte_carlo_table(mdp: TokenMDP, coords: Sequence[int], g_mc: torch.Tensor,
                      se_mc: torch.Tensor, se_exact: torch.Tensor, g_exact: torch.Tensor,
                      z: torch.Tensor) -> Table:
    """The Monte Carlo estimate next to the exact gradient at the coordinates ``coords``.

    Parameters
    ----------
    mdp : TokenMDP
    coords : sequence of int
        Coordinates of a tabular policy (state ``j // V``, token ``j mod V``).
    g_mc : Tensor ``[num_params]``
        The estimate.
    se_mc, se_exact : Tensor ``[num_params]``
        Its estimated and its exact standard errors.
    g_exact : Tensor ``[num_params]``
        The exact ``∇J``.
    z : Tensor ``[num_params]``
        The z-scores ``(g_mc − g_exact) / se_mc``.

    Returns
    -------
    Table
        Rows ``(coord, state, token, estimate, s.e. (estimated), s.e. (exact), ∇J, estimate −
        ∇J, z)``.
    """
    names = state_names(mdp)
    rows = [(*_coordinate(mdp, names, j), float(g_mc[j]), float(se_mc[j]), float(se_exact[j]),
             float(g_exact[j]), float(g_mc[j] - g_exact[j]), float(z[j])) for j in coords]
    return Table([("coord", 5, ""), ("state", 10, ""), ("token", 5, ""),
                  ("MC estimate", 12, ".5f"), ("s.e. (est)", 11, ".5f"),
                  ("s.e. (exact)", 13, ".5f"), ("exact ∇J", 11, ".5f"),
                  ("difference", 11, "+.5f"), ("z", 6, "+.2f")], rows)


#: ``P(|Z| ≤ 2)`` for a standard normal ``Z`` (to four digits).
NORMAL_WITHIN_2 = 0.9545


def calibration_table(z_squared: torch.Tensor, squared_errors: Sequence[float],
                      cov_exact: torch.Tensor, n_samples: int) -> Table:
    """Repeated Monte Carlo estimates against what calibrated error bars predict.

    With the exact standard errors, ``E[z_j²] = 1``; ``E‖ĝ − ∇J‖² = tr Σ / n``; and, in the
    normal approximation, ``P(|z_j| ≤ 2) ≈ 0.9545``.

    Parameters
    ----------
    z_squared : Tensor
        ``z_j²`` (exact standard errors) of every coordinate and repetition, concatenated.
    squared_errors : sequence of float
        ``‖ĝ − ∇J‖²`` of each repetition.
    cov_exact : Tensor ``[num_params, num_params]``
        ``Σ``, the exact covariance of one sample's term.
    n_samples : int
        ``n``, the samples behind each estimate.

    Returns
    -------
    Table
        Rows ``(quantity, mean over repetitions, exact value, difference)``.
    """
    quantities = [("mean z_j^2", float(z_squared.mean()), 1.0),
                  ("mean ||ĝ - ∇J||^2", sum(squared_errors) / len(squared_errors),
                   float(cov_exact.trace()) / n_samples),
                  ("fraction |z_j| <= 2", float((z_squared <= 4).double().mean()),
                   NORMAL_WITHIN_2)]
    rows = [(name, estimate, exact, estimate - exact) for name, estimate, exact in quantities]
    return Table([("quantity", 20, ""), ("estimate", 10, ".4g"), ("exact", 10, ".4g"),
                  ("difference", 11, "+.2g")], rows)
