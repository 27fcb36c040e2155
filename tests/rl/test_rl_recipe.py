"""RL that does not start cold (issue 31): the learning-rate warm-up in RL, AdamW's state carried
from the ``init`` checkpoint or reset on purpose (``optimizer_state``), and groups of equal rewards
kept or skipped (``zero_variance_groups``), with their fraction logged.

The checks are against AdamW's own update rule, not the trainer's code: a fresh AdamW's first step
moves every coordinate with a gradient by ``lr`` (``m̂ / √v̂ = sign g``), so the largest move is
the warmed-up ``lr``; one step from moments ``(m0, v0)`` leaves ``m1 − β1 m0 = (1 − β1) g`` and
``v1 − β2 v0 = (1 − β2) g²``, so ``(m1 − β1 m0)² (1 − β2) = (v1 − β2 v0) (1 − β1)²`` for the
``g`` the step used, whatever it was. A step that takes no optimizer update leaves the weights and
the optimizer state bit for bit; one that takes an update with a zero gradient still moves them
(AdamW's moments), which is why zero reward was absorbing.
"""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch

from tests._ranks import join_group, leave_group, run_ranks
from tests.rl._cli import TINY_ARGS, one_line_error, run_cli
from tests.rl.test_trainer_ddp import _rank_share, _update
from tokenmdp.rl import trainer
from tokenmdp.rl.checkpoint import save_checkpoint
from tokenmdp.rl.config import TrainConfig, check_config
from tokenmdp.rl.trainer import TIMING_FIELDS, train
from tokenmdp.rl.update import without_zero_variance_groups

TINY = dict(d_model=32, n_layers=1, n_heads=2, n_experts=4, top_k=2, expert_hidden=16,
            prompts_per_step=4, group_size=4, max_new_tokens=6, eval_size=4, eval_every=0,
            checkpoint_every=1)
SFT_STEPS = 3
#: float32 moments: (m1 - β1 m0)² (1 - β2) against (v1 - β2 v0) (1 - β1)², relative to v1
MOMENT_RTOL = 1e-4
#: AdamW's eps (1e-8) against the smallest gradient that sets the largest move
ADAM_RTOL = 1e-4


def _lines(path):
    return [json.loads(line) for line in open(path)]


def _state(path):
    return torch.load(path, weights_only=True)


def make_sft(out, tasks=("count", "addition")) -> dict:
    """An SFT checkpoint per task under ``out``, each with AdamW moments: task → its path."""
    paths = {}
    for task in tasks:
        train(TrainConfig(mode="sft", task=task, steps=SFT_STEPS, lr=1e-2, out_dir=str(out / task),
                          **TINY))
        paths[task] = str(out / task / "checkpoint.pt")
    return paths


@pytest.fixture(scope="module")
def sft(tmp_path_factory):
    """An SFT checkpoint on ``count`` (graded rewards: groups differ) and one on ``addition``
    (a barely trained model: every reward 0)."""
    return make_sft(tmp_path_factory.mktemp("sft"))


def _rl(sft, tmp_path, name, **changes):
    task = changes.pop("task", "count")
    return TrainConfig(task=task, estimator="minirl", init=sft[task], out_dir=str(tmp_path / name),
                       **{**TINY, "steps": 1, "lr": 1e-2, **changes})


def test_the_warm_up_applies_to_rl_updates(sft, tmp_path):
    cfg = _rl(sft, tmp_path, "warm", warmup_steps=4, steps=2)
    rows = train(cfg)
    assert [r["lr"] for r in rows] == [pytest.approx(1e-2 / 4), pytest.approx(1e-2 / 2)]
    start = _state(sft["count"])["model"]
    after = _state(tmp_path / "warm" / "checkpoint.pt")
    # the second step is checkpointed; the first step's move is rerun alone
    train(dataclasses.replace(cfg, steps=1, overwrite=True))
    first = _state(tmp_path / "warm" / "checkpoint.pt")["model"]
    largest = max(float((first[k] - start[k]).abs().max()) for k in start)
    assert largest == pytest.approx(1e-2 / 4, rel=ADAM_RTOL)   # a fresh AdamW: lr · sign g
    assert after["step"] == 2


def test_reset_starts_adamw_at_zero(sft, tmp_path):
    cfg = _rl(sft, tmp_path, "reset", optimizer_state="reset")
    assert trainer._Run(cfg).optimizer.state_dict()["state"] == {}
    train(cfg)
    opt = _state(tmp_path / "reset" / "checkpoint.pt")["optimizer"]
    b1, b2 = opt["param_groups"][0]["betas"]
    for entry in opt["state"].values():      # m1 = (1 - β1) g, v1 = (1 - β2) g²: from zero
        assert float(entry["step"]) == 1.0
        torch.testing.assert_close(entry["exp_avg"] ** 2 * (1 - b2),
                                   entry["exp_avg_sq"] * (1 - b1) ** 2, rtol=MOMENT_RTOL,
                                   atol=1e-12 * float(entry["exp_avg_sq"].max()))


def test_carry_takes_the_init_checkpoints_moments_with_this_runs_settings(sft, tmp_path):
    saved = _state(sft["count"])["optimizer"]
    cfg = _rl(sft, tmp_path, "carry", optimizer_state="carry", beta2=0.999, weight_decay=0.01)
    run = trainer._Run(cfg)
    state = run.optimizer.state_dict()
    assert state["state"].keys() == saved["state"].keys() and state["state"]
    for index, entry in state["state"].items():
        for key, value in entry.items():
            assert torch.equal(value, saved["state"][index][key]), (index, key)
    group = state["param_groups"][0]
    assert (group["betas"], group["weight_decay"]) == ((0.9, 0.999), 0.01)   # not SFT's
    train(cfg)
    after = _state(tmp_path / "carry" / "checkpoint.pt")["optimizer"]["state"]
    moved = 0
    for index, entry in after.items():       # one step from SFT's moments, not from zero
        m0, v0 = saved["state"][index]["exp_avg"], saved["state"][index]["exp_avg_sq"]
        assert float(entry["step"]) == SFT_STEPS + 1
        g_sq = (entry["exp_avg_sq"] - 0.999 * v0) / (1 - 0.999)
        torch.testing.assert_close(((entry["exp_avg"] - 0.9 * m0) / (1 - 0.9)) ** 2, g_sq,
                                   rtol=MOMENT_RTOL, atol=MOMENT_RTOL * float(v0.max()))
        moved += int(not torch.allclose(entry["exp_avg"], (1 - 0.9) * g_sq.clamp(min=0).sqrt()))
    assert moved


def test_a_carried_run_resumes_exactly(sft, tmp_path):
    base = _rl(sft, tmp_path, "a", optimizer_state="carry", steps=4,
               zero_variance_groups="skip", warmup_steps=3, eval_every=2)
    straight = train(base)
    half = dataclasses.replace(base, out_dir=str(tmp_path / "b"))
    train(dataclasses.replace(half, steps=2))
    resumed = train(dataclasses.replace(half, resume=True))

    def strip(rows):
        return [{k: v for k, v in r.items() if k not in TIMING_FIELDS} for r in rows]

    assert strip(_lines(tmp_path / "a" / "metrics.jsonl")) == strip(
        _lines(tmp_path / "b" / "metrics.jsonl"))
    assert strip(straight[2:]) == strip(resumed) and resumed[-1]["grad_norm"] > 0


def test_carry_is_refused_without_an_optimizer_state_or_an_init(sft, tmp_path):
    state = _state(sft["count"])
    del state["optimizer"], state["sha256"]
    save_checkpoint(state, tmp_path / "bare.pt")
    cfg = dataclasses.replace(_rl(sft, tmp_path, "bare", optimizer_state="carry"),
                              init=str(tmp_path / "bare.pt"))
    with pytest.raises(ValueError, match="optimizer_state: carry.*bare.pt holds none"):
        train(cfg)
    with pytest.raises(ValueError, match="optimizer_state: carry.*--init"):
        check_config(dataclasses.replace(cfg, init=None))


@pytest.mark.parametrize("changes, match", [
    (dict(optimizer_state="warm"), "optimizer_state: expected one of reset, carry"),
    (dict(zero_variance_groups="drop"), "zero_variance_groups: expected one of keep, skip"),
    (dict(zero_variance_groups="skip", mode="sft"), "zero_variance_groups: skip.*sft"),
    (dict(zero_variance_groups="skip", group_size=1), "zero_variance_groups: skip.*group_size 1"),
])
def test_bad_recipe_settings_are_named(changes, match):
    with pytest.raises(ValueError, match=match):
        check_config(TrainConfig(**{**TINY, **changes}))


def test_the_cli_refuses_a_bad_setting_in_one_line(tmp_path):
    proc = run_cli("train", *TINY_ARGS, "--zero-variance-groups", "drop", "--out-dir",
                   tmp_path / "run")
    assert "zero_variance_groups" in one_line_error(proc)


@pytest.mark.parametrize("policy", ["keep", "skip"])
def test_a_step_of_equal_rewards_moves_the_weights_only_when_kept(sft, tmp_path, policy):
    # the addition model after 3 SFT steps answers nothing right: every group's rewards are 0,
    # every advantage 0; AdamW carries SFT's moments, so an update with a zero gradient moves
    cfg = _rl(sft, tmp_path, policy, task="addition", optimizer_state="carry",
              zero_variance_groups=policy)
    (row,) = train(cfg)
    assert row["frac_reward_zero_std"] == 1.0 and row["frac_reward_all_zero"] == 1.0
    start = _state(sft["addition"])
    after = _state(tmp_path / policy / "checkpoint.pt")
    same = all(torch.equal(after["model"][k], start["model"][k]) for k in start["model"])
    if policy == "skip":
        assert row["optimizer_steps"] == 0 and row["loss"] is None and same
        for index, entry in start["optimizer"]["state"].items():   # the moments too
            for key, value in entry.items():
                assert torch.equal(after["optimizer"]["state"][index][key], value)
    else:
        assert row["optimizer_steps"] == 1 and row["grad_norm"] == 0.0 and not same


def test_the_zero_variance_fraction_is_counted_from_the_rewards(sft, tmp_path):
    run = trainer._Run(_rl(sft, tmp_path, "count", group_size=3, prompts_per_step=8))
    batch, stats = run.rollout()
    by_group = {}
    for s in range(batch.num_sequences):
        by_group.setdefault(int(batch.group[s]), []).append(float(batch.reward[s]))
    assert len(by_group) == 8 and all(len(r) == 3 for r in by_group.values())
    equal = [len(set(r)) == 1 for r in by_group.values()]
    assert stats["frac_reward_zero_std"] == sum(equal) / 8
    assert stats["frac_reward_all_zero"] == sum(
        e and r[0] == 0 for e, r in zip(equal, by_group.values())) / 8


def test_skip_drops_exactly_the_groups_of_equal_rewards(sft, tmp_path):
    run = trainer._Run(_rl(sft, tmp_path, "drop"))
    batch, _ = run.rollout()
    # groups 0-3 of 4 responses; rewards by hand: 1 and 3 equal within the group, 0 and 2 not
    rewards = {0: [0.0, 1.0, 1.0, 1.0], 1: [0.5] * 4, 2: [0.0, 0.0, 0.0, 0.25], 3: [0.0] * 4}
    reward_S = torch.tensor([rewards[int(g)][i % 4] for i, g in enumerate(batch.group)],
                            dtype=batch.dtype)
    kept = without_zero_variance_groups(batch.replace(reward=reward_S), run.capacity)
    assert sorted(set(kept.group.tolist())) == [0, 2] and kept.num_sequences == 8
    assert kept.num_loss_tokens == sum(
        int(batch.loss_mask[batch.sequence_id == s].sum()) for s in range(16)
        if int(batch.group[s]) in (0, 2))
    none = without_zero_variance_groups(batch.replace(reward=torch.zeros_like(reward_S)),
                                        run.capacity)
    assert none.num_sequences == 0 and none.num_loss_tokens == 0
    distinct = batch.replace(reward=torch.arange(16, dtype=batch.dtype))
    assert without_zero_variance_groups(distinct, run.capacity) is distinct


@pytest.mark.parametrize("name", ["ppo", "reinforce_pp_baseline", "grpo", "dapo",
                                  "minirl_seq_tis"])
def test_skip_leaves_one_group_to_estimators_with_batch_statistics_and_kl(name):
    # batch-normalized and whitened advantages, a KL term, a sequence-level weight: each gets a
    # step with one group left, and a step with none takes no update
    run = trainer._Run(TrainConfig(task="addition", estimator=name, zero_variance_groups="skip",
                                   **{**TINY, "prompts_per_step": 2, "group_size": 2}))
    batch, _ = run.rollout()
    reward_S = torch.zeros_like(batch.reward)
    assert run.updates(batch.replace(reward=reward_S))["optimizer_steps"] == 0
    reward_S[(batch.group == 0).nonzero()[0]] = 1.0       # group 0: one right of two
    out = run.updates(batch.replace(reward=reward_S))
    assert out["optimizer_steps"] == 1 and out["grad_norm"] > 0


# ---------------------------------------------------------------------- data parallel
DDP = TrainConfig(task="count", dtype="float64", grad_clip=0.0, estimator="minirl",
                  zero_variance_groups="skip", prompts_per_step=4, group_size=4, max_new_tokens=6,
                  d_model=32, n_layers=1, n_heads=2, n_experts=4, top_k=2, expert_hidden=16,
                  eval_size=4, lr=1e-2, seed=3)
#: float64; only the order of summation differs
DDP_TOL = 1e-10


def _ddp_batch():
    """A step whose groups 0 and 1 (rank 0's share) have equal rewards and 2 and 3 do not."""
    batch, _ = trainer._Run(DDP).rollout()
    reward_S = batch.reward.clone()
    for g in (0, 1):
        reward_S[batch.group == g] = 0.0
    for g in (2, 3):
        values = reward_S[batch.group == g]
        assert values.max() > values.min()
    return batch.replace(reward=reward_S)


def _ddp_worker(rank: int, port: int, out_dir: str) -> None:
    join_group(rank, port, 2)
    batch = torch.load(f"{out_dir}/batch.pt", weights_only=False)
    run = trainer._Run(DDP)
    torch.save(_update(run, _rank_share(batch, rank)), f"{out_dir}/rank{rank}.pt")
    leave_group()


def test_a_rank_left_without_groups_still_takes_the_global_update(tmp_path):
    batch = _ddp_batch()
    torch.save(batch, tmp_path / "batch.pt")
    want = _update(trainer._Run(DDP), batch)
    assert want["metrics"]["optimizer_steps"] == 1
    run_ranks(_ddp_worker, 2, tmp_path, join_timeout_s=180)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        assert got["metrics"]["optimizer_steps"] == 1
        for key in ("grads", "params"):
            for param, value in want[key].items():
                torch.testing.assert_close(got[key][param], value, rtol=DDP_TOL, atol=DDP_TOL)
        assert got["metrics"]["loss"] == pytest.approx(want["metrics"]["loss"], rel=DDP_TOL,
                                                       abs=DDP_TOL)
    shutil.rmtree(tmp_path, ignore_errors=True)
