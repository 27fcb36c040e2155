"""What both mappings share: reading a configuration, the result type, its card, and the
padded batch both trainer hooks build.

A configuration arrives as a mapping, a path to a YAML or JSON file, or (TRL) an object with the
peer's attributes; :func:`read_config` turns the first two into a plain ``dict``. YAML needs
``pyyaml`` (installed with the ``docs`` extra); it is imported when a YAML file is read.
:func:`batch_from_padded` turns a peer's padded ``[B, T]`` response tensors into a
:class:`~tokenmdp.TokenBatch`, column for column (TRL's hook and verl's policy losses).
"""

from __future__ import annotations

import dataclasses
import json
import textwrap
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch

from tokenmdp import estimators
from tokenmdp.batch import TokenBatch
from tokenmdp.estimators import Estimator
from tokenmdp.interop.padded import from_hf

__all__ = ["ConfiguredEstimator", "batch_from_padded", "read_config"]

WIDTH = 90  # columns of the card


@dataclasses.dataclass(frozen=True)
class ConfiguredEstimator:
    """The estimator a peer's configuration computes, and where the peer's semantics differ.

    Parameters
    ----------
    estimator : Estimator
        Composed from the library's parts with the configured hyperparameters; named
        ``"trl:<loss_type>"`` or ``"verl:<loss_mode>"``.
    notes : tuple of str
        Plain-language notes: what the peer does that the parts do not show (a default the
        configuration does not state, what ``S`` counts, an epsilon, a float32 detail).
    peer : str
        ``"trl"`` or ``"verl"``, with the version the mapping was written against.
    same_as : str or None
        The registry entry the estimator equals part for part, if one does.
    """

    estimator: Estimator
    notes: tuple[str, ...]
    peer: str
    same_as: str | None = None

    def card(self) -> str:
        """The estimator's card as plain text: its parts, the registry entry it equals, the notes.

        Returns
        -------
        str
            The card, lines joined by newlines (no trailing newline).
        """
        est = self.estimator
        kl = est.kl.describe() if est.kl is not None else "none"
        parts = [("surrogate", est.surrogate.describe()), ("advantage", est.advantage.describe()),
                 ("correction", est.correction.describe()),
                 ("aggregation", est.aggregation.value), ("KL", kl)]
        lines = [est.name, "=" * len(est.name), f"from a {self.peer} configuration", "",
                 "components:"]
        lines += [f"  {part:<12} {text}" for part, text in parts]
        same = (f"the registry's {self.same_as} (tokenmdp estimators {self.same_as})"
                if self.same_as else "no registry entry: a composition of the registry's parts")
        lines += ["", *textwrap.wrap(f"equals: {same}", WIDTH, subsequent_indent="  "), "",
                  "where the peer differs or says nothing:"]
        for note in self.notes or ("nothing known: the parts compute the peer's loss",):
            lines += textwrap.wrap(note, WIDTH, initial_indent="  - ", subsequent_indent="    ")
        return "\n".join(lines)


def read_config(config, *, what: str) -> dict:
    """A configuration as a plain ``dict``: a mapping is copied, a path read (YAML or JSON).

    Parameters
    ----------
    config : mapping, str or Path
        The configuration, or the path of a ``.json``, ``.yaml`` or ``.yml`` file.
    what : str
        How the error messages name it (``"TRL config"``).

    Returns
    -------
    dict
        The configuration.

    Raises
    ------
    ValueError
        A file that cannot be read or parsed, or whose top level is not a mapping; YAML without
        ``pyyaml`` installed.
    """
    if isinstance(config, Mapping):
        return dict(config)
    if not isinstance(config, (str, Path)):
        raise TypeError(f"{what}: expected a mapping or a file path, got {type(config).__name__}")
    path = Path(config)
    try:
        text = path.read_text()
    except OSError as err:
        raise ValueError(f"{what}: cannot read {path} ({err.strerror or err})") from None
    if path.suffix.lower() == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"{what}: {path} is not valid JSON ({err})") from None
    else:
        try:
            import yaml
        except ImportError:
            raise ValueError(f"{what}: reading {path} needs pyyaml (pip install pyyaml), or "
                             "give a .json file") from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as err:
            first = str(err).splitlines()[0] if str(err) else "parse error"
            raise ValueError(f"{what}: {path} is not valid YAML ({first})") from None
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ValueError(f"{what}: {path} must hold a mapping of fields, got "
                         f"{type(data).__name__}")
    return dict(data)


def check_fields(config: Mapping, known: Iterable[str], *, where: str) -> None:
    """Raise ``ValueError`` naming the first field of ``config`` not in ``known``."""
    known = set(known)
    for field in config:
        if field not in known:
            raise ValueError(f"{where}{field}: unknown field (not in the configuration this "
                             "mapping was written against)")


def no_counterpart(field: str, value, why: str) -> ValueError:
    """The one-line error of a known field whose value the library's parts cannot express."""
    return ValueError(f"{field}={value!r}: no counterpart in tokenmdp ({why})")


def registry_match(estimator: Estimator) -> str | None:
    """The registry entry equal to ``estimator`` part for part (its name aside), if any."""
    for name in estimators.names():
        entry = estimators.get(name)
        if estimator.replace(name=name) == entry:
            return name
    return None


def batch_from_padded(mask_BT: torch.Tensor, old_logprob_BT: torch.Tensor, *,
                      dtype: torch.dtype, tokens_BT: torch.Tensor | None = None,
                      loss_BT: torch.Tensor | None = None,
                      behavior_logprob_BT: torch.Tensor | None = None,
                      ref_logprob_BT: torch.Tensor | None = None,
                      advantage_BT: torch.Tensor | None = None) -> TokenBatch:
    """A padded :class:`~tokenmdp.TokenBatch` of a peer's response tensors, column for column.

    Row ``b`` is response ``b``; the columns up to the last one ``mask_BT`` sets are its
    sequence (at least one column, so a fully masked response stays a row), the rest padding.
    The prompt is left out: no estimator reads it.

    Parameters
    ----------
    mask_BT : Tensor ``[B, T]``
        The peer's response mask (bool or 0/1): where the response's tokens are.
    old_logprob_BT : Tensor ``[B, T]``
        ``log π_old`` of each column.
    dtype : torch.dtype
        Float dtype of every float field (``float32`` or ``float64``).
    tokens_BT : integer Tensor ``[B, T]``, optional
        The token ids (default 0: a peer that passes none; only Clip-Cov's tie-break reads them).
    loss_BT : Tensor ``[B, T]``, optional
        The loss tokens, inside ``mask_BT`` (default ``mask_BT``).
    behavior_logprob_BT, ref_logprob_BT : Tensor ``[B, T]``, optional
        ``log μ`` of the sampler and ``log π_ref`` of the reference.
    advantage_BT : Tensor ``[B, T]``, optional
        Per-token advantages, kept on the loss tokens (default: 1 there, as
        :func:`~tokenmdp.interop.from_hf` fills it; :func:`~tokenmdp.estimators.prepare`
        replaces it).

    Returns
    -------
    TokenBatch
        ``reward`` 0, each response its own group, ``loss_weight`` 1 on the loss tokens.
    """
    mask = mask_BT.bool()
    keep = mask if loss_BT is None else loss_BT.bool() & mask
    ids = torch.zeros(mask.shape, dtype=torch.long, device=mask.device) if tokens_BT is None \
        else tokens_BT
    cols = torch.arange(mask.shape[1], device=mask.device)
    last = torch.where(mask, cols, 0).amax(dim=1, keepdim=True)    # last masked column (or 0)
    real = cols <= last

    def cast(tensor):
        return None if tensor is None else tensor.to(dtype)

    advantage = None if advantage_BT is None else torch.where(keep, advantage_BT.to(dtype), 0.0)
    return from_hf(ids, real.long(), torch.where(keep, ids, -100), length=real.sum(1),
                   old_logprob=cast(old_logprob_BT), behavior_logprob=cast(behavior_logprob_BT),
                   ref_logprob=cast(ref_logprob_BT), advantage=advantage,
                   reward=torch.zeros(mask.shape[0], dtype=dtype, device=mask.device),
                   dtype=dtype)
