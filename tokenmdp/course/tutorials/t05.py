"""Tutorial 5's printouts, figure and repeated setup: the trainer world of :mod:`tokenmdp.rl`.

* :func:`hand_written_groups` — section 1's RL group of three responses per prompt, written by
  hand (one right, two wrong);
* :func:`batch_summary` and :func:`fields_table` — section 1's printouts of the two batches and
  of the ``advantage`` and ``loss_weight`` fields that an estimator fills;
* :func:`packed_rollouts` — a rollout engine's samples packed as the trainer packs them before
  its ``old_logprob`` pass (sections 2 and 4);
* :func:`run_summary`, :func:`binomial_se`, :func:`evaluation_table` and
  :func:`training_curves` — section 3's summary of a run's metric rows, its table of evaluation
  steps and its figure.

Each function computes only what the tutorial shows; text comes back as a string for the notebook
to ``print``, the figure as a :class:`matplotlib.figure.Figure`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
import numpy as np
import torch

from tokenmdp.batch import TokenBatch
from tokenmdp.course.display import finish
from tokenmdp.packing import pack_first_fit_decreasing

__all__ = ["batch_summary", "binomial_se", "evaluation_table", "fields_table",
           "hand_written_groups", "packed_rollouts", "run_summary", "training_curves"]

#: The last digit of the right answer is shifted by these amounts in the two wrong responses of
#: :func:`hand_written_groups`; the second one also gets a ``"0"`` appended (a longer response).
WRONG_SHIFTS = (1, 3)


def _wrong(answer: str, k: int) -> str:
    # a wrong answer: the right one with its last digit shifted by k
    return answer[:-1] + str((int(answer[-1]) + k) % 10)


def hand_written_groups(tokenizer, examples: Sequence) -> tuple[list, list[list[int]]]:
    """A group of ``G = 3`` responses per prompt, written by hand: right, wrong, wrong and longer.

    For an answer ``a`` the texts are ``a``, ``a`` with its last digit shifted by 1 (mod 10), and
    ``a`` with its last digit shifted by 3 followed by ``"0"``; each is encoded and ends with EOS.
    The rewards differ within each group, so that a group-mean advantage is not zero.

    Parameters
    ----------
    tokenizer : tokenmdp.rl.tasks.CharTokenizer
        The task's tokenizer (``encode`` and ``EOS``).
    examples : sequence of tokenmdp.rl.tasks.Example
        The prompts, each with its ``answer`` (a string of digits).

    Returns
    -------
    rl_examples : list of Example
        Each example repeated 3 times, in group order.
    rl_responses : list of list of int
        The 3 responses of each example, token ids ending with ``tokenizer.EOS``.
    """
    for ex in examples:
        if not ex.answer or not ex.answer[-1].isdigit():
            raise ValueError(f"examples: the answer {ex.answer!r} does not end with a digit")
    texts = [(ex.answer, _wrong(ex.answer, WRONG_SHIFTS[0]), _wrong(ex.answer, WRONG_SHIFTS[1]) + "0")
             for ex in examples]
    rl_examples = [ex for ex, group in zip(examples, texts) for _ in group]
    rl_responses = [tokenizer.encode(text) + [tokenizer.EOS] for group in texts for text in group]
    return rl_examples, rl_responses


def batch_summary(examples: Sequence, sft_batch: TokenBatch, rl_batch: TokenBatch) -> str:
    """Section 1's printout: each prompt with its answer, then the size of the two batches.

    Parameters
    ----------
    examples : sequence of tokenmdp.rl.tasks.Example
        The prompts of both batches.
    sft_batch, rl_batch : TokenBatch
        The demonstrations and the RL groups.

    Returns
    -------
    str
        One line per example, then one line per batch (sequences, loss tokens; the RL batch's
        rewards).
    """
    lines = [f"{ex.prompt!r:>9} -> {ex.answer!r}" for ex in examples]
    lines.append(f"SFT batch: {sft_batch.num_sequences} sequences, "
                 f"{sft_batch.num_loss_tokens} loss tokens")
    lines.append(f"RL batch:  {rl_batch.num_sequences} sequences, {rl_batch.num_loss_tokens} "
                 f"loss tokens, rewards {rl_batch.reward.tolist()}")
    return "\n".join(lines)


def fields_table(batch: TokenBatch, tokenizer, title: str) -> str:
    """One line per sequence: its text, reward, and ``advantage`` and ``loss_weight`` on its loss
    tokens.

    The text is the decoded prompt and response, with ``·`` for EOS (the tokenizer decodes EOS to
    nothing). Advantages are printed with 3 decimals and a sign, weights with 4 decimals.

    Parameters
    ----------
    batch : TokenBatch
        A prepared batch (after :func:`tokenmdp.estimators.prepare`), packed or not.
    tokenizer : tokenmdp.rl.tasks.CharTokenizer
        Decodes the tokens.
    title : str
        The first line.

    Returns
    -------
    str
        The title, a header line and one line per sequence.
    """
    lines = [title, f"  {'seq':>3} {'text':<12} {'R':>4}  {'advantage on loss tokens':<28} "
                    "loss_weight"]
    for s in range(batch.num_sequences):
        rows, cols = torch.nonzero(batch.sequence_id == s, as_tuple=True)
        text = tokenizer.decode(batch.tokens[rows, cols].tolist()) + "·"
        m = batch.loss_mask[rows, cols]
        adv = " ".join(f"{a:+.3f}" for a in batch.advantage[rows, cols][m].tolist())
        w = " ".join(f"{x:.4f}" for x in batch.loss_weight[rows, cols][m].tolist())
        lines.append(f"  {s:>3} {text:<12} {float(batch.reward[s]):>4.1f}  {adv:<28} {w}")
    return "\n".join(lines)


def packed_rollouts(engine, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
                    eos_id: int, capacity: int, seed: int) -> TokenBatch:
    """Sample one response per prompt with ``engine`` and pack them as the trainer does.

    The trainer packs its rollouts into rows of ``capacity`` tokens (first-fit decreasing) before
    the ``old_logprob`` pass; the same seed gives the same samples, so two calls with one engine
    precision give one batch.

    Parameters
    ----------
    engine : tokenmdp.rl.rollout.RolloutEngine
        The sampler, with its own precision (it records ``behavior_logprob`` and its routing).
    prompts : sequence of sequences of int
        One prompt per response.
    max_new_tokens : int
        Longest response.
    eos_id : int
        The token that ends a response.
    capacity : int
        Tokens per packed row (at least the longest prompt plus ``max_new_tokens``).
    seed : int
        Seed of the sampling ``torch.Generator``.

    Returns
    -------
    TokenBatch
        The packed samples, sequence ids in prompt order.
    """
    sampled = engine.generate(prompts, max_new_tokens=max_new_tokens, eos_id=eos_id,
                              generator=torch.Generator().manual_seed(seed))
    return pack_first_fit_decreasing(sampled, capacity)


def run_summary(sft_rows: Sequence[Mapping], rl_rows: Sequence[Mapping]) -> str:
    """Section 3's printout of two runs: steps and time, the last RL row, and ``r`` at the update.

    Parameters
    ----------
    sft_rows, rl_rows : sequences of dict
        The metric rows :func:`tokenmdp.rl.trainer.train` returned (``time_s`` in each; the RL
        rows also ``r_min``, ``r_max`` and ``clip_fraction``).

    Returns
    -------
    str
        Three lines: steps and seconds of each run; the last RL row, floats rounded to 4
        decimals; the largest ``|r − 1|`` and the largest clip fraction over the RL run.
    """
    if not rl_rows:
        raise ValueError("rl_rows: the RL run has no rows")
    last = {k: round(v, 4) if isinstance(v, float) else v for k, v in rl_rows[-1].items()}
    max_r_dev = max(max(abs(r["r_max"] - 1), abs(r["r_min"] - 1)) for r in rl_rows)
    return "\n".join([
        f"SFT: {len(sft_rows)} steps in {sum(r['time_s'] for r in sft_rows):.1f} s;"
        f" RL: {len(rl_rows)} steps in {sum(r['time_s'] for r in rl_rows):.1f} s",
        f"an RL row: {last}",
        f"one mini-batch per step: max |r − 1| over the run {max_r_dev:.1e}, clip fraction "
        f"{max(r['clip_fraction'] for r in rl_rows):.0f} at every step"])


def binomial_se(p: float, n: int) -> float:
    """The binomial standard error ``sqrt(p (1 − p) / n)`` of an accuracy ``p`` on ``n`` prompts.

    Parameters
    ----------
    p : float
        The measured accuracy, in ``[0, 1]``.
    n : int
        The number of prompts it was measured on (positive).

    Returns
    -------
    float
        The standard error of the accuracy.
    """
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"p: an accuracy must be in [0, 1], got {p}")
    if n <= 0:
        raise ValueError(f"n: the number of prompts must be positive, got {n}")
    return (p * (1 - p) / n) ** 0.5


def evaluation_table(runs: Mapping[str, Sequence[Mapping]], n_eval: int, *,
                     rl: str = "RL") -> str:
    """The evaluation steps of each run, with the means of the steps since the previous one.

    A line per row that holds ``eval_accuracy``: the run, the 1-based step, the mean ``reward``
    of the steps since the previous evaluation (through this one), the held-out accuracy with its
    :func:`binomial_se`, and for the RL run the window's mean ``train_infer_kl_k1``,
    ``train_infer_kl_k3`` and ``routing_mismatch``. A run other than ``rl`` shows
    "(demonstrations)" for the reward and no KL columns (SFT samples nothing).

    Parameters
    ----------
    runs : mapping of str to sequences of dict
        Each run's name and its metric rows, in step order (``step`` counts from 0).
    n_eval : int
        The evaluation set's size.
    rl : str
        The name of the run that sampled its rollouts.

    Returns
    -------
    str
        A header line and one line per evaluation step.
    """
    lines = [f"{'run':>4} {'step':>5} {'mean train reward':>18} {'held-out accuracy':>18}"
             f" {'KL k1':>10} {'KL k3':>9} {'mismatch':>9}"]
    for name, rows in runs.items():
        start = 0
        for r in rows:
            if "eval_accuracy" not in r:
                continue
            window = rows[start:r["step"] + 1]
            start = r["step"] + 1
            if name == rl:
                reward = f"{np.mean([w['reward'] for w in window]):18.3f}"
                extra = (f" {np.mean([w['train_infer_kl_k1'] for w in window]):+10.2e}"
                         f" {np.mean([w['train_infer_kl_k3'] for w in window]):9.2e}"
                         f" {np.mean([w['routing_mismatch'] for w in window]):9.3f}")
            else:
                reward, extra = f"{'(demonstrations)':>18}", ""
            acc = r["eval_accuracy"]
            lines.append(f"{name:>4} {r['step'] + 1:>5} {reward} {acc:11.3f} ± "
                         f"{binomial_se(acc, n_eval):.3f}" + extra)
    return "\n".join(lines)


def training_curves(sft_rows: Sequence[Mapping], rl_rows: Sequence[Mapping], n_eval: int):
    """Section 3's figure: SFT then MiniRL on one step axis.

    Three panels: held-out accuracy of both runs with ±1 :func:`binomial_se`; the RL run's mean
    reward per step; its per-token training–inference KL estimates ``k1`` and ``k3`` with a line
    at 0. The RL run's step 0 is drawn at ``len(sft_rows)`` (it continues from the checkpoint).

    Parameters
    ----------
    sft_rows, rl_rows : sequences of dict
        The metric rows of the two runs.
    n_eval : int
        The evaluation set's size.

    Returns
    -------
    matplotlib.figure.Figure
        The figure (not shown).
    """
    offset = len(sft_rows)
    fig, (ax_a, ax_r, ax_k) = plt.subplots(1, 3, figsize=(15, 4))
    for name, rows, start in (("SFT", sft_rows, 0), ("MiniRL", rl_rows, offset)):
        ev = [r for r in rows if "eval_accuracy" in r]
        ax_a.errorbar([start + r["step"] + 1 for r in ev], [r["eval_accuracy"] for r in ev],
                      yerr=[binomial_se(r["eval_accuracy"], n_eval) for r in ev], fmt="o-",
                      capsize=3, label=name)
    steps = [offset + r["step"] + 1 for r in rl_rows]
    ax_r.plot(steps, [r["reward"] for r in rl_rows], color="C1", lw=0.8, label="MiniRL, per step")
    ax_k.plot(steps, [r["train_infer_kl_k1"] for r in rl_rows], color="C2", lw=0.8, label="k1")
    ax_k.plot(steps, [r["train_infer_kl_k3"] for r in rl_rows], color="C3", lw=0.8, label="k3")
    ax_k.axhline(0, color="0.6", lw=0.8)
    finish(ax_a, title="held-out accuracy (±1 s.e.)", xlabel="step", ylabel="exact-match accuracy")
    finish(ax_r, title="mean reward of the step's samples", xlabel="step", ylabel="reward")
    finish(ax_k, title="training–inference KL(μ ‖ π_old) per token", xlabel="step",
           ylabel="estimate")
    fig.tight_layout()
    return fig
