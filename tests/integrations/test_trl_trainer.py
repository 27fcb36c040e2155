"""The TRL hook on the real package: a tiny Llama built from a config (nothing downloaded) and a
word-level tokenizer built in memory. At step 0 the hooked loss and gradient equal TRL's own on
the same inputs for each mapped loss type; registry estimators TRL has no loss type for train."""

from __future__ import annotations

import warnings

import pytest

pytest.importorskip("trl", reason="the trl extra is not installed (pip install 'tokenmdp[trl]')")

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from tokenmdp import estimators  # noqa: E402
from tokenmdp.integrations.trl_trainer import TokenMDPGRPOTrainer, batch_from_trl  # noqa: E402

WORDS = ["<pad>", "<eos>", "<unk>"] + [f"w{i}" for i in range(13)]
PROMPTS = ["w1 w2", "w3 w4 w5", "w6", "w7 w8"]


def tokenizer():
    vocab = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    vocab.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=vocab, pad_token="<pad>", eos_token="<eos>",
                                   unk_token="<unk>")


def tiny_model(seed: int = 0):
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=len(WORDS), hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
        pad_token_id=0, bos_token_id=1, eos_token_id=1))


def reward(completions, **_):
    return [float(c.count("w3")) - 0.1 * len(c.split()) for c in completions]


def trainer(tmp_path, estimator=None, *, model=None, **settings):
    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=6, learning_rate=1e-2, report_to="none",
                      save_strategy="no", use_cpu=True, seed=0, logging_steps=1, **settings)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return TokenMDPGRPOTrainer(model=model or tiny_model(), reward_funcs=reward, args=args,
                                   train_dataset=Dataset.from_dict({"prompt": PROMPTS * 2}),
                                   processing_class=tokenizer(), estimator=estimator)


def loss_and_grads(compute, model, inputs):
    model.zero_grad()
    value = compute(model, inputs)
    value.backward()
    return value.detach(), [p.grad.clone() for p in model.parameters()]


def vary_inputs(inputs, logps):
    """Both losses see the same changes: a stale ``π_old`` (ratios leave the clip band both
    ways), a reference away from ``π_θ``, completions of different lengths, a tool's token."""
    gen = torch.Generator().manual_seed(2)
    inputs["old_per_token_logps"] = logps + 0.3 * torch.randn(logps.shape, generator=gen)
    if "ref_per_token_logps" in inputs:
        inputs["ref_per_token_logps"] = logps + 0.3 * torch.randn(logps.shape, generator=gen)
    rows, width = logps.shape
    keep = torch.arange(width) < width - torch.arange(rows)[:, None] % 4
    inputs["completion_mask"] = inputs["completion_mask"] * keep
    tool = torch.ones_like(inputs["completion_mask"])
    tool[0, 1] = 0
    inputs["tool_mask"] = tool


CASES = [{"loss_type": "grpo"}, {"loss_type": "dapo"}, {"loss_type": "dapo", "epsilon_high": 0.28},
         {"loss_type": "dr_grpo", "scale_rewards": "none"},
         {"loss_type": "grpo", "beta": 0.04, "use_bias_correction_kl": False},
         {"loss_type": "grpo", "gradient_accumulation_steps": 2},    # two micro-batches a step
         {"loss_type": "dapo", "gradient_accumulation_steps": 2}]


@pytest.mark.parametrize("settings", CASES, ids=lambda s: "-".join(map(str, s.values())))
def test_step_zero_equals_trl(tmp_path, settings):
    model = None
    if settings.get("beta"):   # TRL loads its reference model by name: a local directory
        model = str(tmp_path / "tiny")
        tiny_model().save_pretrained(model)
    hooked = trainer(tmp_path, model=model, **settings)   # estimator: estimator_from_trl(args)
    hooked.model.train()
    hooked.current_gradient_accumulation_steps = hooked.args.gradient_accumulation_steps
    torch.manual_seed(1)
    inputs = hooked._prepare_inputs(next(iter(hooked.get_train_dataloader())))
    assert inputs["advantages"].abs().max() > 0
    with torch.no_grad():
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
        mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
        logps, _, _ = hooked._get_per_token_logps_and_entropies(
            hooked.model, ids, mask, inputs["completion_ids"].size(1))
    vary_inputs(inputs, logps)
    ours, our_grads = loss_and_grads(hooked._compute_loss, hooked.model, inputs)
    theirs, their_grads = loss_and_grads(lambda m, x: GRPOTrainer._compute_loss(hooked, m, x),
                                         hooked.model, inputs)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-7)
    for a, b in zip(our_grads, their_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert any(g.abs().max() > 0 for g in their_grads)


def test_batch_maps_columns(tmp_path):
    ids = torch.tensor([[5, 6, 1, 0], [7, 1, 0, 0], [4, 4, 4, 4]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]])   # row 2: masked truncation
    logps = -torch.rand(3, 4)
    batch = batch_from_trl({"completion_ids": ids, "completion_mask": mask}, logps)
    assert batch.loss_mask.tolist() == mask.bool().tolist()
    assert batch.length.tolist() == [3, 2, 1]
    assert torch.equal(batch.old_logprob[batch.loss_mask], logps[mask.bool()])


@pytest.mark.parametrize("name", ["minirl", "cispo", "sapo"])
def test_registry_estimator_trains(tmp_path, name):
    hooked = trainer(tmp_path, name, max_steps=2)
    before = [p.detach().clone() for p in hooked.model.parameters()]
    hooked.train()
    losses = [log["loss"] for log in hooked.state.log_history if "loss" in log]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    assert any(not torch.equal(a, p) for a, p in zip(before, hooked.model.parameters()))
    assert any(key.startswith("tokenmdp/") for key in hooked.state.log_history[0])


def test_refuses_what_trl_cannot_feed(tmp_path):
    with pytest.raises(ValueError, match="token-level"):
        trainer(tmp_path, "reinforce_pp_kl")
    with pytest.raises(ValueError, match="prompt-mean"):
        trainer(tmp_path, estimators.get("grpo").replace(
            aggregation=estimators.Aggregation.PROMPT_MEAN_TOKEN_MEAN))
    with pytest.raises(ValueError, match="entropy_coef"):
        trainer(tmp_path, "grpo", entropy_coef=0.01)
