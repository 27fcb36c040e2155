"""Command-line options generated from :class:`~tokenmdp.rl.config.TrainConfig`.

Every field except those skipped becomes an option (``rollout_precision`` →
``--rollout-precision``), its docstring the help text, its default the default; booleans get
``--flag / --no-flag``. Used by ``tokenmdp sft`` / ``tokenmdp train``
(:mod:`tokenmdp.rl.cli_commands`) and by the ``torchrun`` entry point
(:func:`tokenmdp.rl.trainer.main`); it imports neither.
"""

from __future__ import annotations

import argparse
import dataclasses

from tokenmdp.rl.config import TrainConfig, field_docs

__all__ = ["add_config_arguments", "config_from_args"]

_TYPES = {"int": int, "float": float, "str": str, "float | None": float, "str | None": str}


def add_config_arguments(parser: argparse.ArgumentParser, *, defaults: dict | None = None,
                         skip: tuple[str, ...] = ("mode",)) -> None:
    """One option per :class:`TrainConfig` field not in ``skip`` (``defaults`` override).

    Parameters
    ----------
    parser : argparse.ArgumentParser
        The (sub-)parser the options are added to.
    defaults : dict, optional
        Field name → default to show and use instead of the field's own.
    skip : tuple of str, default ("mode",)
        Fields that get no option.

    Raises
    ------
    TypeError
        For a field whose type has no command-line conversion.
    """
    docs = field_docs(TrainConfig)
    defaults = defaults or {}
    for f in dataclasses.fields(TrainConfig):
        if f.name in skip:
            continue
        default = defaults.get(f.name, f.default)
        flag = "--" + f.name.replace("_", "-")
        help_text = f"{docs.get(f.name, '')} (default: {default})"
        if f.type == "bool":
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default,
                                help=help_text)
        elif f.type in _TYPES:
            parser.add_argument(flag, type=_TYPES[f.type], default=default, help=help_text,
                                metavar=f.name.upper())
        else:  # a new field type must be mapped here, not silently dropped
            raise TypeError(f"TrainConfig.{f.name}: no command-line type for {f.type!r}")


def config_from_args(args: argparse.Namespace, mode: str) -> TrainConfig:
    """The :class:`TrainConfig` of parsed options, with ``mode``.

    Parameters
    ----------
    args : argparse.Namespace
        Parsed options of :func:`add_config_arguments` (fields without an option keep their
        defaults).
    mode : str
        ``"rl"`` or ``"sft"``.

    Returns
    -------
    TrainConfig
        The configuration (checked later, by :func:`~tokenmdp.rl.config.check_config`).
    """
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)
              if hasattr(args, f.name)}
    return TrainConfig(**{**values, "mode": mode})
