"""SAPO, GMPO and the entropy bonus: hand-worked values and gradients, independent transcriptions
of the papers' formulas under autograd, on-policy gradient identities, layouts, bad arguments."""

from __future__ import annotations

import math

import pytest
import torch

from tests.estimators.estimator_helpers import DTYPE, make_batch, repack, response_values
from tokenmdp.estimators import (
    GMPO,
    SAPO,
    Aggregation,
    EntropyBonus,
    Estimator,
    PPOClip,
    Reinforce,
    entropy_bonus_term,
    gmpo_term,
    loss,
    prepare,
    sapo_term,
)

EXACT = 1e-12  # float64 closed forms of a few operations
GRAD = 1e-10  # float64 gradients

# Two sequences: prompt [7] response of 3 tokens, prompt [8] response of 1 token.
OLD = [[math.log(0.5), math.log(0.25), math.log(0.4)], [math.log(0.3)]]
LOG_R = [[0.3, -0.1, 0.5], [-0.5]]
ADV = [[1.0, 1.0, 1.0], [-1.0]]


def _fixture(packed: bool = False, log_r=LOG_R):
    batch = make_batch([[7], [8]], [[1, 2, 3], [4]], rewards=[1.0, 0.0], old=OLD)
    if packed:
        batch = repack(batch, [[0, 1]], capacity=6)
    lp = (batch.old_logprob + response_values(batch, log_r)).requires_grad_(True)
    return batch, lp, response_values(batch, ADV)


def _on_loss_tokens(batch, values_RC):
    """Values on the loss tokens in (sequence, position) order, layout-free."""
    keys = list(zip(batch.sequence_id[batch.loss_mask].tolist(),
                    batch.position[batch.loss_mask].tolist(), strict=True))
    vals = values_RC[batch.loss_mask].tolist()
    return [v for _, v in sorted(zip(keys, vals, strict=True))]


# ---------------------------------------------------------------------- SAPO
def test_sapo_value_and_gradient_by_hand():
    batch, lp, adv = _fixture()
    terms = sapo_term(lp, batch.old_logprob, adv, tau_pos=1.0, tau_neg=1.05)
    (grad,) = torch.autograd.grad(terms.term_RC[batch.loss_mask].sum(), lp)
    want_v, want_g = [], []
    for log_r, a in zip([*LOG_R[0], *LOG_R[1]], [1.0, 1.0, 1.0, -1.0], strict=True):
        r = math.exp(log_r)
        tau = 1.0 if a > 0 else 1.05
        s = 1 / (1 + math.exp(-tau * (r - 1)))
        want_v.append(4 / tau * s * a)
        want_g.append(4 * s * (1 - s) * r * a)
    assert _on_loss_tokens(batch, terms.term_RC.detach()) == pytest.approx(want_v, abs=EXACT)
    assert _on_loss_tokens(batch, grad) == pytest.approx(want_g, abs=EXACT)
    assert terms.clipped_RC is None


def test_sapo_matches_the_papers_gate_under_autograd():
    # Independent transcription of arXiv 2511.20347 Eq. 4-5, f(r) = σ(τ(r-1)) · 4/τ,
    # differentiated by autograd through exp and sigmoid.
    batch, lp, adv = _fixture()
    tau = torch.where(adv > 0, adv.new_tensor(1.0), adv.new_tensor(1.05))
    ref = (torch.sigmoid(tau * ((lp - batch.old_logprob).exp() - 1)) * 4 / tau * adv)
    (g_ref,) = torch.autograd.grad(ref[batch.loss_mask].sum(), lp)
    terms = sapo_term(lp, batch.old_logprob, adv, tau_pos=1.0, tau_neg=1.05)
    (g,) = torch.autograd.grad(terms.term_RC[batch.loss_mask].sum(), lp)
    torch.testing.assert_close(terms.term_RC[batch.loss_mask], ref[batch.loss_mask].detach(),
                               atol=EXACT, rtol=0)
    torch.testing.assert_close(g, g_ref, atol=GRAD, rtol=0)


def test_sapo_on_policy_gradient_is_reinforces():
    # At r = 1 the gate's slope 4σ(1-σ) = 1: the gradient is Â ∇log π.
    batch, lp, adv = _fixture(log_r=[[0.0, 0.0, 0.0], [0.0]])
    terms = sapo_term(lp, batch.old_logprob, adv, tau_pos=0.3, tau_neg=7.0)
    (g,) = torch.autograd.grad(terms.term_RC[batch.loss_mask].sum(), lp)
    torch.testing.assert_close(g, torch.where(batch.loss_mask, adv, 0.0), atol=EXACT, rtol=0)


# ---------------------------------------------------------------------- GMPO
def test_gmpo_by_hand():
    # seq 0 (Â = +1): log r [0.3, -0.1, 0.5] capped at 0.4 -> [0.3, -0.1, 0.4], mean 0.2,
    # g = e^0.2; the third token is clipped (no gradient), the others get g/3 each.
    # seq 1 (Â = -1): log r -0.5 floored at -0.4 -> g = e^-0.4, clipped, no gradient.
    batch, lp, adv = _fixture()
    terms = gmpo_term(lp, batch.old_logprob, adv, batch, eps_low=0.4, eps_high=0.4)
    (g,) = torch.autograd.grad(terms.term_RC[batch.loss_mask].sum(), lp)
    e02, e04 = math.exp(0.2), math.exp(-0.4)
    assert _on_loss_tokens(batch, terms.term_RC.detach()) == pytest.approx(
        [e02, e02, e02, -e04], abs=EXACT)
    # each of seq 0's 3 tokens holds g: the summed term is 3 g, its gradient 3 · g/3 = g
    assert _on_loss_tokens(batch, g) == pytest.approx([e02, e02, 0.0, 0.0], abs=EXACT)
    assert _on_loss_tokens(batch, terms.clipped_RC) == [False, False, True, True]


def test_gmpo_matches_the_sign_form_of_the_paper():
    # arXiv 2507.20673 Eq. 7 as written: sgn(Â) min(sgn(Â) log r, sgn(Â) clip(log r, -ε, ε)),
    # geometric mean over the response, times Â, one value per sequence.
    batch, lp, adv = _fixture(log_r=[[0.7, -0.6, 0.1], [0.45]])
    eps = 0.4
    per_seq = []
    for s in range(2):
        on = (batch.sequence_id == s) & batch.loss_mask
        log_r = (lp - batch.old_logprob)[on]
        sgn = torch.sign(adv[on])
        ell = sgn * torch.minimum(sgn * log_r, sgn * log_r.clamp(-eps, eps))
        per_seq.append(torch.exp(ell.mean()) * adv[on][0])
    (g_ref,) = torch.autograd.grad(sum(per_seq), lp)
    terms = gmpo_term(lp, batch.old_logprob, adv, batch, eps_low=eps, eps_high=eps)
    # the term's tokens of sequence i sum to |y_i| g_i Â_i: weight 1/|y_i| to compare
    w = torch.where(batch.sequence_id == 0, adv.new_tensor(1 / 3), adv.new_tensor(1.0))
    (g,) = torch.autograd.grad((terms.term_RC * w)[batch.loss_mask].sum(), lp)
    torch.testing.assert_close(g, g_ref, atol=GRAD, rtol=0)


def test_gmpo_on_policy_gradient_is_the_per_token_mean_of_reinforce():
    batch, lp, adv = _fixture(log_r=[[0.0, 0.0, 0.0], [0.0]])
    est = Estimator(surrogate=GMPO(), aggregation=Aggregation.SEQUENCE_MEAN_TOKEN_MEAN)
    prepared = prepare(batch, est).replace(advantage=adv)
    value, _ = loss(lp, prepared, est)
    (g,) = torch.autograd.grad(value, lp)
    want = -torch.where(batch.loss_mask, adv, 0.0) * prepared.loss_weight
    torch.testing.assert_close(g, want, atol=EXACT, rtol=0)


@pytest.mark.parametrize("surrogate", [SAPO(), GMPO(), EntropyBonus(PPOClip())],
                         ids=["sapo", "gmpo", "entropy"])
def test_padded_and_packed_give_the_same_loss_and_gradient(surrogate):
    est = Estimator(surrogate=surrogate, aggregation=Aggregation.SEQUENCE_MEAN_TOKEN_MEAN)
    out = []
    for packed in (False, True):
        batch, lp, adv = _fixture(packed)
        prepared = prepare(batch, est).replace(advantage=adv)
        value, _ = loss(lp, prepared, est)
        (g,) = torch.autograd.grad(value, lp)
        out.append((value.item(), _on_loss_tokens(batch, g)))
    assert out[0][0] == pytest.approx(out[1][0], abs=EXACT)
    assert out[0][1] == pytest.approx(out[1][1], abs=EXACT)


# ---------------------------------------------------------------------- entropy bonus
def test_entropy_bonus_is_unbiased_for_the_entropy_and_its_gradient():
    # One state, a categorical π = softmax(z): over y ~ π_old, E[ĥ] = H(π) and
    # E[∂ĥ/∂z] = ∇_z H(π) (score-function form), computed by exact summation over y.
    z = torch.tensor([0.3, -1.2, 0.8, 0.1], dtype=DTYPE, requires_grad=True)
    z_old = torch.tensor([0.0, -0.5, 0.2, 0.4], dtype=DTYPE)
    logp = torch.log_softmax(z, 0)
    p_old = torch.softmax(z_old, 0)
    h = entropy_bonus_term(logp[:, None], torch.log_softmax(z_old, 0)[:, None])[:, 0]
    mean_h = (p_old * h).sum()
    (grad,) = torch.autograd.grad(mean_h, z, retain_graph=True)
    entropy = -(logp.exp() * logp).sum()
    (want,) = torch.autograd.grad(entropy, z)
    assert mean_h.item() == pytest.approx(entropy.item(), abs=EXACT)
    torch.testing.assert_close(grad, want, atol=GRAD, rtol=0)


def test_entropy_bonus_adds_c_times_the_term_to_the_base():
    batch, lp, adv = _fixture()
    prepared = batch.replace(advantage=adv)
    base = Reinforce()(lp, prepared).term_RC
    with_bonus = EntropyBonus(Reinforce(), coef=0.3)(lp, prepared).term_RC
    # Reinforce reads no old log-probs: the on-policy ĥ = -log π, gradient -log π
    (g,) = torch.autograd.grad((with_bonus - base)[batch.loss_mask].sum(), lp)
    torch.testing.assert_close((with_bonus - base).detach(), torch.where(
        batch.loss_mask, -0.3 * lp.detach(), 0.0), atol=EXACT, rtol=0)
    torch.testing.assert_close(g, torch.where(batch.loss_mask, -0.3 * lp.detach(), 0.0),
                               atol=EXACT, rtol=0)
    assert EntropyBonus(PPOClip()).requires == ("old_logprob",)
    assert EntropyBonus(Reinforce()).requires == ()


# ---------------------------------------------------------------------- bad arguments
@pytest.mark.parametrize(("build", "name"), [
    (lambda: SAPO(tau_pos=-1.0), "tau_pos"),
    (lambda: SAPO(tau_neg=0.0), "tau_neg"),
    (lambda: GMPO(eps_low=-0.1), "eps_low"),
    (lambda: GMPO(eps_high=float("nan")), "eps_high"),
    (lambda: EntropyBonus(PPOClip(), coef=-0.01), "coef"),
])
def test_bad_hyperparameters_name_the_argument(build, name):
    with pytest.raises(ValueError, match=name):
        build()


def test_entropy_bonus_refuses_a_non_surrogate_base():
    with pytest.raises(TypeError, match="base"):
        EntropyBonus("ppo")
    with pytest.raises(TypeError, match="base"):
        EntropyBonus(EntropyBonus(PPOClip()))


def test_sapo_defaults_are_the_papers_temperatures_and_the_registry_uses_them():
    """Issue 33, gap 5: τ_pos = 1.0, τ_neg = 1.05 (Gao et al., arXiv 2511.20347, §5), pinned by
    the gradient weight ``4 σ(1 - σ) r`` at a hand value of each sign, not by the fields."""
    from tokenmdp.estimators import get
    for part in (SAPO(), get("sapo").surrogate):
        assert isinstance(part, SAPO)
        batch, lp, adv = _fixture(log_r=[[0.4, 0.4, 0.4], [0.4]])
        batch = batch.replace(advantage=adv)
        (g,) = torch.autograd.grad(part(lp, batch).term_RC[batch.loss_mask].sum(), lp)
        r = math.exp(0.4)
        for s, tau in ((0, 1.0), (1, 1.05)):
            sig = 1 / (1 + math.exp(-tau * (r - 1)))
            want = 4 * sig * (1 - sig) * r * ADV[s][0]
            got = g[(batch.sequence_id == s) & batch.loss_mask]
            assert got.tolist() == pytest.approx([want] * len(got), abs=EXACT), (s, tau)
