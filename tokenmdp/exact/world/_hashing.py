"""The hash behind :class:`~tokenmdp.exact.world.rewards.RandomTable` (not part of the public API).

The table's value of ``(x, y)`` is a chain of splitmix64 finalizers (Steele, Lea and Flood 2014,
"Fast splittable pseudorandom number generators"): from the seed, one step per prompt token, one
per response token (EOS included), one for the length; its top 53 bits give a uniform in
``[0, 1)``. Two evaluations of the same chain:

* :func:`table_hash` over any ``[N, L]`` rows of responses (the ``vectorized`` form);
* :func:`tree_hash` over a whole enumeration in canonical order: responses that share a prefix
  share its chain, so the chain is walked once per prefix, level by level (``Σ_k b^k`` steps
  instead of ``L`` per response) — the same bits, the building block of a fast
  :class:`~tokenmdp.exact.TokenMDP`.

Every step runs in place on uint64 arrays (wrap-around arithmetic modulo ``2^64``).
"""

from __future__ import annotations

import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def splitmix_(x: np.ndarray, scratch: np.ndarray | None = None) -> np.ndarray:
    """The splitmix64 finalizer, elementwise and in place on a uint64 array (returned).

    ``scratch``: a uint64 buffer of ``x``'s shape for the shifted copies (allocated if None).
    """
    t = np.empty_like(x) if scratch is None else scratch
    with np.errstate(over="ignore"):
        np.add(x, _GOLDEN, out=x)
        for shift, mult in ((30, _MIX1), (27, _MIX2)):
            np.right_shift(x, np.uint64(shift), out=t)
            np.bitwise_xor(x, t, out=x)
            np.multiply(x, mult, out=x)
        np.right_shift(x, np.uint64(31), out=t)
        np.bitwise_xor(x, t, out=x)
    return x


def prompt_hashes(seed: int, prompts) -> np.ndarray:
    """``[P]`` uint64: the chain after the seed and each prompt's tokens."""
    out = np.empty(len(prompts), dtype=np.uint64)
    for p, prompt in enumerate(prompts):
        h = splitmix_(np.array([seed], dtype=np.uint64))
        for t in prompt:
            h = splitmix_(h ^ np.uint64(t + 1))
        out[p] = h[0]
    return out


def to_unit(h: np.ndarray) -> np.ndarray:
    """Float64 uniforms in ``[0, 1)`` from the top 53 bits of each hash (``h`` is consumed)."""
    np.right_shift(h, np.uint64(11), out=h)
    return h.astype(np.float64) / float(2 ** 53)


def table_hash(seed: int, prompts, prompt_index: np.ndarray, responses: np.ndarray,
               lengths: np.ndarray) -> np.ndarray:
    """``[N]`` uniforms of responses ``[N, L]`` (padded after ``lengths``)."""
    h = prompt_hashes(seed, prompts)[prompt_index]
    step = np.empty_like(h)
    scratch = np.empty_like(h)
    for c in range(responses.shape[1]):
        live = c < lengths
        np.add(responses[:, c], 1, out=step, casting="unsafe")
        np.bitwise_xor(h, step, out=step)
        splitmix_(step, scratch)
        np.copyto(h, step, where=live)
    np.bitwise_xor(h, lengths.astype(np.uint64), out=h)
    return to_unit(splitmix_(h, scratch))


#: Depth-``(L-1)`` prefixes whose children are hashed at once (cache-sized temporaries).
TREE_CHUNK = 4096


def tree_hash(seed: int, prompts, branching: int, max_len: int, eos: int) -> np.ndarray:
    """``[P * Σ_{k<=L} b^k]`` uniforms of every response in canonical order (prompt-major; EOS
    after 0 .. L-1 tokens, then the truncated ones; prefixes in code order).

    The chains of the prefixes of depth ``< L`` are kept level by level; the ``b^L`` truncated
    responses, the largest block, are hashed :data:`TREE_CHUNK` parents at a time, straight
    into the output."""
    P, b, L = len(prompts), branching, max_len
    per_prompt = sum(b ** k for k in range(L + 1))
    out = np.empty((P, per_prompt), dtype=np.float64)
    tokens = np.arange(1, b + 1, dtype=np.uint64)                    # non-EOS token + 1

    def store(h: np.ndarray, block: np.ndarray) -> None:           # to_unit, written in place
        np.right_shift(h, np.uint64(11), out=h)
        block[...] = h
        block /= float(2 ** 53)

    h = prompt_hashes(seed, prompts)[:, None]                        # depth-0 prefixes [P, 1]
    start = 0
    for k in range(L):
        ended = h ^ np.uint64(eos + 1)                               # EOS after k tokens
        splitmix_(ended)
        np.bitwise_xor(ended, np.uint64(k + 1), out=ended)          # length k + 1
        store(splitmix_(ended), out[:, start:start + b ** k])
        start += b ** k
        if k < L - 1:
            h = (h[:, :, None] ^ tokens).reshape(P, b ** (k + 1))    # children, code c*b + a
            splitmix_(h)
    scratch = np.empty((P, TREE_CHUNK * b), dtype=np.uint64)
    child = np.empty_like(scratch)
    for lo in range(0, h.shape[1], TREE_CHUNK):                      # the truncated responses
        m = min(TREE_CHUNK, h.shape[1] - lo) * b
        c, t = child[:, :m], scratch[:, :m]
        np.bitwise_xor(h[:, lo:lo + m // b, None], tokens, out=c.reshape(P, m // b, b))
        splitmix_(c, t)
        np.bitwise_xor(c, np.uint64(L), out=c)                       # length L
        store(splitmix_(c, t), out[:, start + lo * b:start + lo * b + m])
    return out.reshape(-1)
