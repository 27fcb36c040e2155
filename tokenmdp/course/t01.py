"""Tutorial 1 (the exact token MDP): its tables, its two figures and its bookkeeping.

* :class:`Table` — rows under right-aligned headers, one format per column, printed as text;
* :func:`response_table`, :func:`count_table`, :func:`leaf_table` — the responses, the counts
  of responses and the per-prompt sums of the leaves (sections 1 and 2);
* :func:`prefix_tree_figure` — the MDP drawn as one prefix tree per prompt (section 2);
* :func:`state_names`, :func:`route_table`, :func:`route_agreement_table` — the three routes to
  ``∇J`` side by side, coordinate by coordinate and policy by policy (section 3);
* :func:`flat_grad_retained`, :func:`lemma_table` — the expected grad-log-prob lemma (section 4);
* :func:`response_ids`, :func:`monte_carlo_figure`, :func:`monte_carlo_table`,
  :func:`calibration_table` — Monte Carlo REINFORCE next to the exact gradient (section 5).

The gradients themselves (autograd, the enumerated REINFORCE loss, finite differences, the
policy-gradient theorem) are computed in the notebook; a table helper takes them, or the
notebook's functions that compute them, and only arranges and formats the numbers.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence

import matplotlib.pyplot as plt
import torch
from torch import nn

from tokenmdp.batch import TokenBatch
from tokenmdp.exact import TokenMDP, objective, sequence_probs, state_logprobs

__all__ = ["Table", "calibration_table", "count_table", "flat_grad_retained", "leaf_table",
           "lemma_table", "monte_carlo_figure", "monte_carlo_table", "prefix_tree_figure",
           "response_ids", "response_table", "route_agreement_table", "route_table",
           "state_names"]

#: Colour map of the leaves of :func:`prefix_tree_figure` (red: low reward, green: high).
LEAF_COLOR = plt.get_cmap("RdYlGn")
#: Colour of the state markers and of the in-range bars.
STATE_COLOR = "#4c72b0"
#: Colour of the exact gradient and of the out-of-range bars.
EXACT_COLOR = "#c44e52"


class Table:
    """Rows of numbers and names under right-aligned headers, printed as plain text.

    Each column is ``(header, width, spec)``: the header is right-aligned in ``width``
    characters, each value is written as ``format(value, f">{width}{spec}")`` (a sign option of ``spec``
    goes before the width); columns are separated by one space.

    Parameters
    ----------
    columns : sequence of (str, int, str)
        Header, width and format spec (e.g. ``".9f"``, ``"+.2e"``, ``""``) of each column.
    rows : sequence of sequences
        The values, one per column; kept as given in the attribute ``rows`` (a list of tuples).
    """

    def __init__(self, columns: Sequence[tuple[str, int, str]], rows: Sequence[Sequence]):
        self.columns = [(str(h), int(w), str(s)) for h, w, s in columns]
        self.rows = [tuple(row) for row in rows]
        for i, row in enumerate(self.rows):
            if len(row) != len(self.columns):
                raise ValueError(f"rows: row {i} has {len(row)} values for "
                                 f"{len(self.columns)} columns")

    def __str__(self) -> str:
        lines = [" ".join(format(h, f">{w}") for h, w, _ in self.columns)]
        lines += [" ".join(_cell(v, w, s) for v, (_, w, s) in zip(row, self.columns))
                  for row in self.rows]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return str(self)


def _cell(value, width: int, spec: str) -> str:
    # format(value, ">{sign}{width}{rest}"): a sign option (+, -, space) goes before the width
    sign, rest = (spec[0], spec[1:]) if spec and spec[0] in "+- " else ("", spec)
    return format(value, f">{sign}{width}{rest}")


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


def _draw_prefix_tree(ax, mdp: TokenMDP, policy: nn.Module, p: int) -> None:
    # The prefix tree of prompt p left to right: depth on the x axis, leaves one per row.
    with torch.no_grad():
        step_probs = [lp.exp() for lp in state_logprobs(mdp, policy)]  # per depth k: [P, b^k, V]
        seq_probs = sequence_probs(mdp, policy)
    x = mdp.prompts[p]
    leaves = {y: (r, q) for (px, y), r, q in
              zip(mdp.responses(), mdp.rewards.tolist(), seq_probs.tolist(), strict=True)
              if px == x}
    r_lo, r_hi = min(mdp.rewards.tolist()), max(mdp.rewards.tolist())
    rows = itertools.count()  # leaves take consecutive rows, top to bottom

    def leaf(y, depth):
        row = -next(rows)
        r, q = leaves[y]
        ax.plot(depth, row, "s", ms=9, mec="k", color=LEAF_COLOR((r - r_lo) / (r_hi - r_lo)))
        cut = "  (truncated)" if y[-1] != mdp.eos else ""
        ax.text(depth + 0.12, row, f"R={r:+.0f}  π(y|x)={q:.3f}{cut}", va="center", fontsize=8)
        return row

    def state(prefix):
        k = len(prefix)
        if k == mdp.max_len:  # L non-EOS tokens: the prefix is itself a (truncated) response
            return leaf(prefix, k)
        code = int(mdp.encode(torch.tensor(prefix, dtype=torch.long).reshape(1, k)))
        probs = step_probs[k][p, code]
        children = []
        for a in range(mdp.vocab_size):
            row = leaf(prefix + (a,), k + 1) if a == mdp.eos else state(prefix + (a,))
            children.append((a, row))
        row = sum(r for _, r in children) / len(children)
        for a, child_row in children:
            ax.plot([k, k + 1], [row, child_row], color="0.65", lw=1, zorder=0)
            ax.text(k + 0.5, (row + child_row) / 2, f"{_token_name(mdp, a)}: {float(probs[a]):.2f}",
                    ha="center", va="center", fontsize=7.5,
                    bbox=dict(fc="white", ec="none", pad=0.3))
        ax.plot(k, row, "o", ms=8, color=STATE_COLOR, mec="k", zorder=2)
        label = f"x={x}" if k == 0 else " ".join(map(str, prefix))
        ax.text(k, row + 0.35, label, ha="center", va="bottom", fontsize=8)
        return row

    state(())
    ax.set_xlim(-0.3, mdp.max_len + 1.9)
    ax.set_xticks(range(mdp.max_len + 1))
    ax.set_xlabel("response tokens so far (depth)")
    ax.set_ylabel("one row per full response")
    ax.set_yticks([])
    for side in ("left", "right", "top"):
        ax.spines[side].set_visible(False)
    ax.set_title(f"prompt x = {x},  D(x) = {float(mdp.prompt_probs[p]):.1f}")


def prefix_tree_figure(mdp: TokenMDP, policy: nn.Module):
    """The MDP as one prefix tree per prompt, with the policy's probabilities on the edges.

    Circles are states (prompt + prefix), each edge a token labelled ``π(a|s)``, squares the full
    responses (EOS or truncated at ``L``) labelled ``R`` and ``π(y|x)``, coloured by reward. Meant
    for tiny MDPs: every response gets a row.

    Parameters
    ----------
    mdp : TokenMDP
    policy : nn.Module
        A policy of ``mdp`` (anything :func:`~tokenmdp.exact.state_logprobs` accepts).

    Returns
    -------
    matplotlib.figure.Figure
        One panel per prompt, side by side, with a legend on the first.
    """
    fig, axes = plt.subplots(1, mdp.num_prompts, figsize=(7.5 * mdp.num_prompts, 7.5),
                             squeeze=False)
    axes = axes[0]
    for p, ax in enumerate(axes):
        _draw_prefix_tree(ax, mdp, policy, p)
    fig.suptitle("Prefix tree: circles are states, squares are full responses "
                 "(colour = reward), edges are tokens with π(a|s)")
    axes[0].legend(handles=[plt.Line2D([], [], marker="o", ls="", color=STATE_COLOR, mec="k",
                                       label="state (prompt + prefix)"),
                            plt.Line2D([], [], marker="s", ls="", color=LEAF_COLOR(1.0), mec="k",
                                       label="full response (green: high reward, red: low)")],
                   loc="upper left", fontsize=8)
    fig.tight_layout()
    return fig


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


def monte_carlo_figure(mdp: TokenMDP, g_mc: torch.Tensor, se_mc: torch.Tensor,
                       g_exact: torch.Tensor, z: torch.Tensor, n_samples: int):
    """A Monte Carlo estimate of every coordinate of ``∇J`` with ±2 s.e., and its z-scores.

    Coordinates of a tabular policy (state ``j // V``, token ``j mod V``), states separated by
    light vertical lines and named on the x axis.

    Parameters
    ----------
    mdp : TokenMDP
    g_mc, se_mc : Tensor ``[num_states · V]``
        The estimate and its estimated standard errors.
    g_exact : Tensor ``[num_states · V]``
        The exact ``∇J``.
    z : Tensor ``[num_states · V]``
        ``(g_mc − g_exact) / se_mc``; NaN where there is no error bar (drawn as 0).
    n_samples : int
        The number of responses behind the estimate (for the legend).

    Returns
    -------
    matplotlib.figure.Figure
        Top: estimates with error bars and the exact gradient; bottom: the z-scores, those
        beyond ±2 in red.
    """
    v = mdp.vocab_size
    coords = list(range(g_exact.numel()))
    fig, (ax_g, ax_z) = plt.subplots(2, 1, figsize=(14, 7.5), sharex=True,
                                     gridspec_kw=dict(height_ratios=[2, 1]))
    ax_g.errorbar(coords, g_mc.numpy(), yerr=2 * se_mc.numpy(), fmt="o", ms=4, capsize=2,
                  color=STATE_COLOR, label=f"Monte Carlo REINFORCE, n = {n_samples}, ±2 s.e.")
    ax_g.plot(coords, g_exact.numpy(), "x", ms=8, mew=2, color=EXACT_COLOR, label="exact ∇J")
    ax_g.axhline(0, color="0.8", lw=0.8)
    ax_g.set_ylabel("∂J/∂θ_j")
    ax_g.set_title("REINFORCE estimate of every coordinate of ∇J, with ±2 standard errors")
    ax_g.legend(loc="upper right")
    z_shown = z.nan_to_num(0.0).tolist()
    ax_z.bar(coords, z_shown, color=[STATE_COLOR if abs(x) <= 2 else EXACT_COLOR for x in z_shown])
    for level in (-2, 2):
        ax_z.axhline(level, color="0.5", ls="--", lw=0.8)
    ax_z.set_ylabel("z-score")
    ax_z.set_title("z = (estimate − exact) / estimated s.e.  (dashed: ±2)")
    ax_z.set_xlabel(f"coordinate j  (state ⌊j/{v}⌋, token j mod {v})")
    for ax in (ax_g, ax_z):
        for s in range(1, mdp.num_states):
            ax.axvline(s * v - 0.5, color="0.9", lw=0.8, zorder=0)
    ax_z.set_xticks([s * v + 1 for s in range(mdp.num_states)], state_names(mdp), rotation=60,
                    fontsize=7)
    fig.tight_layout()
    return fig


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
