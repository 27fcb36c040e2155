"""Tutorial 1's two figures: the MDP as prefix trees, and Monte Carlo REINFORCE beside the
exact gradient."""

from __future__ import annotations

import itertools

import matplotlib.pyplot as plt
import torch
from torch import nn

from tokenmdp.course.tutorials.t01 import _token_name, state_names
from tokenmdp.exact import TokenMDP, sequence_probs, state_logprobs

__all__ = ["prefix_tree_figure", "monte_carlo_figure"]


#: Colour map of the leaves of :func:`prefix_tree_figure` (red: low reward, green: high).
LEAF_COLOR = plt.get_cmap("RdYlGn")


#: Colour of the state markers and of the in-range bars.
STATE_COLOR = "#4c72b0"


#: Colour of the exact gradient and of the out-of-range bars.
EXACT_COLOR = "#c44e52"


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
