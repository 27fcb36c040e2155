"""Who counts the tokens, at length: the aggregations' exact bias, variance and length bias.

Section 5 of ``benchmarks/lattice.py``. One surrogate (REINFORCE, on-policy unless an engine
noise is asked for) and one advantage (the group mean, Dr. GRPO's; or the reward itself, defined
at ``G = 1``); only the aggregation varies: ``token-mean`` (DAPO, weight ``1 / Σ_j |y_j|``,
exact at every ``G`` by the lattice's Laplace identity), ``seq-mean-token-mean`` (GRPO,
``1 / (G |y_i|)``) and ``constant`` (Dr. GRPO, ``1 / (G T)``; ``seq-mean-token-sum`` is the same
direction at the scale ``T``, so its scale-free figures are the constant's).

**The world** (:func:`answer_world`) is tutorial 4's at length: the first token is the answer
(token 0 right, tokens ``1 … V − 2`` wrong, an immediate EOS the empty answer, wrong), and what
follows is chatter the reward ignores. Right answers stop after about ``T/4`` tokens, wrong ones
ramble for about ``T/2``, so lengths grow with ``T``, vary within a group and correlate with the
reward (wrong answers are the long ones, as in reasoning models). ``J`` reads the answer token
only, so ``∇J`` is zero on every chatter logit: along ``∇J`` neither the length of a right
answer nor that of a wrong one changes, and whatever an aggregation does to them is its length
bias. The empty answer (1% by default) is the shortest wrong response there is.

**Two coordinate systems.** The lattice policy is tabular: one logit table per position. An LLM
shares its weights across positions; its closest lattice analogue is one table over the states
used at every position (time-homogeneous). Both have the same logits here, and a gradient in the
shared table is the sum over positions of the tabular one, so every figure of the *mean* (cosine,
bias after the best scale, length direction) is given in both, exactly. The variance is the
tabular one (its shared version needs the cross-position covariance).

**Scale-free figures** per (advantage, aggregation, ``G``, ``T``): ``cos(E ĝ, ∇J)``; the bias
after the best scalar, ``‖c* E ĝ − ∇J‖ / ‖∇J‖`` with ``c* = ⟨E ĝ, ∇J⟩ / ‖E ĝ‖²``
(:class:`~tokenmdp.exact.Moments`' ``scale`` and ``directional_bias``); the relative variance
``tr Cov / ‖E ĝ‖²`` of one group; the *gain* of one group at its MSE-optimal step
``⟨E ĝ, ∇J⟩ / E‖ĝ‖²``, ``1 − min_c E‖c ĝ − ∇J‖² / ‖∇J‖² = cos² / (1 + tr Cov / ‖E ĝ‖²)``
(``B`` groups per step divide the variance term by ``B``); the length direction
``cos(E ĝ, ∇E|y|)`` beside ``∇J``'s; and, per unit of ``J`` gained along ``E ĝ``, the relative
change ``d log E[|y| | right] / dJ`` and ``d log E[|y| | wrong] / dJ`` (0 along ``∇J``).
"""

from __future__ import annotations

import dataclasses
import io
import math
import time
from pathlib import Path

import numpy as np
import torch

from tokenmdp.estimators import Aggregation, Estimator, GroupMean, Reinforce, RewardAsAdvantage
from tokenmdp.exact import lattice as L

START, RIGHT, WRONG = 0, 1, 2
AGGREGATIONS = (Aggregation.TOKEN_MEAN, Aggregation.SEQUENCE_MEAN_TOKEN_MEAN, Aggregation.CONSTANT)
LABELS = {Aggregation.TOKEN_MEAN: "token-mean (DAPO)",
          Aggregation.SEQUENCE_MEAN_TOKEN_MEAN: "seq-mean-token-mean (GRPO)",
          Aggregation.CONSTANT: "constant (Dr. GRPO)",
          Aggregation.SEQUENCE_MEAN_TOKEN_SUM: "seq-mean-token-sum"}
ADVANTAGES = {"group-mean": GroupMean(), "reward": RewardAsAdvantage()}
COORDINATES = ("tabular", "shared")


def answer_world(T: int, V: int = 8, *, p_right: float = 0.3, p_empty: float = 0.01,
                 right_length: float = 0.25, wrong_length: float = 0.5, sigma: float = 0.0,
                 seed: int = 0):
    """Tutorial 4's world at length ``T``: the answer first, then chatter.

    Parameters
    ----------
    T : int
        The longest response.
    V : int, default 8
        Tokens, EOS (``V − 1``) included; at least 3.
    p_right, p_empty : float, default 0.3 and 0.01
        ``P(first token right)`` and ``P(first token EOS)``; the wrong tokens share the rest.
    right_length, wrong_length : float, default 0.25 and 0.5
        The mean chatter after a right (wrong) answer as a fraction of ``T``: EOS has
        probability ``1 / (fraction · T)`` per token (before the truncation at ``T``).
    sigma : float, default 0.0
        The engine ``μ``: the logits plus ``N(0, σ²)`` per (state, token).
    seed : int, default 0
        Source of the chatter logits and of the engine noise.

    Returns
    -------
    mdp : LatticeMDP
        Three states (start, right, wrong); reward 1 in ``RIGHT``.
    pi : LatticePolicy
        ``π_θ``, logits depending on the state only.
    mu : LatticePolicy
        The engine (``pi`` itself when ``sigma == 0``).
    """
    if V < 3:
        raise ValueError(f"V: expected >= 3 (a right token, a wrong one and EOS), got {V}")
    if not (p_right > 0 and p_empty > 0 and p_right + p_empty < 1):
        raise ValueError("p_right, p_empty: expected positive with p_right + p_empty < 1")
    table = np.empty((3, V - 1), dtype=np.int64)
    table[START, 0], table[START, 1:] = RIGHT, WRONG
    table[RIGHT], table[WRONG] = RIGHT, WRONG
    mdp = L.LatticeMDP(L.RewardAutomaton(table, [0.0, 1.0, 0.0]), T)
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(3, V, generator=g, dtype=torch.float64)
    base[START] = math.log((1 - p_right - p_empty) / (V - 2))
    base[START, 0], base[START, V - 1] = math.log(p_right), math.log(p_empty)
    for z, fraction in ((RIGHT, right_length), (WRONG, wrong_length)):
        q = min(1.0 / (fraction * T), 0.5)
        base[z, V - 1] = torch.logsumexp(base[z, :V - 1], 0) + math.log(q / (1 - q))
    noise = torch.randn(3, V, generator=g, dtype=torch.float64) * sigma
    pi = L.LatticePolicy(mdp, logits=base.expand(T, 3, V))
    if sigma == 0:
        return mdp, pi, pi
    return mdp, pi, L.LatticePolicy(mdp, logits=(base + noise).expand(T, 3, V)
                                    ).requires_grad_(False)


def answer_lengths(mdp, policy) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``E|y|``, ``E[|y| | right]`` and ``E[|y| | wrong]``, differentiable in the logits.

    A response whose first token is of class ``c`` acts once at the start node and once at each
    node ``(t ≥ 1, c)`` it visits: ``E[|y| 1{c}] = P(c) + Σ_{t ≥ 1} d(t, c)``. "Wrong" means a
    wrong answer *token*: the empty answer is left out, so that both conditional lengths read
    the chatter logits only (``∇J`` changes the empty answer's share of the wrong ones).

    Parameters
    ----------
    mdp : LatticeMDP
        A lattice of :func:`answer_world`.
    policy : LatticePolicy
        The policy.

    Returns
    -------
    tuple of Tensor
        Three float64 scalars.
    """
    d = L.visitation(mdp, policy)                                  # [T + 1, 3]
    p = torch.softmax(policy.logits[0, START], -1)
    p_right, p_wrong = p[0], p[1:-1].sum()
    right = (p_right + d[1:-1, RIGHT].sum()) / p_right
    wrong = (p_wrong + d[1:-1, WRONG].sum()) / p_wrong
    return d[:-1].sum(), right, wrong


def shared(vector: torch.Tensor, mdp) -> torch.Tensor:
    """A tabular gradient ``[T·K·V]`` in the coordinates of one table shared by all positions
    (the chain rule: the sum over positions), ``[K·V]``."""
    return vector.reshape(mdp.shape).sum(0).reshape(-1)


def length_gradients(mdp, policy) -> dict[str, dict]:
    """``∇J`` and the gradients of :func:`answer_lengths`, in both coordinate systems.

    Parameters
    ----------
    mdp : LatticeMDP
        A lattice of :func:`answer_world`.
    policy : LatticePolicy
        The policy.

    Returns
    -------
    dict
        Per coordinate system (:data:`COORDINATES`), flat tensors under ``"J"``, ``"length"``,
        ``"right"`` and ``"wrong"``; the three lengths (floats) under ``"values"``.
    """
    tab = {"J": L.gradient(mdp, policy)}
    values = {}
    for name, q in zip(("length", "right", "wrong"), answer_lengths(mdp, policy), strict=True):
        tab[name] = torch.autograd.grad(q, policy.logits, retain_graph=True)[0].reshape(-1)
        values[name] = float(q.detach())
    return {"tabular": tab, "shared": {k: shared(v, mdp) for k, v in tab.items()},
            "values": values}


def direction(mean: torch.Tensor, grads: dict, values: dict) -> dict[str, float]:
    """The figures of a mean direction against ``∇J`` and the lengths (one coordinate system).

    Parameters
    ----------
    mean : Tensor
        ``E ĝ`` (or ``∇J`` itself).
    grads : dict
        One coordinate system of :func:`length_gradients`.
    values : dict
        Its ``"values"``.

    Returns
    -------
    dict of str to float
        ``cosine``, ``bias`` (after the best positive scale), ``length_cosine``,
        ``length_per_J``, ``right_per_J`` and ``wrong_per_J`` (``d log E[·] / dJ``).
    """
    g = grads["J"]
    dot, m2 = float(mean @ g), float(mean @ mean)
    scale = max(0.0, dot / m2)
    out = {"cosine": dot / math.sqrt(m2 * float(g @ g)),
           "bias": float((scale * mean - g).norm() / g.norm()),
           "length_cosine": float(mean @ grads["length"]) / math.sqrt(
               m2 * float(grads["length"] @ grads["length"]))}
    for k in ("length", "right", "wrong"):
        out[f"{k}_per_J"] = float(mean @ grads[k]) / dot / values[k]
    return out


def estimator(advantage: str, aggregation: Aggregation) -> Estimator:
    """REINFORCE with the advantage named in :data:`ADVANTAGES` and ``aggregation``.

    Parameters
    ----------
    advantage : str
        A key of :data:`ADVANTAGES`.
    aggregation : Aggregation
        The aggregation.

    Returns
    -------
    Estimator
        Named ``reinforce/<advantage>/<aggregation>``.
    """
    return Estimator(surrogate=Reinforce(), advantage=ADVANTAGES[advantage],
                     aggregation=aggregation, name=f"reinforce/{advantage}/{aggregation.value}")


@dataclasses.dataclass(frozen=True)
class Row:
    """One (advantage, aggregation, ``G``, ``T``): ``tabular`` and ``shared`` hold
    :func:`direction`'s figures; the variance figures are tabular."""

    advantage: str
    aggregation: Aggregation
    G: int
    T: int
    method: str
    tabular: dict
    shared: dict
    relative_variance: float
    gain: float
    seconds: float


def measure(mdp, pi, mu, est: Estimator, G: int, grads: dict, advantage: str = "") -> Row | None:
    """The exact :class:`Row` of ``est`` at ``G``; None when ``E ĝ = 0`` (the group mean at
    ``G = 1``). Raises unless ``exact_support`` says the lattice computes it exactly.

    Parameters
    ----------
    mdp, pi, mu
        :func:`answer_world`.
    est : Estimator
        The estimator.
    G : int
        Responses per group (one group per step).
    grads : dict
        :func:`length_gradients` of ``pi``.
    advantage : str, default ""
        The label the row carries.

    Returns
    -------
    Row or None
        The figures; ``method`` is ``Moments.method`` (``"lattice"``).
    """
    exact, why = L.exact_support(est, G)
    if not exact:
        raise ValueError(f"{est.name} at G = {G} is not exact on the lattice: {why}")
    t0 = time.perf_counter()
    m = L.moments(mdp, pi, est, group_size=G, behavior=mu, method="lattice")
    seconds = time.perf_counter() - t0
    norm2 = float(m.mean @ m.mean)
    if norm2 == 0:
        return None
    rel_var = m.total_variance / norm2
    v = grads["values"]
    return Row(advantage=advantage, aggregation=est.aggregation, G=G, T=mdp.max_len,
               method=m.method, tabular=direction(m.mean, grads["tabular"], v),
               shared=direction(shared(m.mean, mdp), grads["shared"], v),
               relative_variance=rel_var, gain=m.cosine ** 2 / (1 + rel_var), seconds=seconds)


def grid(lengths, group_sizes, advantages=("group-mean", "reward"), aggregations=AGGREGATIONS, *,
         V: int = 8, sigma: float = 0.0, p_empty: float = 0.01):
    """Every (advantage, aggregation, ``G``, ``T``) of the grid, exactly.

    Parameters
    ----------
    lengths, group_sizes : sequence of int
        ``T`` and ``G``.
    advantages : sequence of str, default ("group-mean", "reward")
        Keys of :data:`ADVANTAGES`.
    aggregations : sequence of Aggregation, default :data:`AGGREGATIONS`
        The aggregations compared.
    V, sigma, p_empty
        :func:`answer_world`'s vocabulary, engine noise (0: on-policy) and empty answer.

    Returns
    -------
    rows : list of Row
        The rows with a non-zero mean gradient.
    references : dict of int to dict
        Per ``T``: ``J``, the three lengths, and ``∇J``'s :func:`direction` per coordinate
        system.
    """
    rows, references = [], {}
    for T in lengths:
        mdp, pi, mu = answer_world(T, V, sigma=sigma, p_empty=p_empty)
        grads = length_gradients(mdp, pi)
        with torch.no_grad():
            J = float(L.objective(mdp, pi))
        references[T] = {"J": J, **grads["values"],
                         **{c: direction(grads[c]["J"], grads[c], grads["values"])
                            for c in COORDINATES}}
        for adv in advantages:
            for agg in aggregations:
                for G in group_sizes:
                    row = measure(mdp, pi, mu, estimator(adv, agg), G, grads, adv)
                    if row is not None:
                        rows.append(row)
    return rows, references


def crossover_groups(rows, T: int, G: int, advantage: str = "group-mean") -> float:
    """Groups per step ``B*`` at which the gains of the constant and of the per-sequence token
    mean cross, ``cos_s² / (1 + v_s/B) = cos_c² / (1 + v_c/B)`` (tabular figures); above it the
    one with the larger ``cos²`` gains more. ``nan``: a row is missing or the gains never cross.

    Parameters
    ----------
    rows : list of Row
        :func:`grid`'s rows.
    T, G : int
        The cell.
    advantage : str, default "group-mean"
        The advantage.

    Returns
    -------
    float
        ``B* = (cos_c² v_s − cos_s² v_c) / (cos_s² − cos_c²)`` when positive.
    """
    found = {r.aggregation: r for r in rows if (r.advantage, r.T, r.G) == (advantage, T, G)}
    s, c = found.get(Aggregation.SEQUENCE_MEAN_TOKEN_MEAN), found.get(Aggregation.CONSTANT)
    if s is None or c is None:
        return math.nan
    s2, c2 = s.tabular["cosine"] ** 2, c.tabular["cosine"] ** 2
    if s2 == c2:
        return math.nan
    B = (c2 * s.relative_variance - s2 * c.relative_variance) / (s2 - c2)
    return B if B > 0 else math.nan


def figure(path, rows, references, advantage: str = "group-mean") -> None:
    """Two rows of panels against ``T`` (shared coordinates above, tabular below), one line per
    (aggregation, ``G``): the bias after ``c*``, the length cosine or the relative variance, and
    the relative length change of wrong and right answers per unit of ``J``.

    Parameters
    ----------
    path : str or Path
        The PNG to write.
    rows, references
        :func:`grid`'s result.
    advantage : str, default "group-mean"
        The advantage whose rows are drawn.
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from PIL import Image  # a dependency of matplotlib

    rows = [r for r in rows if r.advantage == advantage]
    Ts = list(references)
    Gs = sorted({r.G for r in rows})
    alpha = {G: 0.4 + 0.6 * i / max(1, len(Gs) - 1) for i, G in enumerate(Gs)}
    color = {Aggregation.TOKEN_MEAN: "tab:blue", Aggregation.SEQUENCE_MEAN_TOKEN_MEAN: "tab:red",
             Aggregation.CONSTANT: "tab:green"}
    tm, sm, co = AGGREGATIONS
    g8 = [G for G in Gs if G == 8] or Gs[-1:]

    def shade(name, weight):                          # an opaque tint: smaller PNG than alpha
        rgb = np.array(matplotlib.colors.to_rgb(name))
        return tuple(weight * rgb + (1 - weight) * np.ones(3))

    def draw(ax, get, curves, style="-", label=True):
        for agg, group_sizes in curves:
            for G in group_sizes:
                pts = sorted((r.T, get(r)) for r in rows if r.aggregation == agg and r.G == G)
                if pts:
                    ax.plot(*zip(*pts), "o" + style, color=shade(color[agg], alpha[G]), ms=3,
                            lw=1.3, label=f"{LABELS[agg]}, G = {G}" if label else None)

    fig, ax = plt.subplots(2, 3, figsize=(13, 7.4))
    for i, c in enumerate(("shared", "tabular")):
        draw(ax[i, 0], lambda r, c=c: r.__dict__[c]["bias"], [(tm, Gs), (sm, g8)])
        ax[i, 0].set(yscale="log", ylabel=r"$\|c^*E\hat g-\nabla J\|\,/\,\|\nabla J\|$",
                     title=f"{c}: bias after the best scale (constant: 0)")
        for key, style in (("wrong_per_J", "-"), ("right_per_J", ":")):
            draw(ax[i, 2], lambda r, c=c, k=key: r.__dict__[c][k], [(tm, Gs), (sm, g8)],
                 style, label=False)
        ax[i, 2].axhline(0, color="k", ls="--", lw=1, label=r"$\nabla J$, constant")
        ax[i, 2].plot([], [], "k-", lw=1.3, label="wrong answers")
        ax[i, 2].plot([], [], "k:", lw=1.3, label="right answers")
        ax[i, 2].set(ylabel=r"$d \log E[\,|y|\ |\ \cdot\,]\ /\ dJ$",
                     title=f"{c}: length change per unit of J")
    draw(ax[0, 1], lambda r: r.shared["length_cosine"], [(tm, Gs), (sm, g8), (co, g8)])
    ax[0, 1].plot(Ts, [references[T]["shared"]["length_cosine"] for T in Ts], "k--", lw=1,
                  label=r"$\nabla J$")
    ax[0, 1].set(ylabel=r"cos$(E\hat g,\ \nabla E|y|)$", title="shared: length direction")
    draw(ax[1, 1], lambda r: r.relative_variance, [(a, [G for G in Gs if G in (2, 8)] or Gs)
                                                   for a in AGGREGATIONS])
    ax[1, 1].set(yscale="log", ylabel=r"tr Cov / $\|E\hat g\|^2$",
                 title="tabular: relative variance of one group")
    for a in ax.flat:
        a.set(xscale="log", xlabel="T")
        a.set_xticks(Ts, [str(T) for T in Ts])
        a.minorticks_off()
        a.grid(alpha=0.3)
    for a in (ax[0, 0], ax[0, 1], ax[1, 1], ax[0, 2], ax[1, 2]):
        a.legend(fontsize=6.5)
    fig.suptitle("Who counts the tokens, exactly: REINFORCE, advantage "
                 f"{ADVANTAGES[advantage].describe()}; top: one logit table shared by all "
                 "positions, bottom: one per position", fontsize=10)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=90)
    plt.close(fig)
    buffer.seek(0)                                    # a 256-colour palette: a third of the bytes
    Image.open(buffer).convert("RGB").quantize(colors=256).save(path, optimize=True)
    print(f"figure: {path}")
