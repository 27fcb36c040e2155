"""Fork schedules of branching rollouts: where a tree of responses branches, in both worlds.

One set of schedules serves the exact world (:mod:`tokenmdp.exact.branching`, whose growth
processes define them exactly) and the trainer's rollout engine
(:meth:`tokenmdp.rl.rollout.RolloutEngine.generate_tree`, ``--rollout-tree``), so a schedule
means the same tree in both. Each is a frozen dataclass that checks itself against a response
length and a group size (:meth:`check`):

* :class:`FixedForks` ``fixed:D1xB1,D2xB2`` — after ``D_i`` response tokens every live branch
  forks into ``B_i`` branches (``D = 0``: at the prompt, an i.i.d. group). The fork points do not
  depend on the tokens;
* :class:`RandomForks` ``random:N1xT1,...`` — one chain, then per round ``i`` ``T_i`` new children
  at each of ``N_i`` prefix states of the tree drawn uniformly (without replacement) among those
  not forked at before: TreeRL's random-forking baseline (the exact world only);
* :class:`EntropyForks` ``entropy:N1xT1,...`` — the same rounds at the ``N_i`` prefix states of
  highest sampler entropy ``H(μ(·|s))`` (TreeRL's EPTree, Hou et al. 2025, arXiv 2506.11902,
  Sec. 3.1, with one initial chain per tree).

:func:`parse_tree_spec` reads the text form.
"""

from __future__ import annotations

import dataclasses
import math
import re

__all__ = ["EntropyForks", "FixedForks", "ForkRounds", "RandomForks", "Schedule", "as_schedule",
           "parse_tree_spec"]


def _ints(name: str, values, low: int) -> tuple[int, ...]:
    if isinstance(values, (str, bytes)):
        raise TypeError(f"{name}: expected a sequence of ints, got {type(values).__name__}")
    values = tuple(values)
    if not values:
        raise ValueError(f"{name}: expected at least one entry")
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{name}[{i}]: expected an int, got {type(v).__name__}")
        if v < low:
            what = "a branching budget of zero grows no tree" if name == "branching" and v == 0 \
                else f"must be >= {low}"
            raise ValueError(f"{name}[{i}] = {v}: {what}")
    return values


def _check_group_size(schedule, group_size) -> None:
    if group_size is None:
        return
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size: expected an int >= 1, got {group_size!r}")
    if group_size != schedule.leaves:
        raise ValueError(f"group_size: {group_size} leaves asked, but schedule {schedule} grows "
                         f"{schedule.leaves} (prod of the branching factors for fixed forks, "
                         "1 + sum N_i T_i for rounds)")


@dataclasses.dataclass(frozen=True)
class FixedForks:
    """Fork every live branch into ``branching[i]`` branches after ``depths[i]`` tokens.

    A branch whose response ended (EOS, or the MDP's length limit) before reaching a fork depth
    does not fork: its one leaf stands for the ``prod`` of the branching factors it skipped (its
    *slots*), and the tree has fewer than :attr:`leaves` leaves. Every slot is marginally a
    sample of the sampler (the fork points are stopping times: they depend on no token).

    Parameters
    ----------
    depths : tuple of int
        Strictly increasing fork depths, ``>= 0`` (0: at the prompt), below ``max_len``.
    branching : tuple of int
        Branches per fork, ``>= 1``, one per depth.
    """

    depths: tuple[int, ...]
    branching: tuple[int, ...]

    def __post_init__(self):
        depths = _ints("depths", self.depths, 0)
        branching = _ints("branching", self.branching, 1)
        if len(depths) != len(branching):
            raise ValueError(f"branching: {len(branching)} entries for {len(depths)} depths")
        if any(b <= a for a, b in zip(depths, depths[1:])):
            raise ValueError(f"depths: must increase strictly, got {depths}")
        object.__setattr__(self, "depths", depths)
        object.__setattr__(self, "branching", branching)

    @property
    def leaves(self) -> int:
        """``prod B_i``: the leaves of a tree none of whose branches ends before the last fork."""
        return math.prod(self.branching)

    def check(self, max_len: int, group_size: int | None = None) -> None:
        """Raise unless the schedule fits responses of at most ``max_len`` tokens and grows
        ``group_size`` leaves.

        Parameters
        ----------
        max_len : int
            The longest response (an MDP's ``max_len``, an engine's ``max_new_tokens``).
        group_size : int, optional
            The leaves asked for.

        Raises
        ------
        ValueError
            A fork depth ``>= max_len`` (no state that deep has a next token; naming
            ``depths``), or ``group_size`` not :attr:`leaves` (naming ``group_size``).
        """
        if self.depths[-1] >= max_len:
            raise ValueError(f"depths: a fork after {self.depths[-1]} tokens is deeper than any "
                             f"response can fork (at most {max_len} tokens: forks at depths "
                             f"0 .. {max_len - 1})")
        _check_group_size(self, group_size)

    def __str__(self) -> str:
        return "fixed:" + ",".join(f"{d}x{b}" for d, b in zip(self.depths, self.branching))


@dataclasses.dataclass(frozen=True)
class ForkRounds:
    """Base of the round schedules (:class:`RandomForks`, :class:`EntropyForks`): one chain,
    then rounds of ``branching[i]`` new children at ``forks[i]`` prefix states; the subclass
    says which states.

    Parameters
    ----------
    forks : tuple of int
        ``N_i >= 1``, states forked at in round ``i``.
    branching : tuple of int
        ``T_i >= 1``, new children of each of them.
    """

    kind = "rounds"

    forks: tuple[int, ...]
    branching: tuple[int, ...]

    def __post_init__(self):
        forks = _ints("forks", self.forks, 1)
        branching = _ints("branching", self.branching, 1)
        if len(forks) != len(branching):
            raise ValueError(f"branching: {len(branching)} entries for {len(forks)} rounds")
        object.__setattr__(self, "forks", forks)
        object.__setattr__(self, "branching", branching)

    @property
    def leaves(self) -> int:
        """``1 + sum N_i T_i``: the leaves of a tree with enough prefix states to fork at."""
        return 1 + sum(n * t for n, t in zip(self.forks, self.branching))

    def check(self, max_len: int, group_size: int | None = None) -> None:
        """Raise unless ``group_size`` (when given) is :attr:`leaves` (naming ``group_size``);
        any prefix state can be forked at, so ``max_len`` has nothing to refuse.

        Parameters
        ----------
        max_len : int
            The longest response (unused).
        group_size : int, optional
            The leaves asked for.
        """
        _check_group_size(self, group_size)

    def __str__(self) -> str:
        return f"{self.kind}:" + ",".join(f"{n}x{t}" for n, t in zip(self.forks, self.branching))


@dataclasses.dataclass(frozen=True)
class RandomForks(ForkRounds):
    """Rounds of forks at prefix states drawn uniformly (TreeRL's random baseline).

    Round ``i`` draws ``N_i`` of the tree's prefix states not forked at before, uniformly
    without replacement (all of them when fewer), and samples ``T_i`` new children from each,
    every new branch continued to its end. A prefix state is the prompt or a node with a child.
    The leaves are *not* marginally samples of the sampler: the states on offer depend on the
    chain already drawn (a long chain offers deep states).

    Parameters
    ----------
    forks : tuple of int
        ``N_i >= 1``, states forked at in round ``i``.
    branching : tuple of int
        ``T_i >= 1``, new children of each of them.
    """

    kind = "random"


@dataclasses.dataclass(frozen=True)
class EntropyForks(ForkRounds):
    """Rounds of forks at the prefix states of highest sampler entropy (TreeRL's EPTree).

    As :class:`RandomForks`, but round ``i`` takes the ``N_i`` prefix states not forked at before
    with the highest entropy ``H(μ(·|s)) = −Σ_a μ(a|s) log μ(a|s)`` of the sampler's next-token
    distribution (ties: shallower first, then the earlier node; the prompt is the shallowest).
    Hou et al. 2025, "TreeRL: LLM Reinforcement Learning with On-Policy Tree Search",
    arXiv 2506.11902, Sec. 3.1 (EPTree forks at the top-N entropy tokens of each tree). The
    leaves are not marginally samples of the sampler: the fork points depend on the chain.

    Parameters
    ----------
    forks : tuple of int
        ``N_i >= 1``, states forked at in round ``i``.
    branching : tuple of int
        ``T_i >= 1``, new children of each of them.
    """

    kind = "entropy"


Schedule = FixedForks | RandomForks | EntropyForks
"""Any fork schedule of the exact world."""


def as_schedule(schedule) -> Schedule:
    """``schedule`` as a schedule object: one of this module's, or its text form
    (:func:`parse_tree_spec`, ``"none"`` refused).

    Parameters
    ----------
    schedule : FixedForks, EntropyForks, RandomForks or str
        A schedule, or its text form (e.g. ``"fixed:1x2"``).

    Returns
    -------
    FixedForks, EntropyForks or RandomForks

    Raises
    ------
    TypeError
        Neither a schedule nor a string.
    ValueError
        A string that is not a schedule's text form (naming ``schedule``).
    """
    if isinstance(schedule, (FixedForks, RandomForks, EntropyForks)):
        return schedule
    if isinstance(schedule, str):
        parsed = parse_tree_spec(schedule, name="schedule")
        if parsed is None:
            raise ValueError("schedule: 'none' grows no tree")
        return parsed
    raise TypeError(f"schedule: expected FixedForks, RandomForks, EntropyForks or a text form "
                    f"such as 'fixed:1x2', got {type(schedule).__name__}")


_SPEC = re.compile(r"^(fixed|entropy|random):(\d+x\d+(?:,\d+x\d+)*)$")


def parse_tree_spec(spec: str, *, name: str = "rollout_tree") -> Schedule | None:
    """The schedule of a text spec: ``none``, ``fixed:D1xB1,D2xB2,...`` (fork into ``B``
    branches after ``D`` tokens), ``entropy:N1xT1,...`` (round ``i`` forks ``T`` children at
    each of the ``N`` highest-entropy states) or ``random:N1xT1,...`` (at ``N`` states drawn
    uniformly).

    Parameters
    ----------
    spec : str
        E.g. ``"fixed:4x2,8x2"`` (4 leaves), ``"entropy:1x3"`` (4 leaves).
    name : str
        The argument named in errors.

    Returns
    -------
    FixedForks, EntropyForks, RandomForks or None
        None for ``"none"``.

    Raises
    ------
    ValueError
        Naming ``name``: a spec of another form, or sizes out of range.
    """
    if not isinstance(spec, str):
        raise ValueError(f"{name}: expected a string, got {type(spec).__name__}")
    if spec == "none":
        return None
    match = _SPEC.match(spec.replace(" ", ""))
    if match is None:
        raise ValueError(f"{name}: expected none, fixed:DxB[,DxB...] (fork into B branches after "
                         f"D tokens), entropy:NxT[,NxT...] (T children at each of the N "
                         f"highest-entropy states per round) or random:NxT[,NxT...], got {spec!r}")
    pairs = [tuple(int(v) for v in p.split("x")) for p in match.group(2).split(",")]
    first, second = tuple(p[0] for p in pairs), tuple(p[1] for p in pairs)
    kind = {"fixed": FixedForks, "entropy": EntropyForks, "random": RandomForks}[match.group(1)]
    try:
        return kind(first, second)
    except ValueError as err:
        raise ValueError(f"{name}: {spec!r}: {err}") from None
