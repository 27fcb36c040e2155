"""Importing this module registers every registry estimator as a verl policy loss.

verl computes the actor's loss in its worker processes (Ray actors), not in the driver, so
:func:`~tokenmdp.integrations.verl_losses.register_with_verl` has to run there. verl imports
the module named by ``actor_rollout_ref.model.external_lib`` in each process that builds the
model config (the workers' ``init_model`` among them, in verl 0.9.1)::

    python -m verl.trainer.main_ppo ... \\
        actor_rollout_ref.model.external_lib=tokenmdp.integrations.verl_plugin \\
        actor_rollout_ref.actor.policy_loss.loss_mode=tokenmdp_grpo

(``VERL_USE_EXTERNAL_MODULES=tokenmdp.integrations.verl_plugin`` does the same on ``import
verl``, where the variable reaches the workers.) The loss modes are ``tokenmdp_<name>``.
"""

from __future__ import annotations

from tokenmdp.integrations.verl_losses import register_with_verl

__all__ = ["REGISTERED"]

REGISTERED = register_with_verl()
"""The loss modes this import registered, and their estimators."""
