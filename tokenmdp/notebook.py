"""Small helpers that keep the tutorials' cells short: the course's MDP, exact clip fractions,
tables, the "what verl / TRL / others call this" box, and figure finishing.

* :func:`copy_task` — the MDP and policy of tutorials 1, 3 and 6 (and of their exercises);
* :func:`step_along` — ``π_old`` moved by a distance along a direction (one optimizer step);
* :func:`ppo_clip_fraction` — the exact expected share of PPO-clipped tokens for ``G = 2``;
* :func:`table` and :func:`alias_box` — objects that render as HTML in a notebook and as plain
  text in a terminal; :func:`show` displays either in both places;
* :func:`finish` — title, axis labels, legend and readable ticks on a Matplotlib axis.
* :func:`kl_world`, :func:`kl_placement_moments`, :func:`kl_matches`, :func:`kl_gradient_table`
  and :func:`mean_and_sd` — tutorial 8's worlds, its gradient table and Monte Carlo error bars.

Nothing here is needed by the lower layers; it sits beside :mod:`tokenmdp.cards` and
:mod:`tokenmdp.plots`.
"""

from __future__ import annotations

import copy
import html
from collections.abc import Sequence

import torch
from torch import nn
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from tokenmdp import cards, estimators
from tokenmdp.estimators import ppo_keep_mask
from tokenmdp.exact import TabularPolicy, TokenMDP, sequence_probs

__all__ = ["Rendered", "alias_box", "copy_task", "finish", "ppo_clip_fraction", "show",
           "step_along", "table"]

#: Seed of the tabular policy of :func:`copy_task`.
COPY_TASK_SEED = 0


def _copy_reward(prompt, response):
    # +1 per response token equal to the prompt token, -1 if the response was truncated (no EOS)
    eos = 2
    return sum(token == prompt[0] for token in response) - 1.0 * (response[-1] != eos)


def copy_task() -> tuple[TokenMDP, TabularPolicy]:
    """The course's MDP and policy, as tutorials 1, 3 and 6 build them.

    Tokens ``{0, 1, EOS = 2}``, responses of at most 3 tokens, prompts ``(0,)`` and ``(1,)`` with
    probabilities 0.6 and 0.4; reward +1 per response token that copies the prompt token and −1
    for a truncated response. The policy is a :class:`~tokenmdp.exact.TabularPolicy` with
    ``N(0, 1)`` logits from the seed ``COPY_TASK_SEED`` (float64).

    Returns
    -------
    (TokenMDP, TabularPolicy)
        Fresh objects on every call.
    """
    mdp = TokenMDP(3, 3, _copy_reward, prompts=[(0,), (1,)], prompt_probs=[0.6, 0.4])
    policy = TabularPolicy(mdp, generator=torch.Generator().manual_seed(COPY_TASK_SEED),
                           init_std=1.0)
    return mdp, policy


def step_along(policy: nn.Module, direction: torch.Tensor, distance: float) -> nn.Module:
    """A copy of ``policy`` with parameters ``θ + distance · u/‖u‖`` (``u = direction``).

    With ``direction = ∇J(θ_old)`` this is one ascent step of length ``distance`` from
    ``π_old = policy``: the policy a trainer holds after its first update on a rollout.

    Parameters
    ----------
    policy : nn.Module
        ``π_old`` (not modified).
    direction : Tensor ``[num_params]``
        ``u``, in ``policy.parameters()`` order (normalized here; must be non-zero).
    distance : float
        The step length ``s`` in parameter space.

    Returns
    -------
    nn.Module
        A deep copy of ``policy`` at ``θ + s u/‖u‖``.
    """
    direction = torch.as_tensor(direction, dtype=torch.float64)
    theta = parameters_to_vector(policy.parameters()).detach()
    if direction.shape != theta.shape:
        raise ValueError(f"direction: expected shape {tuple(theta.shape)}, got "
                         f"{tuple(direction.shape)}")
    if not direction.norm() > 0:
        raise ValueError("direction: has zero norm")
    moved = copy.deepcopy(policy)
    vector_to_parameters(theta + float(distance) * direction / direction.norm(),
                         moved.parameters())
    return moved


def ppo_clip_fraction(mdp: TokenMDP, policy: nn.Module, old: nn.Module, *, eps_low: float,
                      eps_high: float, dual_clip: float | None = None) -> float:
    """The exact pooled clip fraction ``E[#clipped tokens] / E[#tokens]`` of PPO's clip.

    Groups of ``G = 2`` responses drawn from ``old`` (``μ = π_old``), leave-one-out advantage
    ``Â_1 = R_1 − R_2``; a token is clipped where the PPO mask ``M_t`` of
    :func:`~tokenmdp.estimators.ppo_keep_mask` is False (``Â > 0, r > 1 + ε_high`` or
    ``Â < 0, r < 1 − ε_low``, or with dual clip ``Â < 0, r > c``), ``r = π_θ/π_old``. Every
    response is enumerated together with every partner, with probability
    ``D(x) π_old(y_1|x) π_old(y_2|x)``. This is what a trainer's ``clip_fraction`` metric
    estimates on a large batch.

    Parameters
    ----------
    mdp : TokenMDP
    policy : nn.Module
        ``π_θ``, the policy being trained.
    old : nn.Module
        ``π_old``, which samples the responses and defines ``r``.
    eps_low, eps_high : float
        The clip range ``[1 − ε_low, 1 + ε_high]``.
    dual_clip : float, optional
        The dual-clip constant ``c > 1``, or None.

    Returns
    -------
    float
        The expected share of clipped response tokens.
    """
    enum = mdp.enumerate()
    with torch.no_grad():
        log_r = torch.where(enum.loss_mask,
                            policy.token_logprobs(enum) - old.token_logprobs(enum), 0.0)
        ratio_NC = log_r.exp()
        old_N = sequence_probs(mdp, old)
    n = mdp.responses_per_prompt
    clipped = tokens = 0.0
    for x in range(mdp.num_prompts):
        rows = slice(x * n, (x + 1) * n)
        reward = mdp.rewards[rows]
        advantage_NN = reward[:, None] - reward[None, :]      # Â of response i paired with j
        keep = ppo_keep_mask(ratio_NC[rows][:, None, :], advantage_NN[:, :, None],
                             eps_low=eps_low, eps_high=eps_high, dual_clip=dual_clip)
        clipped_NN = (~keep & enum.loss_mask[rows][:, None, :]).sum(-1).to(torch.float64)
        q = old_N[rows]
        clipped += float(mdp.prompt_probs[x] * (q[:, None] * q[None, :] * clipped_NN).sum())
        tokens += float(mdp.prompt_probs[x] * (q * enum.length[rows]).sum())
    return clipped / tokens


class Rendered:
    """Text with an HTML twin: a notebook shows the HTML, a terminal (``print``) the text.

    Parameters
    ----------
    text : str
        The plain-text form (``str``, ``repr`` and ``print``).
    html_text : str
        The HTML form (``_repr_html_``, what Jupyter and the documentation show).
    """

    def __init__(self, text: str, html_text: str):
        self.text = text
        self.html = html_text

    def __str__(self) -> str:
        return self.text

    def __repr__(self) -> str:
        return self.text

    def _repr_html_(self) -> str:
        return self.html


def _format(value, fmt: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, torch.Tensor):
        value = value.item()
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)                         # counts stay counts
    return format(value + 0.0, fmt)               # + 0.0: no "-0" for a negative zero


def table(rows: Sequence[Sequence], headers: Sequence[str], *, fmt: str = ".4g",
          title: str | None = None) -> Rendered:
    """A table of ``rows`` under ``headers``: numbers formatted with ``fmt``, strings as given.

    Parameters
    ----------
    rows : sequence of sequences
        One entry per cell; ``int``/``float``/0-d tensors are formatted, ``str`` kept.
    headers : sequence of str
        Column names (as many as cells in each row).
    fmt : str
        Format spec of the numbers (``format(value, fmt)``), e.g. ``".4f"`` or ``"+.2e"``.
    title : str, optional
        A line above the table.

    Returns
    -------
    Rendered
        The table as aligned text and as an HTML ``<table>``.
    """
    headers = [str(h) for h in headers]
    cells = [[_format(v, fmt) for v in row] for row in rows]
    for i, row in enumerate(cells):
        if len(row) != len(headers):
            raise ValueError(f"rows: row {i} has {len(row)} cells for {len(headers)} headers")
    widths = [max([len(h)] + [len(r[j]) for r in cells]) for j, h in enumerate(headers)]
    lines = [] if title is None else [title]
    lines.append("  ".join(h.rjust(w) for h, w in zip(headers, widths)))
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    return Rendered("\n".join(lines), html_table(headers, cells, title))


def html_table(headers: Sequence[str], cells: Sequence[Sequence[str]], title: str | None = None
               ) -> str:
    """An HTML ``<table>`` of already formatted cells, right-aligned, with an optional caption.

    Parameters
    ----------
    headers : sequence of str
        The column names.
    cells : sequence of sequences of str
        The formatted cells, row by row (surrounding spaces are dropped).
    title : str, optional
        The caption (none when empty).

    Returns
    -------
    str
        The table's HTML, escaped.
    """
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f'<td style="text-align:right">{html.escape(c.strip())}</td>'
                                    for c in row) + "</tr>" for row in cells)
    caption = f"<caption>{html.escape(title)}</caption>" if title else ""
    return f"<table>{caption}<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def alias_box(names: Sequence[str], *,
              title: str = "What verl / TRL / others call this") -> Rendered:
    """The registry entries ``names`` with their formula and the names other frameworks use.

    Generated from the registry (:func:`tokenmdp.estimators.describe`) through the same parser
    as the estimator cards (:mod:`tokenmdp.cards`), so a box never disagrees with a card.

    Parameters
    ----------
    names : sequence of str
        Registry names; an unknown name raises the registry's ``ValueError`` ("did you mean").
    title : str
        The box's heading.

    Returns
    -------
    Rendered
        The box as text and as HTML.
    """
    if isinstance(names, str):
        raise TypeError("names: expected a sequence of registry names, got a str")
    entries = []
    for name in names:
        estimators.describe(name)              # the registry's error for an unknown name
        doc = cards._docstring_parts(name)
        entries.append((name, doc["formula"], cards._aliases(doc["aliases"])))
    lines = [title, "-" * len(title)]
    for name, formula, aliases in entries:
        lines += [f"{name}: {formula}", *(f"    - {a}" for a in aliases)]
    items = "".join(
        f"<li><code>{html.escape(name)}</code>: <code>{html.escape(formula)}</code><ul>"
        + "".join(f"<li>{html.escape(a)}</li>" for a in aliases) + "</ul></li>"
        for name, formula, aliases in entries)
    box = ('<div style="border:1px solid #999;border-radius:4px;padding:0.5em 1em">'
           f"<strong>{html.escape(title)}</strong><ul>{items}</ul></div>")
    return Rendered("\n".join(lines), box)


def show(obj) -> None:
    """Display ``obj``: rich (HTML) inside IPython/Jupyter, ``print`` in a plain interpreter.

    Parameters
    ----------
    obj : object
        Anything printable; a :class:`Rendered` shows its HTML in a notebook.
    """
    try:
        from IPython import get_ipython
        from IPython.display import display
    except ImportError:  # a plain interpreter without IPython installed
        print(obj)
        return
    if get_ipython() is None:
        print(obj)
    else:
        display(obj)


def finish(ax, *, title: str, xlabel: str, ylabel: str, legend: bool = True,
           legend_fontsize: float = 8) -> None:
    """Give a Matplotlib axis its title, axis labels, legend and readable ticks.

    Ticks get size 9 and the grid a light dotted line.

    Parameters
    ----------
    ax : matplotlib.axes.Axes
    title, xlabel, ylabel : str
        The title and the axis labels.
    legend : bool
        Draw the legend; False only where the axis has a single unlabelled artist (the title
        says what it is).
    legend_fontsize : float
        The legend's font size.
    """
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.tick_params(labelsize=9)
    ax.grid(True, ls=":", lw=0.6, alpha=0.7)
    if legend:
        ax.legend(fontsize=legend_fontsize)


# ---------------------------------------------------------------------- tutorial 8: KL
#: Tutorial 8's policy: ``π_ref`` moved by this distance along ``∇J(π_ref)`` (:func:`kl_world`).
KL_WORLD_STEP = 3.0
#: Tutorial 8's behaviour policy ``μ``: ``π_ref`` moved by this distance (half-way to ``π``).
KL_WORLD_STALE_STEP = 1.5

__all__ += ["kl_gradient_table", "kl_matches", "kl_placement_moments", "kl_world",
            "mean_and_sd"]


def kl_world(max_len: int) -> tuple[TokenMDP, nn.Module, TabularPolicy, nn.Module]:
    """Tutorial 8's worlds: the copy task with responses of at most ``max_len`` tokens.

    ``max_len = 1`` is a bandit (one action per prompt), ``max_len >= 2`` a sequence task. The
    reference ``π_ref`` is the seeded tabular policy of :func:`copy_task`; the trained policy is
    ``π = step_along(π_ref, ∇J(π_ref), KL_WORLD_STEP)`` and the behaviour policy of the
    off-policy section ``μ = step_along(π_ref, ∇J(π_ref), KL_WORLD_STALE_STEP)`` (an older
    iterate that sampled the data).

    Parameters
    ----------
    max_len : int
        The response-length limit ``L >= 1``.

    Returns
    -------
    (TokenMDP, nn.Module, TabularPolicy, nn.Module)
        ``(mdp, π, π_ref, μ)``, fresh on every call (float64).
    """
    from tokenmdp.exact import gradient

    mdp = TokenMDP(3, max_len, _copy_reward, prompts=[(0,), (1,)], prompt_probs=[0.6, 0.4])
    reference = TabularPolicy(mdp, generator=torch.Generator().manual_seed(COPY_TASK_SEED),
                              init_std=1.0)
    direction = gradient(mdp, reference)
    return (mdp, step_along(reference, direction, KL_WORLD_STEP), reference,
            step_along(reference, direction, KL_WORLD_STALE_STEP))


def kl_placement_moments(mdp: TokenMDP, policy: nn.Module, reference: nn.Module, *,
                         coef: float = 1.0) -> dict[str, object]:
    """Exact moments of the six placements k1/k2/k3 × in the reward / in the loss, on-policy.

    Each entry is :func:`tokenmdp.exact.kl_gradients.kl_penalty_moments` of
    ``KLPenalty(coef=coef, in_reward=..., estimator=kl_k1 | kl_k2 | kl_k3)``.

    Parameters
    ----------
    mdp : TokenMDP
    policy, reference : nn.Module
        ``π_θ`` and ``π_ref``.
    coef : float
        ``β > 0``.

    Returns
    -------
    dict of str to Moments
        Keyed ``"k1 in reward"``, ``"k1 in loss"``, ..., ``"k3 in loss"``.
    """
    from tokenmdp.exact.kl_gradients import kl_penalty_moments

    out = {}
    for estimator in (estimators.kl_k1, estimators.kl_k2, estimators.kl_k3):
        for in_reward in (True, False):
            name = f"{estimator.__name__.removeprefix('kl_')} in {'reward' if in_reward else 'loss'}"
            penalty = estimators.KLPenalty(coef=coef, in_reward=in_reward, estimator=estimator)
            out[name] = kl_penalty_moments(mdp, policy, reference, penalty)
    return out


def kl_matches(placements: dict, targets: dict[str, torch.Tensor], *, coef: float = 1.0,
               tol: float = 1e-10) -> dict[str, tuple[str, ...]]:
    """Which targets each placement's expected penalty gradient ``−E[ĝ]/β`` equals.

    Parameters
    ----------
    placements : dict of str to Moments
        As :func:`kl_placement_moments` returns them.
    targets : dict of str to Tensor
        As :meth:`tokenmdp.exact.kl_gradients.KLGradients.targets` returns them.
    coef : float
        The ``β`` the placements were computed with.
    tol : float
        Largest ``‖−E[ĝ]/β − target‖ / ‖∇KL(π‖π_ref)‖`` counted as equal.

    Returns
    -------
    dict of str to tuple of str
        The matching target names of each placement, in ``targets`` order (empty: none).
    """
    scale = float(targets["reverse KL"].norm())
    return {name: tuple(t for t, g in targets.items()
                        if float((-m.mean / coef - g).norm()) <= tol * scale)
            for name, m in placements.items()}


def kl_gradient_table(placements: dict, targets: dict[str, torch.Tensor], *,
                      coef: float = 1.0, tol: float = 1e-10) -> Rendered:
    """The gradient table: each placement's distance to each target, its variance, its match.

    A cell is ``‖−E[ĝ]/β − target‖ / ‖∇KL(π‖π_ref)‖`` (0 where the placement delivers that
    gradient in expectation); ``Var/β²`` is the exact total variance of ``ĝ/β``.

    Parameters
    ----------
    placements, targets, coef, tol
        As for :func:`kl_matches`.

    Returns
    -------
    Rendered
        The table, one row per placement.
    """
    matches = kl_matches(placements, targets, coef=coef, tol=tol)
    scale = float(targets["reverse KL"].norm())
    rows = [(name, *[float((-m.mean / coef - g).norm()) / scale for g in targets.values()],
             m.total_variance / coef ** 2, " = ".join(matches[name]) or "none of these")
            for name, m in placements.items()]
    return table(rows, ["placement", *[f"to {t}" for t in targets], "Var/β²", "delivers"],
                 fmt=".3f")


def mean_and_sd(samples: torch.Tensor) -> tuple[float, float, float, float]:
    """Sample mean and standard deviation of ``samples``, each with its standard error.

    The standard error of the standard deviation is the delta-method one,
    ``sqrt((m4 − s⁴)/n) / (2 s)`` with ``m4`` the fourth central moment (large ``n``).

    Parameters
    ----------
    samples : Tensor ``[n]``
        Independent draws (``n >= 2``).

    Returns
    -------
    (float, float, float, float)
        ``(mean, se of the mean, sd, se of the sd)``.
    """
    x = torch.as_tensor(samples, dtype=torch.float64).reshape(-1)
    if x.numel() < 2:
        raise ValueError(f"samples: need at least 2 draws, got {x.numel()}")
    n, mean = x.numel(), float(x.mean())
    centred = x - mean
    var, m4 = float(centred.square().mean()), float(centred.pow(4).mean())
    sd = var ** 0.5
    return mean, sd / n ** 0.5, sd, ((m4 - var ** 2) / n) ** 0.5 / (2 * sd) if sd > 0 else 0.0
