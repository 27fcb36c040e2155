"""What :class:`~tokenmdp.exact.MomentsWorkspace` compares, besides the policies' parameters and
buffers (``WorldTables.current``), to tell whether its tables still hold: the MDP and the
policies it holds, and the public attributes of each and of the policies' submodules (a
temperature, a rounding, an unregistered tensor such as ``prompt_probs``).
"""

from __future__ import annotations

import torch
from torch import nn

_PLAIN = (bool, int, float, complex, str, bytes, type(None))


def _settings(objects) -> list:
    """What the workspace's tables read of ``objects`` (the MDP and the policies) besides the
    modules' parameters and buffers: each object itself, and the public attributes of it and of
    its submodules, plain values as they are, tensors as copies, anything else itself (compared
    by identity)."""
    out = []
    for obj in objects:
        out.append(obj)
        for part in obj.modules() if isinstance(obj, nn.Module) else (() if obj is None
                                                                      else (obj,)):
            for key, value in sorted(getattr(part, "__dict__", {}).items()):
                if not key.startswith("_"):
                    out.append((part, key, value.detach().clone()
                                if isinstance(value, torch.Tensor) else value))
    return out


def _same(now: list, then: list) -> bool:
    """Whether two :func:`_settings` are equal (plain values by value and type, tensors by
    :func:`torch.equal`, the rest by identity)."""
    def same(a, b) -> bool:
        if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
            return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and \
                a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b))
        if isinstance(a, _PLAIN):
            return type(a) is type(b) and a == b
        return a is b

    return len(now) == len(then) and all(
        a[0] is b[0] and a[1] == b[1] and same(a[2], b[2]) if isinstance(a, tuple)
        and isinstance(b, tuple) else (not isinstance(a, tuple) and not isinstance(b, tuple)
                                       and a is b)
        for a, b in zip(now, then))
