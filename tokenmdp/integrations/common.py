"""What both mappings share: reading a configuration, the result type, its card.

A configuration arrives as a mapping, a path to a YAML or JSON file, or (TRL) an object with the
peer's attributes; :func:`read_config` turns the first two into a plain ``dict``. YAML needs
``pyyaml`` (installed with the ``docs`` extra); it is imported when a YAML file is read.
"""

from __future__ import annotations

import dataclasses
import json
import textwrap
from collections.abc import Iterable, Mapping
from pathlib import Path

from tokenmdp import estimators
from tokenmdp.estimators import Estimator

__all__ = ["ConfiguredEstimator", "read_config"]

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
