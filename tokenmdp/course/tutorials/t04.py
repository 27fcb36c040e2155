"""Tutorial 4's tables, figure and repeated setup: aggregation and length bias.

* :func:`conditional_length` and :func:`expected_inverse_length` — the two length statistics of
  the tutorial's answer-then-chatter MDP that :mod:`tokenmdp.exact` does not provide;
* :func:`weight_table` and :func:`sequence_total_table` — section 2's per-token weights of one
  packed batch under every aggregation, and their sums per sequence;
* :func:`cosine_table` and :func:`closed_form_table` — sections 3 and 4's exact expected
  gradients against ``∇J``, ``∇E[(R − J)/|y|]`` and their closed forms;
* :func:`length_drift_figure` and :func:`conditional_length_table` — section 5's exact ascent
  tracks;
* :func:`micro_batch_table` — section 6's micro-batch losses against the full step.

Each table comes back as a :class:`Printout`: the text the notebook prints and the numbers
behind it (``rows``); the figure as a :class:`matplotlib.figure.Figure`, for the notebook to show.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
import torch
from torch import nn

from tokenmdp.batch import TokenBatch
from tokenmdp.course.display import Printout
from tokenmdp.estimators import Aggregation
from tokenmdp.exact import TokenMDP, flat_grad, sequence_probs

__all__ = ["closed_form_table", "conditional_length", "conditional_length_table",
           "cosine_table", "expected_inverse_length", "length_drift_figure", "micro_batch_table",
           "sequence_total_table", "weight_table"]

# Column labels of the aggregations, in ``Aggregation`` order.
_SHORT = {Aggregation.TOKEN_MEAN: "tok-mean", Aggregation.SEQUENCE_MEAN_TOKEN_MEAN: "seq-tmean",
          Aggregation.SEQUENCE_MEAN_TOKEN_SUM: "seq-tsum", Aggregation.CONSTANT: "constant",
          Aggregation.TOKEN_SUM: "tok-sum", Aggregation.PROMPT_MEAN_TOKEN_MEAN: "prm-tmean"}

# Colour and line style of each aggregation (by its ``Aggregation.value``) in the drift figure.
_STYLE = {"token-mean": ("#dd8452", "-"), "seq-mean-token-mean": ("#c44e52", "-"),
          "seq-mean-token-sum": ("#4c72b0", "-"), "constant": ("#55a868", "--"),
          "token-sum": ("#8172b3", ":")}


def _modes(mapping: Mapping) -> list[Aggregation]:
    modes = list(mapping)
    unknown = [m for m in modes if not isinstance(m, Aggregation)]
    if unknown:
        raise TypeError(f"expected Aggregation keys, got {unknown[0]!r}")
    return modes


def conditional_length(mdp: TokenMDP, policy: nn.Module, answer: int) -> torch.Tensor:
    """``E[|y| | y_1 = answer]``: how long the responses are that start with the token ``answer``.

    ``Σ D(x) π(y|x) |y| / Σ D(x) π(y|x)``, both sums over the responses whose first token is
    ``answer`` (EOS included: ``|y| = 1``). Differentiable in ``policy``'s parameters.

    Parameters
    ----------
    mdp : TokenMDP
        The exact MDP.
    policy : nn.Module
        ``π_θ``.
    answer : int
        A token id, ``0 <= answer < mdp.vocab_size``.

    Returns
    -------
    Tensor
        A 0-d float64 tensor.
    """
    if isinstance(answer, bool) or not isinstance(answer, int):
        raise TypeError(f"answer: expected a token id (int), got {type(answer).__name__}")
    if not 0 <= answer < mdp.vocab_size:
        raise ValueError(f"answer: expected a token id in [0, {mdp.vocab_size}), got {answer}")
    first = torch.tensor([y[0] for _, y in mdp.responses()])
    mine = first == answer
    probs = mdp.prompt_probs[mdp.terminal_prompt_index] * sequence_probs(mdp, policy)
    return (probs[mine] * mdp.terminal_lengths[mine]).sum() / probs[mine].sum()


def expected_inverse_length(mdp: TokenMDP, policy: nn.Module) -> torch.Tensor:
    """``E[1/|y|] = Σ_x D(x) Σ_y π(y|x) / |y|``, differentiable in ``policy``'s parameters.

    Parameters
    ----------
    mdp : TokenMDP
        The exact MDP.
    policy : nn.Module
        ``π_θ``.

    Returns
    -------
    Tensor
        A 0-d float64 tensor.
    """
    return (mdp.prompt_probs[mdp.terminal_prompt_index] * sequence_probs(mdp, policy)
            / mdp.terminal_lengths).sum()


def weight_table(batch: TokenBatch, weights: Mapping[Aggregation, torch.Tensor], *,
                 eos: int) -> Printout:
    """Every non-padding token of a batch with its advantage and its weight under each mode.

    Parameters
    ----------
    batch : TokenBatch
        A prepared batch (``advantage`` filled).
    weights : dict of Aggregation to Tensor ``[R, C]``
        ``loss_weights(batch, mode, ...)`` of each mode, in column order.
    eos : int
        The EOS token id (printed as ``EOS``; other tokens as their id).

    Returns
    -------
    Printout
        Rows ``(row, col, seq, token, counted, |y_i|, A, *weights)``, one per token, row by row.
    """
    modes = _modes(weights)
    rows, lines = [], [
        f"{'row':>3} {'col':>3} {'seq':>3} {'token':>6} {'loss':>5} {'|y_i|':>5} {'A':>6} "
        + " ".join(f"{_SHORT[m]:>9}" for m in modes)]
    for r in range(batch.num_rows):
        for c in range(batch.capacity):
            s = int(batch.sequence_id[r, c])
            if s < 0:
                continue                                          # padding
            token, on = int(batch.tokens[r, c]), bool(batch.loss_mask[r, c])
            row = (r, c, s, token, on, int(batch.length[s]), float(batch.advantage[r, c]),
                   *(float(weights[m][r, c]) for m in modes))
            rows.append(row)
            name = "EOS" if token == eos else str(token)
            lines.append(f"{r:>3} {c:>3} {s:>3} {name:>6} {'yes' if on else '-':>5} "
                         f"{row[5]:>5} {row[6]:>+6.2f} "
                         + " ".join(f"{w:>9.4f}" for w in row[7:]))
    return Printout("\n".join(lines), rows)


def sequence_total_table(batch: TokenBatch, totals: Mapping[Aggregation, torch.Tensor], *,
                         max_len: int) -> Printout:
    """The total weight of each sequence under each mode, and the total of the step.

    Parameters
    ----------
    batch : TokenBatch
        The batch the totals belong to (its ``length`` and counts are printed).
    totals : dict of Aggregation to Tensor ``[S]``
        ``batch.sequence_sum(weights)`` of each mode, in column order.
    max_len : int
        ``L_max``, printed in the heading.

    Returns
    -------
    Printout
        Rows ``(seq, |y_i|, *totals)``, one per sequence, then ``("sum", None, *sums)``.
    """
    modes = _modes(totals)
    lines = [f"S = {batch.num_sequences} sequences, N = {batch.num_loss_tokens} loss tokens, "
             f"L_max = {max_len}\n",
             f"{'seq':>3} {'|y_i|':>5} " + " ".join(f"{_SHORT[m]:>9}" for m in modes)]
    rows = []
    for s in range(batch.num_sequences):
        rows.append((s, int(batch.length[s]), *(float(totals[m][s]) for m in modes)))
        lines.append(f"{s:>3} {rows[-1][1]:>5} " + " ".join(f"{v:>9.4f}" for v in rows[-1][2:]))
    rows.append(("sum", None, *(float(totals[m].sum()) for m in modes)))
    lines.append(f"{'sum':>9} " + " ".join(f"{v:>9.4f}" for v in rows[-1][2:]))
    return Printout("\n".join(lines), rows)


def cosine_table(results: Mapping, grad_per_token: torch.Tensor,
                 grad_len: torch.Tensor) -> Printout:
    """Each mode's exact mean: its norm, its cosines to three gradients, its length slope.

    Parameters
    ----------
    results : dict of Aggregation to AggregationGradient
        :func:`tokenmdp.exact.aggregation_gradients`' results, keyed by their aggregation.
    grad_per_token : Tensor ``[num_params]``
        ``∇E[(R − J)/|y|]`` with ``J`` held fixed.
    grad_len : Tensor ``[num_params]``
        ``∇E|y|``.

    Returns
    -------
    Printout
        Rows ``(mode, ‖E ĝ‖, cos ∇J, cos ∇E[R/|y|], cos ∇E[(R−J)/|y|], <E ĝ/‖E ĝ‖, ∇E|y|>)``.
    """
    lines = [f"{'mode':>20} {'‖E ĝ‖':>8} {'cos ∇J':>8} {'cos ∇E[R/|y|]':>14} "
             f"{'cos ∇E[(R-J)/|y|]':>18} {'d E|y| / step':>14}"]
    rows = []
    for mode in _modes(results):
        r = results[mode]
        unit = r.mean / r.mean.norm()
        rows.append((mode.value, float(r.mean.norm()), r.cosine_to_grad_J,
                     r.cosine_to_grad_length_normalized,
                     float(unit @ grad_per_token / grad_per_token.norm()), float(unit @ grad_len)))
        lines.append(f"{rows[-1][0]:>20} {rows[-1][1]:>8.4f} {rows[-1][2]:>8.4f} "
                     f"{rows[-1][3]:>14.4f} {rows[-1][4]:>18.4f} {rows[-1][5]:>+14.4f}")
    return Printout("\n".join(lines), rows)


def closed_form_table(comparisons: Sequence[tuple[str, str, torch.Tensor, torch.Tensor]], *,
                      label: str = "mode", width: int = 20, decimals: int = 5) -> Printout:
    """Exact means next to their closed forms: both norms and the largest coordinate difference.

    Parameters
    ----------
    comparisons : sequence of (str, str, Tensor, Tensor)
        ``(name, formula, exact mean, closed form)`` per row.
    label : str
        The heading of the name column.
    width : int
        The width of the name column.
    decimals : int
        Decimals of the two norms.

    Returns
    -------
    Printout
        Rows ``(name, formula, ‖mean‖, ‖closed form‖, max |mean − closed form|)``.
    """
    lines = [f"{label:>{width}} {'closed form':>24} {'‖E ĝ‖':>9} {'‖formula‖':>10} "
             f"{'max |difference|':>17}"]
    rows = []
    for name, formula, mean, target in comparisons:
        rows.append((name, formula, float(mean.norm()), float(target.norm()),
                     float((mean - target).abs().max())))
        lines.append(f"{name:>{width}} {formula:>24} {rows[-1][2]:>9.{decimals}f} "
                     f"{rows[-1][3]:>10.{decimals}f} {rows[-1][4]:>17.1e}")
    return Printout("\n".join(lines), rows)


def length_drift_figure(tracks: Mapping[str, Sequence], detailed: Mapping[str, Sequence], *,
                        lr: float):
    """Section 5's four panels: ``J``, ``E|y|`` and the two conditional lengths along ascent.

    Parameters
    ----------
    tracks : dict of str to list of (float, float)
        ``(J, E|y|)`` after each step, per mode (:func:`tokenmdp.exact.length_drift`).
    detailed : dict of str to list of (float, float, float, float)
        ``(J, E|y|, E[|y| | correct], E[|y| | wrong])`` after each step, for the modes shown in
        the bottom panels; its ``"constant"`` track stands for every ``∇J`` mode.
    lr : float
        The length of each (unit-direction) step, for the x label.

    Returns
    -------
    matplotlib.figure.Figure
        The 2 × 2 figure (not shown).
    """
    unknown = [name for name in [*tracks, *detailed] if name not in _STYLE]
    if unknown:
        raise ValueError(f"tracks: unknown aggregation {unknown[0]!r}; expected one of "
                         f"{sorted(_STYLE)}")
    fig, axes = plt.subplots(2, 2, figsize=(12, 7.5), sharex=True)
    panels = [(axes[0, 0], "expected reward J", tracks, 0),
              (axes[0, 1], "expected length E|y|", tracks, 1),
              (axes[1, 0], "length of correct responses E[|y| | y_1 = 0]", detailed, 2),
              (axes[1, 1], "length of wrong responses E[|y| | y_1 = 1]", detailed, 3)]
    for ax, title, source, i in panels:
        for name, track in source.items():
            color, ls = _STYLE[name]
            label = name if source is tracks or name != "constant" else "constant (every ∇J mode)"
            ax.plot([t[i] for t in track], color=color, ls=ls, lw=2, label=label)
        ax.set_title(title)
        ax.set_ylabel("J" if i == 0 else "tokens")
    for ax in axes[1]:
        ax.set_xlabel(f"exact ascent step (unit direction, length {lr})")
    axes[0, 1].legend(fontsize=8)
    axes[1, 1].legend(fontsize=8)
    fig.tight_layout()
    return fig


def conditional_length_table(detailed: Mapping[str, Sequence]) -> Printout:
    """The conditional lengths of correct and wrong responses at the start and end of ascent.

    Parameters
    ----------
    detailed : dict of str to list of (float, float, float, float)
        As for :func:`length_drift_figure`.

    Returns
    -------
    Printout
        Rows ``(mode, correct at start, correct at end, wrong at start, wrong at end)``.
    """
    lines = [f"{'mode':>20} {'correct: start':>15} {'end':>7} {'wrong: start':>13} {'end':>7}"]
    rows = []
    for name, track in detailed.items():
        rows.append((name, track[0][2], track[-1][2], track[0][3], track[-1][3]))
        lines.append(f"{name:>20} {rows[-1][1]:>15.4f} {rows[-1][2]:>7.4f} {rows[-1][3]:>13.4f} "
                     f"{rows[-1][4]:>7.4f}")
    return Printout("\n".join(lines), rows)


def micro_batch_table(step: TokenBatch, full_loss: torch.Tensor, splits: Sequence[tuple],
                      policy: nn.Module) -> Printout:
    """Summed and per-micro-batch-mean losses of each split against the full step's loss.

    Differentiates ``full_loss`` and every split's two losses (each graph once).

    Parameters
    ----------
    step : TokenBatch
        The full step (its counts are printed).
    full_loss : Tensor
        The full step's loss, with its autograd graph.
    splits : sequence of (int, list of int, Tensor, Tensor)
        ``(K, loss tokens per micro-batch, Σ_k loss_k, mean of the micro-batch means)`` per
        split, both losses with their graphs.
    policy : nn.Module
        The module the gradients are taken in.

    Returns
    -------
    Printout
        Rows ``(K, counts, Σ_k loss_k, its difference, ‖its ∇ difference‖, mean of means,
        its difference, ‖its ∇ difference‖)``; the differences are to the full step.
    """
    full_grad = flat_grad(full_loss, policy)
    lines = [f"full step: {step.num_loss_tokens} loss tokens in {step.num_rows} rows, "
             f"loss {full_loss.item():.6f}\n",
             f"{'K':>2} {'tokens per micro-batch':>24} {'Σ_k loss_k':>11} {'diff':>8} "
             f"{'‖∇ diff‖':>9} {'mean of means':>14} {'diff':>9} {'‖∇ diff‖':>9}"]
    rows = []
    for K, counts, summed, naive in splits:
        rows.append((K, list(counts), summed.item(), (summed - full_loss).item(),
                     float((flat_grad(summed, policy) - full_grad).norm()), naive.item(),
                     (naive - full_loss).item(),
                     float((flat_grad(naive, policy) - full_grad).norm())))
        _, _, s, d_sum, g_sum, n, d_naive, g_naive = rows[-1]
        lines.append(f"{K:>2} {str(list(counts)):>24} {s:>11.6f} {d_sum:>8.0e} {g_sum:>9.0e} "
                     f"{n:>14.6f} {d_naive:>+9.5f} {g_naive:>9.5f}")
    return Printout("\n".join(lines), rows)
