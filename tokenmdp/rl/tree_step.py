"""The trainer's step with branching rollouts (``--rollout-tree``): one tree per prompt.

:func:`tree_rollout_step` is the tree counterpart of the RL step's rollout
(:mod:`tokenmdp.rl.run_state`): the engine samples one tree per training prompt
(:meth:`~tokenmdp.rl.rollout.RolloutEngine.generate_tree`; its leaves are the prompt's group of
``G`` responses, fewer when a branch ends before a fork), the task scores every leaf, the
expanded batch (one sequence per leaf, ``token_extras["tree_node"]``) is packed, and the
``old_logprob`` pass (R2 records, R3 replays the engine's routing per node) and the reference
pass run over it. Then the step's updates are the usual ones (any registry estimator: the tree
entries read the node ids in ``prepare``).

``tree_forward`` chooses how the model's passes run over a tree batch: ``packed`` computes each
node once (:func:`tokenmdp.tree_training.packed_tree_outputs`: tree attention, log-probs
gathered back to the expanded layout), ``expanded`` computes every root-to-leaf path. The
loss and gradient are the same either way (up to float rounding); the MoE load-balancing term
counts each node once under ``packed`` and once per leaf under ``expanded``.

A tree with a single leaf (its branch ended before the first fork) is a group of one: a group
baseline has nothing to compare it with (GRPO's std is undefined, RLOO's baseline empty), so it
leaves the step's updates (its rewards still count in the statistics; logged as
``frac_single_leaf_trees``); a step left with no sequence takes no optimizer update. A fork at
depth 0 (at the prompt) gives every tree at least that fork's branching.

Besides the rollout's usual statistics the step logs ``generated_tokens`` (tree nodes: what
the engine sampled), ``shared_tokens`` (response tokens of the leaves' paths that the engine
did not sample again: expanded − generated), ``leaves_per_tree`` and ``forward_positions``
(token positions the engine computed).
"""

from __future__ import annotations

import math

import torch

from tokenmdp.packing import pack_first_fit_decreasing, select_sequences
from tokenmdp.rl.mismatch import (
    ENGINE_ROUTING,
    OLD_ROUTING,
    RoutingReplay,
    compute_old_logprobs,
)
from tokenmdp.rl.step_stats import rollout_stats, rollout_sums
from tokenmdp.tree_packing import pack_tree
from tokenmdp.tree_schedules import parse_tree_spec
from tokenmdp.tree_training import packed_tree_logprobs, packed_tree_outputs

__all__ = ["TREE_FORWARDS", "tree_logprob_passes", "tree_rollout_step"]

TREE_FORWARDS = ("packed", "expanded")
"""How the model's passes run over a tree batch (the module docstring)."""


def tree_logprob_passes(model, reference, batch, replay: RoutingReplay | str, *,
                        forward: str = "packed", reference_pass: bool = False):
    """The ``old_logprob`` pass over a tree batch (with ``OLD_ROUTING``, and the entropy of
    ``pi_old``) and, with ``reference_pass``, ``ref_logprob``: packed (each node once) or
    expanded (:func:`~tokenmdp.rl.mismatch.compute_old_logprobs`).

    Parameters
    ----------
    model, reference : MoETransformer
        The trained model (at the rollout's weights) and the frozen reference.
    batch : TokenBatch
        The expanded tree batch, any layout, with ``token_extras[ENGINE_ROUTING]`` under R3.
    replay : RoutingReplay or str
        Only R3 replays in this pass (the engine's routing, one record per node).
    forward : {"packed", "expanded"}
        How the passes run.
    reference_pass : bool, default False
        Also set ``ref_logprob``.

    Returns
    -------
    (TokenBatch, Tensor ``[R, C]``)
        The batch with ``old_logprob`` (one value per node with ``packed``) and
        ``OLD_ROUTING``; the entropy of ``pi_old`` at each response token.
    """
    if forward not in TREE_FORWARDS:
        raise ValueError(f"forward: expected one of {', '.join(TREE_FORWARDS)}, got {forward!r}")
    replay = RoutingReplay(replay)
    if forward == "expanded":
        batch, ent_RC = compute_old_logprobs(model, batch, replay, entropy=True)
        if reference_pass:
            with torch.no_grad():
                batch = batch.replace(ref_logprob=reference.token_logprobs(batch).to(batch.dtype))
        return batch, ent_RC
    packed = pack_tree(batch)
    routing = batch.token_extras[ENGINE_ROUTING] if replay is RoutingReplay.R3 else None
    with torch.no_grad():
        res = packed_tree_outputs(model, batch, packed, routing=routing, entropy=True, aux=False)
        batch = batch.replace(old_logprob=res.logprob_RC.to(batch.dtype),
                              token_extras={**batch.token_extras,
                                            OLD_ROUTING: res.routing.experts})
        if reference_pass:
            ref_RC = packed_tree_logprobs(reference, batch, packed)
            batch = batch.replace(ref_logprob=ref_RC.to(batch.dtype))
    return batch, res.entropy_RC.to(batch.dtype)


def tree_rollout_step(run) -> tuple:
    """One RL step's rollout with trees: sample, score, pack, ``old_logprob`` (and reference)
    pass, statistics; the tree counterpart of ``_Run.rollout``.

    Parameters
    ----------
    run : tokenmdp.rl.run_state._Run
        The run (its config's ``rollout_tree`` is a schedule, not ``none``).

    Returns
    -------
    (TokenBatch, dict of str to float)
        The packed expanded batch and the step's statistics (over all ranks).
    """
    cfg = run.cfg
    schedule = parse_tree_spec(cfg.rollout_tree)
    examples = run._share(run.task.sample(cfg.prompts_per_step, run.rng, exclude=run.exclude))
    run.engine.sync(run.model)
    tree = run.engine.generate_tree([run.tok.encode(ex.prompt) for ex in examples], schedule,
                                    max_new_tokens=cfg.max_new_tokens, eos_id=run.tok.EOS,
                                    generator=run.sample_gen, temperature=cfg.temperature,
                                    dtype=run.dtype)
    batch = tree.batch
    leaf_example = [ex for ex, t in zip(examples, tree.trees) for _ in t.leaves]
    responses = [r for _, r in batch.sequences()]
    reward_S = torch.tensor([run.task.reward(ex, r) for ex, r in zip(leaf_example, responses)],
                            dtype=run.dtype, device=batch.device)
    correct = [run.task.is_correct(ex, r) for ex, r in zip(leaf_example, responses)]
    reward = reward_S.double()
    group = batch.group
    n_groups = len(examples)
    high = reward.new_full((n_groups,), -math.inf).scatter_reduce(0, group, reward, "amax")
    low = reward.new_full((n_groups,), math.inf).scatter_reduce(0, group, reward, "amin")
    zero_std_P = high == low
    leaves_P = torch.tensor([len(t.leaves) for t in tree.trees], device=batch.device)
    batch = batch.replace(reward=reward_S)
    length_S = batch.length                # every leaf's, like the rewards in the statistics
    if bool((leaves_P == 1).any()):      # a group of one leaf: nothing to compare it with
        batch = select_sequences(batch, torch.nonzero(leaves_P[group] > 1)[:, 0])
    batch = pack_first_fit_decreasing(batch, run.capacity)
    batch, ent_RC = tree_logprob_passes(run.model, run.reference, batch, run.replay,
                                        forward=cfg.tree_forward,
                                        reference_pass=run.est.kl is not None)
    sums = rollout_sums(batch, reward_S, correct, ent_RC, groups=n_groups,
                        zero_std=float(zero_std_P.sum()),
                        all_zero=float((zero_std_P & (high == 0)).sum()),
                        sequence=run._sequence_correction(), length_S=length_S,
                        extra={"single": float((leaves_P == 1).sum()),
                               **{k: float(v) for k, v in tree.stats.items()}})
    g, stats = rollout_stats(sums, run.device)
    stats.update({"generated_tokens": int(g["generated_tokens"]),
                  "shared_tokens": int(g["shared_tokens"]),
                  "forward_positions": int(g["forward_positions"]),
                  "leaves_per_tree": g["leaves"] / g["groups"],
                  "frac_single_leaf_trees": g["single"] / g["groups"]})
    return batch, stats
