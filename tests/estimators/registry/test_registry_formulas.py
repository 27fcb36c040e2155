"""Each registry entry states its own formula: a variant (``base_suffix``) never repeats its base's.

A card or ``tokenmdp estimators NAME`` that shows ``minirl``'s min(π_old/μ, 5) for ``minirl_no_is``
would promise a correction the estimator does not apply.
"""

import pytest

from tokenmdp import estimators
from tokenmdp.estimators.registry import lookup as registry

VARIANTS = [(name, base) for name in estimators.names() for base in estimators.names()
            if name.startswith(base + "_") and name != base]


def test_variants_are_found():
    assert ("minirl_no_is", "minirl") in VARIANTS and ("grpo_tis", "grpo") in VARIANTS


@pytest.mark.parametrize("name, base", VARIANTS, ids=[v for v, _ in VARIANTS])
def test_a_variant_states_its_own_formula(name, base):
    assert registry._entry(name).formula != registry._entry(base).formula


@pytest.mark.parametrize("name", estimators.names())
def test_a_formula_with_the_training_inference_factor_has_a_correction(name):
    # surrogates may use μ themselves (sequence IS, per-decision IS); π_old/μ is the correction's
    est, formula = estimators.get(name), registry._entry(name).formula
    if "π_old/μ" in formula:
        assert est.correction.describe() != "none", (name, formula)
