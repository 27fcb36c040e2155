"""Issue 28, training with trees (``tokenmdp train --rollout-tree``): the packed training pass
(each node once) gives the expanded paths' loss and gradient, so packed and expanded runs log
the same losses; R3 replays the engine's per-node routing in the ``old_logprob`` pass; a tree
step logs its generated and shared tokens; any estimator trains on trees (the tree entries
need them); bad settings are refused naming the field, in one line on the command line."""

from __future__ import annotations

import json
import math

import pytest
import torch

from tests.model.models import TINY, make_model
from tokenmdp import estimators as E
from tokenmdp.packing import pack_first_fit_decreasing
from tokenmdp.rl.config import TrainConfig, check_config
from tokenmdp.rl.mismatch import OLD_ROUTING, RoutingReplay, replay_routing
from tokenmdp.rl.rollout import RolloutEngine
from tokenmdp.rl.trainer import train
from tokenmdp.rl.tree_step import tree_logprob_passes
from tokenmdp.rl.update import TrainingPass, minibatch_loss

from ._cli import TINY_ARGS, one_line_error, run_cli

#: float64 passes of the same tokens in two layouts (summation order only)
F64 = 1e-10
SMALL = dict(d_model=16, n_layers=1, n_heads=2, n_experts=4, top_k=2, expert_hidden=16,
             prompts_per_step=4, max_new_tokens=6, eval_size=4, eval_every=0, task="count",
             dtype="float64", checkpoint_every=0)


def _tree_batch(replay, *, seed=0):
    """A prepared step of tree_grpo on random rewards, old log-probs from the packed pass."""
    model = make_model(TINY, dtype=torch.float64)
    engine = RolloutEngine(model)
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, TINY.vocab_size - 1, (3,), generator=gen).tolist()
               for _ in range(3)]
    out = engine.generate_tree(prompts, "fixed:1x2,3x2", max_new_tokens=6,
                               eos_id=TINY.vocab_size - 1, generator=gen, dtype=torch.float64)
    reward = torch.rand(out.batch.num_sequences, generator=gen, dtype=torch.float64)
    batch = pack_first_fit_decreasing(out.batch.replace(reward=reward), 16)
    batch, _ = tree_logprob_passes(model, model, batch, replay, forward="packed")
    est = E.get("tree_grpo")
    return model, E.prepare(batch, est, max_len=6), est


@pytest.mark.parametrize("replay", ["none", "r2", "r3"])
def test_the_packed_pass_gives_the_expanded_loss_and_gradient(replay):
    model, batch, est = _tree_batch(replay)
    grads = {}
    for forward in ("packed", "expanded"):
        model.zero_grad(set_to_none=True)
        loss, _ = minibatch_loss(TrainingPass(model, tree_forward=forward), batch, est, replay)
        loss.backward()
        grads[forward] = (float(loss.detach()), torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert grads["packed"][0] == pytest.approx(grads["expanded"][0], abs=F64)
    assert torch.allclose(grads["packed"][1], grads["expanded"][1], atol=F64)
    assert grads["packed"][1].abs().max() > 1e-6      # the step did push


def test_the_old_logprob_pass_is_one_value_per_node_and_r3_replays_the_engine():
    model, batch, _ = _tree_batch("r3")
    expanded, _ = tree_logprob_passes(model, model, batch, "r3", forward="expanded")
    assert torch.allclose(batch.old_logprob, expanded.old_logprob, atol=F64)
    engine = replay_routing(batch, RoutingReplay.R3)
    routed = (engine >= 0) & (batch.sequence_id >= 0)[..., None, None]   # padding: 0 or -1
    assert torch.equal(batch.token_extras[OLD_ROUTING][routed], engine[routed])
    with pytest.raises(ValueError, match="forward"):
        tree_logprob_passes(model, model, batch, "r3", forward="flat")


def _run(tmp_path, name, **changes):
    cfg = TrainConfig(**{**SMALL, "out_dir": str(tmp_path / name), **changes})
    return train(cfg)


@pytest.mark.parametrize("estimator", ["grpo", "tree_grpo", "tree_value_diff"])
def test_packed_and_expanded_runs_log_the_same_losses(tmp_path, estimator):
    if estimator not in E.names(trees=None):
        pytest.skip(f"{estimator} is not registered")
    common = dict(steps=3, estimator=estimator, rollout_tree="fixed:1x2,3x2", group_size=4,
                  replay="r3", minibatches=2)
    packed = _run(tmp_path, "packed", tree_forward="packed", **common)
    expanded = _run(tmp_path, "expanded", tree_forward="expanded", **common)
    for a, b in zip(packed, expanded):
        for key in ("loss", "reward", "grad_norm", "generated_tokens", "shared_tokens"):
            assert a[key] == pytest.approx(b[key], rel=1e-8, abs=1e-10), key
    assert any(abs(r["loss"]) > 0 for r in packed)


def test_a_tree_step_logs_generated_and_shared_tokens(tmp_path):
    rows = _run(tmp_path, "run", steps=2, estimator="dapo", rollout_tree="entropy:1x3",
                group_size=4, zero_variance_groups="skip")
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    for row, line in zip(rows, lines):
        assert line["generated_tokens"] == row["generated_tokens"] > 0
        assert row["shared_tokens"] > 0
        assert 1 <= row["leaves_per_tree"] <= 4
        assert row["generated_tokens_per_s"] > 0 and math.isfinite(row["tokens_per_s"])
        # the logged tokens are the expanded batch's: the generated plus shared responses
        assert row["tokens"] > row["generated_tokens"]


def test_r3_on_trees_replays_the_engines_routing(tmp_path):
    """An fp4 engine routes some tokens otherwise than the trainer (seen here at the second
    step); R3's old_logprob pass replays the engine's per-node routing, so none differ."""
    common = dict(steps=2, estimator="grpo", rollout_tree="fixed:2x2", group_size=2,
                  rollout_precision="fp4", dtype="float32")
    none = _run(tmp_path, "none", replay="none", **common)
    r3 = _run(tmp_path, "r3", replay="r3", **common)
    assert max(r["routing_mismatch"] for r in none) > 0
    assert all(r["routing_mismatch"] == 0.0 for r in r3)


@pytest.mark.parametrize(("changes", "field"), [
    (dict(rollout_tree="fixed:2x2"), "rollout_tree"),                  # 2 leaves, G = 4
    (dict(rollout_tree="fixed:6x2,7x2"), "rollout_tree"),              # deeper than the response
    (dict(rollout_tree="fixed:2x0"), "rollout_tree"),
    (dict(rollout_tree="fixed:3x2,1x2"), "rollout_tree"),
    (dict(rollout_tree="tree"), "rollout_tree"),
    (dict(rollout_tree="fixed:0x2,2x2", tree_forward="flat"), "tree_forward"),
    (dict(rollout_tree="fixed:0x2,2x2", mode="sft"), "rollout_tree"),
    (dict(estimator="tree_grpo"), "estimator"),                        # needs a tree
])
def test_check_config_names_the_bad_tree_field(changes, field):
    cfg = TrainConfig(**{**SMALL, "group_size": 4, **changes})
    with pytest.raises(ValueError, match=f"^{field}"):
        check_config(cfg)


def test_the_cli_trains_with_a_tree_and_refuses_a_bad_spec_in_one_line(tmp_path):
    args = [a for a in TINY_ARGS]
    args[args.index("--group-size") + 1] = "4"
    ok = run_cli("train", *args, "--steps", "1", "--rollout-tree", "fixed:1x2,2x2",
                 "--estimator", "tree_grpo", "--tree-forward", "packed", "--out-dir",
                 tmp_path / "ok")
    assert ok.returncode == 0, ok.stderr
    row = json.loads((tmp_path / "ok" / "metrics.jsonl").read_text().splitlines()[0])
    assert row["generated_tokens"] > 0 and "shared_tokens" in row
    for spec in ("fixed:4x2,5x2", "bushy:2x2", "fixed:1x2"):
        line = one_line_error(run_cli("train", *args, "--steps", "1", "--rollout-tree", spec,
                                      "--out-dir", tmp_path / spec.replace(":", "_")))
        assert "rollout_tree" in line, line


def test_torchrun_trains_on_trees(tmp_path):
    """Two gloo ranks, each its share of the prompts' trees, the packed pass under DDP."""
    from tests.rl.test_trainer_ddp import _torchrun

    done = _torchrun(tmp_path, "--steps", "2", "--rollout-tree", "fixed:0x2,2x2",
                     "--estimator", "tree_grpo")
    assert done.returncode == 0, done.stderr[-4000:]
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [0, 1]
    assert all(r["generated_tokens"] > 0 and 2 <= r["leaves_per_tree"] <= 4 for r in rows)
    assert all(math.isfinite(r["loss"]) for r in rows)
