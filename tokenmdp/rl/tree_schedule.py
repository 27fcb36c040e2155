"""The trainer's tree settings, checked: ``--rollout-tree`` (a fork schedule of
:mod:`tokenmdp.tree_schedules` in its text form), ``--tree-forward`` and the group size.

:mod:`tokenmdp.rl.tree_rollout` samples the trees (its docstring says how the engine forks).
"""

from __future__ import annotations

from tokenmdp.tree_schedules import RandomForks, parse_tree_spec

__all__ = ["check_tree_config"]


def check_tree_config(cfg) -> None:
    """The tree fields of a :class:`~tokenmdp.rl.config.TrainConfig`, checked:
    ``rollout_tree`` a spec whose forks fit ``max_new_tokens`` (RL only), ``tree_forward`` packed
    or expanded, ``group_size`` the tree's leaves, and an estimator that needs trees only with
    trees.

    Parameters
    ----------
    cfg : TrainConfig
        The configuration.

    Raises
    ------
    ValueError
        Naming the field at fault.
    """
    from tokenmdp import estimators

    if cfg.tree_forward not in ("packed", "expanded"):
        raise ValueError(f"tree_forward: expected packed or expanded, got {cfg.tree_forward!r}")
    schedule = parse_tree_spec(cfg.rollout_tree)
    needs_tree = cfg.mode == "rl" and cfg.estimator in estimators.names(trees=True)
    if schedule is None:
        if needs_tree:
            raise ValueError(f"estimator: {cfg.estimator} reads a tree's node ids; give "
                             "--rollout-tree (e.g. fixed:2x2,4x2 --group-size 4)")
        return
    if cfg.mode != "rl":
        raise ValueError(f"rollout_tree: {cfg.rollout_tree} samples responses, which sft does "
                         "not; use none")
    if isinstance(schedule, RandomForks):
        raise ValueError(f"rollout_tree: {cfg.rollout_tree}: random forks are the exact world's "
                         "baseline (tokenmdp.exact.branching); the engine forks fixed: or "
                         "entropy:")
    try:
        schedule.check(cfg.max_new_tokens)
    except ValueError as err:
        raise ValueError(f"rollout_tree: {cfg.rollout_tree!r}: {err}") from None
    if schedule.leaves != cfg.group_size:
        raise ValueError(f"rollout_tree: {cfg.rollout_tree} has {schedule.leaves} leaves per "
                         f"prompt, but group_size is {cfg.group_size}; pass --group-size "
                         f"{schedule.leaves}")
