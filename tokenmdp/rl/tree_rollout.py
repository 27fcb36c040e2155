"""Branching rollouts from the rollout engine: a shared prefix generated once, then forked.

:func:`generate_tree` samples one :class:`~tokenmdp.trees.ResponseTree` per prompt with the
engine's own numerics (precision, engine mismatch mode, temperature), as
:meth:`~tokenmdp.rl.rollout.RolloutEngine.generate` samples chains. Every branch is a row of a
KV-cached decoding loop; a fork *replicates* the row (its cache, its next-token logits, its
mismatch key), so a shared prefix is fed to the model once: the positions computed are the
prompt once per tree plus one per fed node (``forward_positions`` in the stats), never a prefix
again. A node's ``log mu`` and routing are recorded once, so they are the same on every leaf
through it.

Fork schedules (:func:`parse_tree_spec` reads their text form, ``--rollout-tree``):

* :class:`FixedForks` ``fixed:D1xB1,D2xB2,...`` — after ``D`` response tokens (``D = 0``: at the
  prompt) every live branch forks into ``B`` branches; each samples its own next token from
  the shared distribution ``mu(. | prefix)``. A branch whose EOS came before a fork depth (or at
  it) does not fork: its leaf stands alone and the tree has fewer than ``prod B`` leaves. Each
  leaf is then marginally a sample of ``mu`` (the fork points do not depend on the tokens).
* :class:`EntropyForks` ``entropy:N1xT1,N2xT2,...`` — TreeRL-style (arXiv 2506.11902, EPTree,
  with one initial chain per tree): sample one chain to its end; then, per round ``i``, pick the
  ``N_i`` *prefix states* of the tree (the prompt or a node that was fed, i.e. has a next-token
  distribution) with the highest engine entropy ``H(mu(. | state))`` — the entropy of the
  distribution the state's first child was sampled from — among those not forked at before (ties:
  shallower first, then earlier node), and sample ``T_i`` new children from each, continuing every
  new branch to its end. A tree has ``1 + sum N_i T_i`` leaves (fewer when it has fewer states).
  The leaves are not marginally ``mu`` samples: the fork points depend on the sampled chain.

Siblings are distinct nodes even when they sample the same token (they are distinct draws).
With ``"fresh"`` mismatch noise each row draws its own noise at every step, as in ``generate``.
The last token of every branch is never fed, hence never routed (``-1`` in
``token_extras[ENGINE_ROUTING]``), as in ``generate``.

Shape suffixes: ``R`` live rows (branches), ``T`` cache columns, ``V`` vocabulary, ``L`` routed
layers, ``K`` experts per token.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from tokenmdp.batch import TokenBatch
from tokenmdp.exact.world.engine_mismatch import context_keys, key_step, perturb_logits
from tokenmdp.model import KVCache
from tokenmdp.rl.mismatch import ENGINE_ROUTING
from tokenmdp.tree_schedules import EntropyForks, FixedForks, parse_tree_spec
from tokenmdp.trees import ResponseTree, batch_from_trees

__all__ = ["TreeRollout", "generate_tree"]


class TreeRollout(NamedTuple):
    """What :func:`generate_tree` returns.

    Parameters
    ----------
    batch : TokenBatch
        The expanded batch (:func:`~tokenmdp.trees.batch_from_trees`: one sequence per leaf,
        ``token_extras["tree_node"]``), with ``behavior_logprob`` and
        ``token_extras[ENGINE_ROUTING]`` ``[R, C, L, K]``; rewards 0.
    trees : list of ResponseTree
        One per prompt.
    entropy : list of tuple of float
        Per tree, the entropy of the distribution each node's token was sampled from.
    stats : dict of str to int
        ``generated_tokens`` (nodes), ``expanded_tokens`` (response tokens of the leaves' paths),
        ``shared_tokens`` (expanded − generated), ``forward_positions`` (token positions the
        model computed: each prompt once, each fed node once), ``leaves``.
    """

    batch: TokenBatch
    trees: list
    entropy: list
    stats: dict


class _Rows:
    """The live branches: one cache row, next-token logits and mismatch key each."""

    def __init__(self, tree, node, level, length, logits, keys, cache):
        self.tree, self.node, self.level = tree, node, level   # python lists, one per row
        self.length, self.logits, self.keys, self.cache = length, logits, keys, cache

    def take(self, index: list[int]) -> _Rows:
        idx = torch.tensor(index, dtype=torch.long, device=self.length.device)
        self.cache.k = [k[idx] for k in self.cache.k]
        self.cache.v = [v[idx] for v in self.cache.v]
        return _Rows([self.tree[i] for i in index], [self.node[i] for i in index],
                     [self.level[i] for i in index], self.length[idx], self.logits[idx],
                     None if self.keys is None else self.keys[idx], self.cache)


@torch.no_grad()
def generate_tree(engine, prompts: Sequence[Sequence[int]], schedule, *, max_new_tokens: int,
                  eos_id: int, generator: torch.Generator, temperature: float = 1.0,
                  groups: Sequence[int] | None = None, prompt_index: Sequence[int] | None = None,
                  dtype: torch.dtype = torch.float32) -> TreeRollout:
    """Sample one response tree per prompt (see the module docstring).

    Parameters
    ----------
    engine : RolloutEngine
        The engine whose model, numerics and mismatch mode sample.
    prompts : sequences of token ids, each non-empty
        One tree per prompt.
    schedule : FixedForks, EntropyForks or str
        The fork schedule, or its spec (:func:`parse_tree_spec`; not ``"none"``).
    max_new_tokens, eos_id, generator, temperature, groups, prompt_index, dtype
        As :meth:`~tokenmdp.rl.rollout.RolloutEngine.generate`, per tree (``groups`` default:
        each tree its own group).

    Returns
    -------
    TreeRollout

    Raises
    ------
    ValueError
        A bad schedule (naming ``depths``, ``branching``, ``forks`` or ``schedule``), or the
        arguments :meth:`~tokenmdp.rl.rollout.RolloutEngine.generate` refuses.
    """
    if isinstance(schedule, str):
        schedule = parse_tree_spec(schedule, name="schedule")
        if schedule is None:
            raise ValueError("schedule: 'none' is no tree; use RolloutEngine.generate")
    if not isinstance(schedule, (FixedForks, EntropyForks)):
        raise TypeError(f"schedule: expected FixedForks, EntropyForks or a spec string, got "
                        f"{type(schedule).__name__}")
    engine._check_generate(prompts, max_new_tokens, eos_id, generator, temperature)
    schedule.check(max_new_tokens)
    model, dev, mismatch = engine.model, engine.device, engine.mismatch
    cfg = model.config
    n = len(prompts)
    plen = [len(p) for p in prompts]
    P, T = max(plen), max(plen) + max_new_tokens
    cols_T = torch.arange(T, device=dev)
    nodes = [dict(tokens=[], parent=[], depth=[], logp=[], ent=[], route={}) for _ in range(n)]
    states = [{} for _ in range(n)]  # per tree: state (-1: the prompt) -> (raw logits, entropy)
    source = [{} for _ in range(n)]  # per tree: state -> an archived cache row holding its path
    counts = {"forward_positions": sum(plen)}
    entropy_mode = isinstance(schedule, EntropyForks)
    archive = []                     # finished rows' caches, read by entropy forks

    # Prefill: every prompt once, one row per tree.
    tokens_nP = torch.zeros(n, P, dtype=torch.long, device=dev)
    for i, p in enumerate(prompts):
        tokens_nP[i, :len(p)] = torch.as_tensor(list(p), dtype=torch.long)
    plen_n = torch.tensor(plen, device=dev)
    valid_nP = cols_T[:P] < plen_n[:, None]
    cache = KVCache(cfg, n, T, device=dev, dtype=engine.dtype)
    out = model.forward_tokens(tokens_nP, cols_T[:P].expand(n, P),
                               (cols_T[None, :] <= cols_T[:P, None]).expand(n, 1, P, T), valid_nP,
                               cache=cache, cache_cols_RC=cols_T[:P].expand(n, P), aux=False)
    prompt_route = [out.experts_RCLK[i, :plen[i]] for i in range(n)]
    rows = _Rows(list(range(n)), [-1] * n, [0] * n, plen_n.clone(),
                 out.logits_RCV[torch.arange(n, device=dev), plen_n - 1],
                 _keys(mismatch, prompts, nodes, [(k, -1) for k in range(n)], dev), cache)

    def depth(k: int, v: int) -> int:
        return 0 if v == -1 else nodes[k]["depth"][v]

    def decode(rows: _Rows) -> None:
        """Extend every row to its end (EOS or ``max_new_tokens``), forking on the fixed
        schedule; a finished row's cache goes to ``archive`` (entropy forks) or away."""
        while rows.tree:
            if not entropy_mode:   # fixed forks: replicate the rows at their next fork depth
                index, levels = [], []
                for r, (k, v, lev) in enumerate(zip(rows.tree, rows.node, rows.level)):
                    forks = lev < len(schedule.depths) and depth(k, v) == schedule.depths[lev]
                    copies = schedule.branching[lev] if forks else 1
                    index += [r] * copies
                    levels += [lev + int(forks)] * copies
                if len(index) != len(rows.tree):
                    rows = rows.take(index)
                rows.level = levels
            logits = perturb_logits(rows.logits, mismatch, keys_N=rows.keys, generator=generator)
            lp_RV = torch.log_softmax(logits.float() / temperature, dim=-1)
            y_R = torch.multinomial(lp_RV.exp(), 1, generator=generator).squeeze(1)
            ent_R = -(lp_RV.exp() * lp_RV).nan_to_num().sum(-1)
            if rows.keys is not None:
                rows.keys = key_step(rows.keys, y_R)
            new_nodes, done = [], []
            for r, (k, u, y, lp, h) in enumerate(zip(
                    rows.tree, rows.node, y_R.tolist(),
                    lp_RV.gather(1, y_R[:, None])[:, 0].tolist(), ent_R.tolist())):
                t = nodes[k]
                if entropy_mode and u not in states[k]:
                    states[k][u] = (rows.logits[r], h)
                t["tokens"].append(y), t["parent"].append(u), t["depth"].append(depth(k, u) + 1)
                t["logp"].append(lp), t["ent"].append(h)
                new_nodes.append(len(t["tokens"]) - 1)
                done.append(y == eos_id or t["depth"][-1] == max_new_tokens)
            rows.node = new_nodes
            rows.length = rows.length + 1
            for r in (r for r, d in enumerate(done) if d and entropy_mode):
                a, k, v = len(archive), rows.tree[r], rows.node[r]
                archive.append(([c[r] for c in rows.cache.k], [c[r] for c in rows.cache.v]))
                while v != -1 and v not in source[k]:
                    source[k][v], v = a, nodes[k]["parent"][v]
                source[k].setdefault(-1, a)
            live = [r for r, d in enumerate(done) if not d]
            if not live:
                return
            if len(live) != len(rows.tree):
                rows = rows.take(live)
            col_R, R = rows.length - 1, len(live)
            fed = torch.tensor([nodes[k]["tokens"][v] for k, v in zip(rows.tree, rows.node)],
                               dtype=torch.long, device=dev)
            out = model.forward_tokens(fed[:, None], col_R[:, None],
                                       (cols_T[None, :] <= col_R[:, None])[:, None, None],
                                       torch.ones(R, 1, dtype=torch.bool, device=dev),
                                       cache=rows.cache, cache_cols_RC=col_R[:, None], aux=False)
            counts["forward_positions"] += R
            for r, (k, v) in enumerate(zip(rows.tree, rows.node)):
                nodes[k]["route"][v] = out.experts_RCLK[r, 0]
            rows.logits = out.logits_RCV[:, 0]

    decode(rows)
    forked = [set() for _ in range(n)]
    for n_i, t_i in zip(getattr(schedule, "forks", ()), schedule.branching):
        plan = []     # (tree, state) of every new branch of this round
        for k in range(n):
            cand = sorted((u for u in states[k] if u not in forked[k]),
                          key=lambda u, k=k: (-states[k][u][1], depth(k, u), u))
            forked[k].update(cand[:n_i])
            plan += [(k, u) for u in cand[:n_i] for _ in range(t_i)]
        if not plan:
            break
        src = [source[k][u] for k, u in plan]
        cache = KVCache(cfg, 0, T, device=dev, dtype=engine.dtype)   # rows from the archive
        cache.k = [torch.stack([archive[a][0][i] for a in src]) for i in range(cfg.n_layers)]
        cache.v = [torch.stack([archive[a][1][i] for a in src]) for i in range(cfg.n_layers)]
        decode(_Rows([k for k, _ in plan], [u for _, u in plan], [0] * len(plan),
                     torch.tensor([plen[k] + depth(k, u) for k, u in plan], device=dev),
                     torch.stack([states[k][u][0] for k, u in plan]),
                     _keys(mismatch, prompts, nodes, plan, dev), cache))
    return _assemble(prompts, nodes, prompt_route, counts, cfg, groups, prompt_index, dtype, dev)


def _keys(mismatch, prompts, nodes, states, dev) -> torch.Tensor | None:
    """The deterministic mismatch modes' keys of the contexts ``states`` (``(tree, node)``: the
    prompt and the path to the node), None for the other modes."""
    if not mismatch.deterministic:
        return None
    keys = []
    for k, u in states:
        path = []
        while u != -1:
            path.append(nodes[k]["tokens"][u])
            u = nodes[k]["parent"][u]
        context = torch.tensor([list(prompts[k]) + path[::-1]], dtype=torch.long, device=dev)
        keys.append(context_keys(context, mismatch.seed)[0])
    return torch.stack(keys)


def _assemble(prompts, nodes, prompt_route, counts, cfg, groups, prompt_index, dtype,
              dev) -> TreeRollout:
    """The trees, the expanded batch with ``log mu`` and routing, and the token counts."""
    trees = [ResponseTree(p, t["tokens"], t["parent"]) for p, t in zip(prompts, nodes)]
    batch = batch_from_trees(trees, groups=groups, prompt_index=prompt_index,
                             behavior_logprobs=[t["logp"] for t in nodes], dtype=dtype,
                             device=dev)
    R, C = batch.tokens.shape
    routing = torch.full((R, C, cfg.routed_layers, cfg.top_k), -1, dtype=torch.long, device=dev)
    unrouted = torch.full((cfg.routed_layers, cfg.top_k), -1, dtype=torch.long, device=dev)
    s = 0
    for k, (tree, t) in enumerate(zip(trees, nodes)):
        for leaf in tree.leaves:           # batch_from_trees: tree order, then leaf order
            path = tree.path(leaf)
            rows = [prompt_route[k]] + [t["route"].get(v, unrouted)[None] for v in path]
            seq = torch.cat(rows)
            routing[s, :len(seq)] = seq
            s += 1
    generated = sum(tr.generated_tokens for tr in trees)
    expanded = sum(tr.expanded_tokens for tr in trees)
    stats = {"generated_tokens": generated, "expanded_tokens": expanded,
             "shared_tokens": expanded - generated,
             "forward_positions": counts["forward_positions"],
             "leaves": sum(len(tr.leaves) for tr in trees)}
    batch = batch.replace(token_extras={**batch.token_extras, ENGINE_ROUTING: routing})
    return TreeRollout(batch, trees, [tuple(t["ent"]) for t in nodes], stats)
