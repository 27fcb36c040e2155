"""k3 = (r - 1) - log r stays >= 0 near r = 1 in float32 and float64 (``expm1``, not ``exp - 1``).

With ``u = log r`` tiny, ``exp(u) - 1`` subtracts two nearly equal rounded numbers and keeps
only a few correct digits of ``u``; ``(exp(u) - 1) - u`` then comes out negative for about 10% of
float32 inputs with ``|u| ≤ 1e-3`` (and a few float64 ones). ``expm1(u)`` is accurate to the last
bit, ``expm1(u) ≥ u`` survives rounding (``u`` is itself representable), and so does k3 ≥ 0.
Each check below is shown to fail on the old formula.
"""

from __future__ import annotations

import pytest
import torch

from tokenmdp.batch import TokenBatch
from tokenmdp.estimators import Estimator, Reinforce, kl_k3, loss, prepare

DTYPES = (torch.float32, torch.float64)
BAND = 1e-3        # |log r| <= BAND: the band where exp(u) - 1 cancels
GRID = 200_001     # log r values on [-BAND, BAND], both ends included
#: Least share of negative old-formula values we expect, per dtype (measured: 9.8% in float32
#: and 1 of 200001 in float64), so the test really exercises the cancellation.
OLD_NEGATIVE_AT_LEAST = {torch.float32: 0.05, torch.float64: 1 / GRID}


def _log_ratios(dtype: torch.dtype) -> torch.Tensor:
    return torch.linspace(-BAND, BAND, GRID, dtype=dtype)


def _old_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """The formula kl_k3 had: (exp(u) - 1) - u, u = log π_ref - log π_θ."""
    u = ref_logprobs - logprobs
    return (u.exp() - 1) - u


def _negative_share(k3, dtype: torch.dtype) -> float:
    """Share of negative k3 values over the grid, written as log π_θ = 0 (so log r = u exactly)
    and as a realistic pair (log π_θ in [-4, 0], log π_ref = log π_θ + u)."""
    u = _log_ratios(dtype)
    gen = torch.Generator().manual_seed(0)
    logprobs = -4 * torch.rand(GRID, generator=gen, dtype=dtype)
    on_zero = k3(torch.zeros_like(u), u)
    as_pair = k3(logprobs, logprobs + u)
    return float(((on_zero < 0) | (as_pair < 0)).double().mean())


def _assert_nonnegative(k3, dtype: torch.dtype) -> None:
    share = _negative_share(k3, dtype)
    assert share == 0.0, f"k3 < 0 for {share:.2%} of |log r| <= {BAND} in {dtype}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_k3_is_nonnegative_near_ratio_one(dtype):
    _assert_nonnegative(kl_k3, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_check_fails_on_the_old_formula(dtype):
    assert _negative_share(_old_k3, dtype) >= OLD_NEGATIVE_AT_LEAST[dtype]
    with pytest.raises(AssertionError, match="k3 < 0"):
        _assert_nonnegative(_old_k3, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_k3_near_one_is_accurate(dtype):
    # Reference: the series u²/2 + u³/6 + u⁴/24 (error < u⁵/100 < 1e-17) in float64, at the u
    # that k3 actually saw. expm1(u) is rounded once, an error of at most an ulp of |u|, and
    # expm1(u) - u is then exact (Sterbenz): |error| <= 2 eps |u| (and 0 at u = 0).
    u = _log_ratios(torch.float64).to(dtype)
    got = kl_k3(torch.zeros_like(u), u).double()
    ud = u.double()
    reference = ud ** 2 / 2 + ud ** 3 / 6 + ud ** 4 / 24
    tol = 2 * torch.finfo(dtype).eps * ud.abs() + 1e-17
    assert ((got - reference).abs() <= tol).all()
    old = _old_k3(torch.zeros_like(u), u).double()
    assert not ((old - reference).abs() <= tol).all()      # the old formula is not this close


def test_k3_gradient_is_one_minus_ratio_near_one():
    # ∂k3/∂log π_θ = 1 - r = -expm1(u); float64 autograd against the closed form.
    u = _log_ratios(torch.float64)[::1000]
    lp = torch.zeros_like(u, requires_grad=True)
    (g,) = torch.autograd.grad(kl_k3(lp, u).sum(), lp)
    assert torch.allclose(g, -torch.expm1(u), rtol=1e-15, atol=0)


def test_train_inference_k3_metric_is_nonnegative_in_float32():
    # The loss's train_infer_kl_k3 metric is the mean of k3 over log q = log π_old - log μ. Pick
    # 40 positive float32 log q on the band where the old formula is negative (its mean was then
    # < 0), and write them as log π_old = -q, log μ = -2q: the subtraction gives q exactly.
    u = _log_ratios(torch.float32)
    chosen = u[(u > 0) & (_old_k3(torch.zeros_like(u), u) < 0)][::200][:40]
    assert chosen.numel() == 40 and float(_old_k3(torch.zeros_like(chosen), chosen).mean()) < 0
    n = chosen.numel()
    batch = TokenBatch.from_sequences([[5]], [[1] * n], rewards=[1.0], dtype=torch.float32)
    on = batch.loss_mask
    old = torch.zeros(batch.tokens.shape, dtype=torch.float32)
    behavior = torch.zeros(batch.tokens.shape, dtype=torch.float32)
    old[on], behavior[on] = -chosen, -2 * chosen
    batch = batch.replace(old_logprob=old, behavior_logprob=behavior)
    assert torch.equal((batch.old_logprob - batch.behavior_logprob)[on], chosen)
    est = Estimator(surrogate=Reinforce())
    _, metrics = loss(batch.old_logprob.clone(), prepare(batch, est), est)
    got = float(metrics["train_infer_kl_k3"])
    q = chosen.double()
    reference = float((torch.expm1(q) - q).mean())
    assert got >= 0.0
    # each term within 2 eps q of its value (see above), then a float32 mean of 40 terms
    assert abs(got - reference) <= 2 * torch.finfo(torch.float32).eps * float(q.max()) \
        + 40 * torch.finfo(torch.float32).eps * reference
