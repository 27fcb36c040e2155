"""Issue 28, the rollout engine forks (``RolloutEngine.generate_tree``): a shared prefix is fed
once and its KV cache replicated per branch (positions computed counted at the model), each
node's recorded ``log mu`` and routing are those of a full forward pass over its leaves' paths
(and one value on every leaf through it), a single chain is ``generate`` bit for bit, the
leaves of fixed forks are samples of ``mu`` (chi-square), entropy forks fork at the
highest-entropy states, and bad schedules are refused naming the argument."""

from __future__ import annotations

import pytest
import torch
from scipy import stats

from tests.model.models import make_model
from tokenmdp.exact import EngineMismatch
from tokenmdp.model import ModelConfig
from tokenmdp.rl import ENGINE_ROUTING, RolloutEngine
from tokenmdp.rl.tree_rollout import generate_tree
from tokenmdp.tree_schedules import EntropyForks, FixedForks, parse_tree_spec
from tokenmdp.trees import TREE_NODE, tree_structure

CFG = ModelConfig(vocab_size=8, d_model=32, n_heads=2, n_experts=4, top_k=2, expert_hidden=32,
                  init_std=0.2)
EOS = CFG.vocab_size - 1
#: fp32, the same prefix through another forward pass (cache vs none, other batch shape)
ROUNDING_ATOL = 1e-5
P_THRESHOLD = 1e-3
SCHEDULES = ["fixed:0x2,3x2", "fixed:2x3", "entropy:1x2,2x1", "entropy:3x1"]


def _engine(**kwargs):
    return RolloutEngine(make_model(CFG), **kwargs)


def _prompts(n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, EOS, (2 + i % 3,), generator=gen).tolist() for i in range(n)]


def _chi_square_p(counts, probs):
    """Pearson's chi-square p-value of ``counts`` against ``probs`` (renormalized)."""
    expected = probs / probs.sum() * counts.sum()
    keep = expected > 0
    return stats.chisquare(counts[keep].numpy(), expected[keep].numpy()).pvalue


def _tree(engine, prompts, schedule, *, seed=1, max_new_tokens=8, **kwargs):
    return engine.generate_tree(prompts, schedule, max_new_tokens=max_new_tokens, eos_id=EOS,
                                generator=torch.Generator().manual_seed(seed), **kwargs)


class _Counting:
    """Wraps ``forward_tokens`` to count the real token positions the model computes."""

    def __init__(self, model):
        self.model, self.inner, self.positions = model, model.forward_tokens, 0

    def __call__(self, tokens, position, mask, valid, **kwargs):
        self.positions += int(valid.sum())
        return self.inner(tokens, position, mask, valid, **kwargs)


@pytest.mark.parametrize("spec", SCHEDULES)
def test_a_shared_prefix_is_computed_once(spec):
    engine = _engine()
    counter = _Counting(engine.model)
    engine.model.forward_tokens = counter
    prompts = _prompts(5)
    out = _tree(engine, prompts, spec)
    # each prompt once, each node once except the leaves (a branch's last token is never fed)
    want = sum(len(p) + len(t.tokens) - len(t.leaves) for p, t in zip(prompts, out.trees))
    assert counter.positions == out.stats["forward_positions"] == want
    independent = sum(len(p) + t.depth[v] - 1 for p, t in zip(prompts, out.trees) for v in t.leaves)
    assert out.stats["shared_tokens"] > 0 and want < independent
    assert out.stats["generated_tokens"] == sum(len(t.tokens) for t in out.trees)
    assert out.stats["shared_tokens"] == out.stats["expanded_tokens"] - \
        out.stats["generated_tokens"]
    assert out.batch.num_sequences == out.stats["leaves"] == sum(len(t.leaves) for t in out.trees)


@pytest.mark.parametrize("mismatch", [None, EngineMismatch("fixed", 0.8, seed=5)])
@pytest.mark.parametrize("spec", SCHEDULES)
def test_recorded_mu_and_routing_are_those_of_a_full_pass_over_the_leaves(spec, mismatch):
    engine = _engine(mismatch=mismatch)
    out = _tree(engine, _prompts(6), spec, dtype=torch.float64)
    batch = out.batch
    lp_RCV = engine.next_token_logprobs(batch)              # no cache, every path whole
    want = lp_RCV.gather(-1, batch.tokens[..., None])[..., 0]
    mask = batch.response_mask
    assert torch.allclose(batch.behavior_logprob[mask].float(), want[mask], atol=ROUNDING_ATOL)
    # one value per node on every leaf through it: log mu, the routing, the token
    node = tree_structure(batch).node_RC
    real = batch.sequence_id >= 0
    for field in (batch.behavior_logprob, batch.token_extras[ENGINE_ROUTING].flatten(2)):
        values = field[real].reshape(int(real.sum()), -1).double()
        first = torch.zeros(int(node.max()) + 1, values.shape[1], dtype=torch.float64)
        first[node[real]] = values
        assert torch.equal(first[node[real]], values)
    # the routing of every fed token is the full pass's; the last token of a path is unrouted
    full = engine.model(batch.to(engine.device), aux=False).experts_RCLK
    routing = batch.token_extras[ENGINE_ROUTING]
    routed = routing[..., 0, 0] >= 0
    last = real & ~torch.cat([real[:, 1:], torch.zeros_like(real[:, :1])], dim=1)
    assert torch.equal(routed, real & ~last)
    agree = (routing == full).all(-1).all(-1)[routed].double().mean()
    assert agree > 0.99      # (a near-tie between experts may flip under other kernels)


def test_a_single_chain_is_generate_bit_for_bit():
    engine = _engine(mismatch=EngineMismatch("fixed", 0.8, seed=5))
    prompt = _prompts(1)
    chain = engine.generate(prompt, max_new_tokens=8, eos_id=EOS,
                            generator=torch.Generator().manual_seed(3))
    out = _tree(engine, prompt, "fixed:0x1", seed=3)
    assert out.trees[0].parent == tuple(range(-1, len(out.trees[0].tokens) - 1))
    for name in ("tokens", "loss_mask", "position"):
        assert torch.equal(getattr(out.batch, name), getattr(chain, name)), name
    assert torch.equal(out.batch.behavior_logprob.float(), chain.behavior_logprob)
    assert torch.equal(out.batch.token_extras[ENGINE_ROUTING], chain.token_extras[ENGINE_ROUTING])


def test_fixed_forks_shape_the_tree():
    out = _tree(_engine(), _prompts(20), FixedForks(depths=(1, 3), branching=(2, 3)))
    for t in out.trees:
        children = {}
        for v, u in enumerate(t.parent):
            children.setdefault(u, []).append(v)
        for u, kids in children.items():
            d = 0 if u == -1 else t.depth[u]
            assert len(kids) == {1: 2, 3: 3}.get(d, 1), (u, d, kids)
        for leaf in t.leaves:   # a branch ends at EOS or at max_new_tokens, nowhere else
            assert t.tokens[leaf] == EOS or t.depth[leaf] == 8
        ended_early = any(t.depth[v] <= 3 for v in t.leaves)
        assert len(t.leaves) == 6 or ended_early


def test_leaves_of_fixed_forks_are_samples_of_mu():
    """Trees forked after one token into three: the first token follows ``mu(. | prompt)`` (one
    count per tree) and, given it, the three second tokens are i.i.d. ``mu(. | prompt, y1)``."""
    engine = _engine()
    prompt, n = [1, 2, 3], 3000
    out = _tree(engine, [prompt] * n, "fixed:1x3", max_new_tokens=2)
    first = torch.tensor([t.tokens[0] for t in out.trees])
    probe = engine.next_token_logprobs(
        _tree(engine, [prompt], "fixed:1x1", max_new_tokens=2).batch)
    mu1 = probe[0, len(prompt)].double().exp()
    counts = torch.bincount(first, minlength=CFG.vocab_size).double()
    assert _chi_square_p(counts, mu1) > P_THRESHOLD
    y1 = int(counts[:EOS].argmax())                         # the most common non-EOS first token
    second = [t.tokens[v] for t in out.trees if t.tokens[0] == y1 for v in t.leaves]
    ctx = engine.generate_tree([prompt + [y1]], "fixed:0x1", max_new_tokens=1, eos_id=EOS,
                               generator=torch.Generator().manual_seed(0))
    mu2 = engine.next_token_logprobs(ctx.batch)[0, len(prompt) + 1].double().exp()
    c2 = torch.bincount(torch.tensor(second), minlength=CFG.vocab_size).double()
    assert _chi_square_p(c2, mu2) > P_THRESHOLD


def test_entropy_forks_fork_at_the_highest_entropy_states():
    out = _tree(_engine(), _prompts(10), EntropyForks(forks=(1,), branching=(3,)))
    for t, ent in zip(out.trees, out.entropy):
        # round 0 is one chain: nodes 0..m-1, each the child of the one before
        m = next((v for v in range(1, len(t.tokens)) if t.parent[v] != v - 1), len(t.tokens))
        chain = list(range(m))
        # the chain's states: the prompt (-1) and its fed nodes; a state's entropy is that of its
        # first child's distribution
        states = {-1: ent[0], **{v: ent[v + 1] for v in chain[:-1]}}
        new = [v for v in range(len(chain), len(t.tokens)) if t.parent[v] not in
               range(len(chain), len(t.tokens))]
        assert len(new) == 3 and len({t.parent[v] for v in new}) == 1
        forked = t.parent[new[0]]
        assert states[forked] == max(states.values())
        assert len(t.leaves) == 4


def test_the_expanded_batch_carries_node_ids_and_groups():
    out = _tree(_engine(), _prompts(3), "fixed:0x2,2x2", groups=[5, 6, 7])
    batch = out.batch
    assert TREE_NODE in batch.token_extras
    structure = tree_structure(batch)
    assert structure.num_nodes == sum(len(p) + len(t.tokens)
                                      for p, t in zip(_prompts(3), out.trees))
    assert sorted(set(batch.group.tolist())) == [5, 6, 7]
    assert [r for _, r in batch.sequences()] == [r for t in out.trees for r in t.responses()]


@pytest.mark.parametrize(("schedule", "max_new", "name"), [
    ("fixed:8x2", 8, "depths"), ("fixed:4x2,2x2", 8, "depths"), ("fixed:4x0", 8, "branching"),
    ("entropy:0x2", 8, "forks"), ("entropy:2x0", 8, "branching"), ("fixed:4", 8, "schedule"),
    ("none", 8, "schedule"), ("bushy:2x2", 8, "schedule")])
def test_bad_schedules_are_refused_naming_the_argument(schedule, max_new, name):
    with pytest.raises(ValueError, match=name):
        _tree(_engine(), _prompts(1), schedule, max_new_tokens=max_new)


def test_schedule_objects_validate_their_fields():
    with pytest.raises(ValueError, match="^branching"):
        FixedForks(depths=(1, 2), branching=(2,))
    with pytest.raises(ValueError, match="^depths"):
        FixedForks(depths=(-1,), branching=(2,))
    with pytest.raises(TypeError, match="depths"):
        FixedForks(depths=(1.5,), branching=(2,))
    assert parse_tree_spec("fixed:4x2,8x2") == FixedForks(depths=(4, 8), branching=(2, 2))
    assert parse_tree_spec("fixed:4x2,8x2").leaves == 4
    assert parse_tree_spec("entropy:1x3").leaves == 4
    assert parse_tree_spec("none") is None
    with pytest.raises(ValueError, match="^rollout_tree: .*fixed:DxB"):
        parse_tree_spec("fixed")
    with pytest.raises(TypeError, match="schedule"):
        generate_tree(_engine(), _prompts(1), 3, max_new_tokens=4, eos_id=EOS,
                      generator=torch.Generator())
