"""A peer's configuration as an estimator: TRL's ``GRPOConfig`` and verl's actor config.

The front door: :func:`estimator_from_trl` and :func:`estimator_from_verl` each return a
:class:`ConfiguredEstimator` — the :class:`~tokenmdp.estimators.Estimator` the configuration
computes (composed from the registry's parts), the notes where the peer's semantics differ, and
the registry entry it equals, if one does. Neither trl nor verl is imported: the mappings were
written against trl 1.16.0 and verl 0.9.1 (their field names and defaults are pinned here).

Floors, top to bottom::

    verl_plugin
    commands, trl_trainer, verl_losses
    trl, verl
    common

* :mod:`~tokenmdp.integrations.common` — reading a mapping, YAML or JSON file; the result type
  and its card; the one-line errors;
* :mod:`~tokenmdp.integrations.trl` — ``GRPOConfig`` → estimator;
* :mod:`~tokenmdp.integrations.verl` — ``actor_rollout_ref.actor`` and ``algorithm`` → estimator;
* :mod:`~tokenmdp.integrations.commands` — the command line's ``--trl-config`` /
  ``--verl-config`` (``tokenmdp compare``) and ``--from-trl`` / ``--from-verl``
  (``tokenmdp estimators``);
* :mod:`~tokenmdp.integrations.trl_trainer` — ``TokenMDPGRPOTrainer``, TRL's ``GRPOTrainer``
  training with any registry estimator; it needs the extra (``pip install "tokenmdp[trl]"``,
  trl 1.16.x) and is imported only on request, never by this front door;
* ``tokenmdp.integrations.verl_losses`` — ``register_with_verl``: every registry estimator as a
  verl policy loss (``policy_loss.loss_mode=tokenmdp_<name>``), and
  ``tokenmdp.integrations.verl_plugin``, whose import registers them in verl's worker processes
  (``model.external_lib``); both need the extra (``pip install "tokenmdp[verl]"``, verl 0.9.x)
  and are imported only on request (the API reference has their pages where verl is installed).

It stands above the front ends (it reads :mod:`tokenmdp.reports` for the compare row).
"""

from tokenmdp.integrations.common import ConfiguredEstimator, read_config
from tokenmdp.integrations.trl import TRL_DEFAULTS, TRL_VERSION, estimator_from_trl
from tokenmdp.integrations.verl import VERL_ACTOR_DEFAULTS, VERL_VERSION, estimator_from_verl

__all__ = ["ConfiguredEstimator", "TRL_DEFAULTS", "TRL_VERSION", "VERL_ACTOR_DEFAULTS",
           "VERL_VERSION", "estimator_from_trl", "estimator_from_verl", "read_config"]
