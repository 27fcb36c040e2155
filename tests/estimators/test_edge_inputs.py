"""Issue 16, the losses and batches at their edges: empty batches, half precision, misuse
(registry names, string levels) and malformed per-sequence inputs."""

import pytest
import torch

from tokenmdp import estimators
from tokenmdp.batch import TokenBatch
from tokenmdp.estimators import ImportanceSampling, Level, group_normalized_advantage
from tokenmdp.interop.padded import from_hf
from tokenmdp.model import ModelConfig, MoETransformer
from tokenmdp.packing import select_sequences

MAX_LEN = 4


def _batch(dtype=torch.float64, n=2):
    b = TokenBatch.from_sequences([[1, 2]] * n, [[3, 4]] * n, rewards=[1.0, 0.0][:n],
                                  groups=[0] * n, dtype=dtype)
    zeros = torch.zeros_like(b.advantage)
    return b.replace(old_logprob=zeros - 0.1, behavior_logprob=zeros - 0.2,
                     ref_logprob=zeros - 0.3)


def _empty(dtype=torch.float64):
    return select_sequences(_batch(dtype), torch.tensor([], dtype=torch.long))


def _all_masked(dtype=torch.float64):
    b = _batch(dtype)
    return b.replace(loss_mask=torch.zeros_like(b.loss_mask))


@pytest.mark.parametrize("name", estimators.names())
def test_empty_batch_is_loss_zero_with_neutral_metrics(name):
    est = estimators.get(name)
    results = []
    for batch in (_empty(), _all_masked()):  # the empty batch must behave like the masked one
        lp = torch.zeros_like(batch.advantage, requires_grad=True)
        prepared = estimators.prepare(batch, est, max_len=MAX_LEN)
        loss, metrics = estimators.loss(lp, prepared, est)
        loss.backward()
        assert float(loss.detach()) == 0.0 and torch.equal(lp.grad, torch.zeros_like(lp))
        results.append({k: float(v) for k, v in metrics.items()})
    empty, masked = results
    assert empty == masked
    assert empty["r_min"] == empty["r_max"] == empty["rho_mean"] == 1.0


@pytest.mark.parametrize("dense", [False, True])
def test_model_log_probs_of_an_empty_batch(dense):
    cfg = ModelConfig(vocab_size=8, d_model=16, n_heads=2, n_layers=1, n_experts=4, top_k=2,
                      expert_hidden=16, dense=dense)
    model = MoETransformer(cfg, generator=torch.Generator().manual_seed(0))
    empty = _empty(torch.float32)
    out = model.token_outputs(empty)
    assert out.logprob_RC.shape == empty.tokens.shape == (0, 4)
    assert model.token_logprobs(empty).shape == (0, 4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", ["grpo", "sequence_is", "cispo"])
def test_half_precision_batches_refused(name, dtype):
    batch = _batch(dtype)
    with pytest.raises(TypeError, match="float32 or float64"):
        estimators.prepare(batch, name, max_len=MAX_LEN)
    with pytest.raises(TypeError, match="float32 or float64"):
        estimators.loss(torch.zeros_like(batch.advantage), batch, name)


def test_registry_name_in_place_of_an_estimator():
    batch = _batch()
    lp = torch.full_like(batch.advantage, -0.5)
    by_name = estimators.loss(lp, estimators.prepare(batch, "grpo", max_len=MAX_LEN), "grpo")
    est = estimators.get("grpo")
    by_object = estimators.loss(lp, estimators.prepare(batch, est, max_len=MAX_LEN), est)
    assert torch.equal(by_name[0], by_object[0])
    with pytest.raises(ValueError, match="grpoo"):
        estimators.loss(lp, batch, "grpoo")
    with pytest.raises(TypeError, match="estimator: expected an Estimator or a registry name"):
        estimators.loss(lp, batch, 3)


def test_correction_level_by_name():
    assert ImportanceSampling(level="sequence").level is Level.SEQUENCE
    with pytest.raises(ValueError, match="level: expected one of token, sequence, geometric"):
        ImportanceSampling(level="seq")
    with pytest.raises(TypeError, match="level"):
        ImportanceSampling(level=2)


def test_per_sequence_inputs_name_the_argument():
    with pytest.raises(ValueError, match="rewards: expected 2 values"):
        TokenBatch.from_sequences([[1], [2]], [[3], [4]], rewards=[1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="groups: expected 2 values"):
        TokenBatch.from_sequences([[1], [2]], [[3], [4]], groups=[0])
    with pytest.raises(ValueError, match="token ids must be integers"):
        TokenBatch.from_sequences([[1.5]], [[3]])
    ok = TokenBatch.from_sequences([[1.0]], [[3]])  # an integral float is an id
    assert ok.tokens[0, 0] == 1


def test_from_hf_integer_rewards_are_rewards():
    batch = from_hf(torch.tensor([[1, 2, 3]]), reward=torch.tensor([2]))
    assert batch.reward.dtype == torch.float64 and float(batch.reward[0]) == 2.0
    assert batch.advantage.dtype == torch.float64


def test_functional_advantages_reject_nan_rewards():
    with pytest.raises(ValueError, match="reward_S: reward 1 is nan"):
        group_normalized_advantage(torch.tensor([1.0, float("nan")], dtype=torch.float64),
                                   torch.tensor([0, 0]), ddof=0, eps=1e-6)
