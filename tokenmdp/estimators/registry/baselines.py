"""Registry entries: the newer advantages (REINFORCE++-baseline, TRL's batch-std GRPO, OPO, a
per-token KL-in-reward REINFORCE++) and the covariance-selected surrogates (Clip-Cov, KL-Cov),
registered like the classic ones and looked up through :mod:`~tokenmdp.estimators.registry.lookup`.
"""

from __future__ import annotations

from tokenmdp.estimators.advantages.baselines import GroupMeanBatchStd, OPOBaseline, ReinforcePPBaseline
from tokenmdp.estimators.advantages.group import GroupNormalized
from tokenmdp.estimators.advantages.token import RewardToGo
from tokenmdp.estimators.aggregation import Aggregation
from tokenmdp.estimators.estimator import Estimator
from tokenmdp.estimators.kl import KLPenalty, kl_k1

# the classic and zoo entries first: the registry lists entries in registration order
from tokenmdp.estimators.registry import zoo  # noqa: F401  (its entries are registered first)
from tokenmdp.estimators.registry.entry import _register
from tokenmdp.estimators.surrogates.clipped import PPOClip
from tokenmdp.estimators.surrogates.covariance import ClipCov, KLCov
from tokenmdp.estimators.surrogates.token import Reinforce


@_register("reinforce_pp_baseline",
           formula="-1/N Σ_t max(min(r_t Â_i, clip(r_t, 0.8, 1.2) Â_i), 3 Â_i if Â_i < 0), "
                   "Â_i = (d_i - m)/sqrt(v + 1e-8), d_i = R_i - mean_g R, m, v the token-weighted "
                   "mean and (Bessel) variance of d over the step's loss tokens",
           paper="Hu et al. (REINFORCE++), arXiv 2501.03262",
           aliases="verl adv_estimator=reinforce_plus_plus_baseline with its vanilla policy loss "
                   "(clip_ratio 0.2; the dual clip clip_ratio_c = 3 is always on; "
                   "loss_agg_mode token-mean; use_kl_loss False; a one-response group keeps its "
                   "reward there, its deviation is 0 here); OpenRLHF "
                   "advantage_estimator=reinforce_baseline differs: no dual clip, the population "
                   "variance floored at 1e-8, and a per-token k1 KL reward (init_kl_coef 0.01) "
                   "unless use_kl_loss, under which it adds init_kl_coef × the token mean of k "
                   "to the loss instead (see reinforce_pp_kl)")
def reinforce_pp_baseline() -> Estimator:
    """REINFORCE++-baseline as verl runs it: group mean subtracted, then whitened over every
    loss token of the step (token-weighted, Bessel-corrected, ``+1e-8`` in the square root);
    PPO clip 0.2 with verl's dual clip at 3, token mean, no KL."""
    return Estimator(name="reinforce_pp_baseline",
                     surrogate=PPOClip(eps_low=0.2, eps_high=0.2, dual_clip=3.0),
                     advantage=ReinforcePPBaseline(ddof=1, eps=1e-8),
                     aggregation=Aggregation.TOKEN_MEAN)


@_register("reinforce_pp_kl",
           formula="-1/N Σ_t min(r_t Â_t, clip(r_t, 0.8, 1.2) Â_t), Â_t = whiten_tokens((R_i - "
                   "mean_g R) - β Σ_{s>=t} k1_s), k1_s = log π_old(y_s) - log π_ref(y_s), β = 0.01",
           paper="Hu et al. (REINFORCE++), arXiv 2501.03262, token-level KL penalty",
           aliases="OpenRLHF advantage_estimator=reinforce_baseline without use_kl_loss "
                   "(init_kl_coef 0.01, kl_estimator k1, eps_clip 0.2, gamma 1, advantages "
                   "whitened over the batch's tokens with the population variance, floored at "
                   "1e-8 where here 1e-8 is added); verl adv_estimator=reinforce_plus_plus "
                   "with use_kl_in_reward is the same return without the group baseline and "
                   "with a Bessel-corrected variance")
def reinforce_pp_kl() -> Estimator:
    """REINFORCE++ with the KL in the reward of every token: token t's advantage is the group-
    centred outcome minus ``β`` times the k1 KL of t and what follows it (reward-to-go), whitened
    over the step's tokens; PPO clip 0.2, token mean, β = 0.01 (needs ``old_logprob`` and
    ``ref_logprob``)."""
    return Estimator(name="reinforce_pp_kl", surrogate=PPOClip(eps_low=0.2, eps_high=0.2),
                     advantage=RewardToGo(baseline="group_mean", whiten=True, ddof=0, eps=1e-8),
                     kl=KLPenalty(coef=0.01, in_reward=True, estimator=kl_k1),
                     aggregation=Aggregation.TOKEN_MEAN)


@_register("grpo_batch_std",
           formula="-1/N Σ_t min(r_t Â_i, clip(r_t, 0.8, 1.2) Â_i), Â_i = (R_i - mean_g R) / "
                   "(std_step(R) + 1e-4), std over every sequence of the step (ddof 1)",
           paper="Shao et al. (GRPO), arXiv 2402.03300, with TRL's batch-level reward scaling",
           aliases="TRL GRPOTrainer scale_rewards='batch' (the default is 'group'; the std is "
                   "torch.std of the gathered batch's rewards, + 1e-4) with loss_type='dapo', "
                   "epsilon 0.2, beta 0.0")
def grpo_batch_std() -> Estimator:
    """GRPO with the group mean scaled by the std of the step's rewards (TRL's
    ``scale_rewards='batch'``), PPO clip 0.2, token mean over the step, no KL."""
    return Estimator(name="grpo_batch_std", surrogate=PPOClip(eps_low=0.2, eps_high=0.2),
                     advantage=GroupMeanBatchStd(ddof=1, eps=1e-4),
                     aggregation=Aggregation.TOKEN_MEAN)


@_register("opo",
           formula="-1/N Σ_t Â_i log π(y_t), Â_i = R_i - Σ_{j in g} |y_j| R_j / Σ_{j in g} |y_j|",
           paper="Hao et al. (OPO, 'On-Policy RL with Optimal Reward Baseline'), arXiv "
                 "2505.23585",
           aliases="verl adv_estimator=opo (a one-response group's baseline is 0 there, its "
                   "deviation 0 here); the paper trains strictly on-policy, where verl's clipped "
                   "loss has REINFORCE's gradient")
def opo() -> Estimator:
    """OPO: the length-weighted group mean as baseline, strictly on-policy (a REINFORCE
    surrogate), token mean, no KL."""
    return Estimator(name="opo", surrogate=Reinforce(), advantage=OPOBaseline(),
                     aggregation=Aggregation.TOKEN_MEAN)


@_register("clip_cov",
           formula="-1/N Σ_t s_t min(r_t Â, clip(r_t, 0.8, 1.2) Â), s_t = 0 on max(⌊2e-4 N⌋, 1) "
                   "tokens drawn among 1 < (Â_t - mean Â)(log π_old - mean log π_old) < 5",
           paper="Cui et al. ('The Entropy Mechanism of RL for Reasoning Language Models'), "
                 "arXiv 2505.22617, Clip-Cov",
           aliases="verl policy_loss.loss_mode=clip_cov (clip_cov_ratio 2e-4, clip_cov_lb 1.0, "
                   "clip_cov_ub 5.0, clip_ratio 0.2, no dual clip; its draw is torch.randperm "
                   "per micro-batch, unseeded, over the micro-batch's covariance at the current "
                   "log π, tokens PPO already clips left out)")
def clip_cov() -> Estimator:
    """Clip-Cov: PPO clip 0.2 with a seeded draw of the step's high-covariance tokens detached
    (ratio 2e-4, band (1, 5): the paper's and verl's defaults), group mean/std advantage, token
    mean, no KL."""
    return Estimator(name="clip_cov", surrogate=ClipCov(),
                     advantage=GroupNormalized(ddof=1, eps=1e-6),
                     aggregation=Aggregation.TOKEN_MEAN)


@_register("kl_cov",
           formula="-1/N Σ_t (r_t Â - β m_t |log π_θ - log π_old|), m_t = 1 on the max(⌊2e-4 N⌋, "
                   "1) tokens of largest (Â_t - mean Â)(log π_old - mean log π_old), β = 0.1",
           paper="Cui et al. ('The Entropy Mechanism of RL for Reasoning Language Models'), "
                 "arXiv 2505.22617, KL-Cov",
           aliases="verl policy_loss.loss_mode=kl_cov (kl_cov_ratio 2e-4, ppo_kl_coef 0.1 in "
                   "PolicyLossConfig, 1.0 when unset; no clip; topk per micro-batch at the "
                   "current log π)")
def kl_cov() -> Estimator:
    """KL-Cov: the unclipped ratio surrogate with ``β |log r|`` on the step's tokens of largest
    covariance (ratio 2e-4, β = 0.1: verl's defaults), group mean/std advantage, token mean."""
    return Estimator(name="kl_cov", surrogate=KLCov(ratio=2e-4, coef=0.1),
                     advantage=GroupNormalized(ddof=1, eps=1e-6),
                     aggregation=Aggregation.TOKEN_MEAN)
