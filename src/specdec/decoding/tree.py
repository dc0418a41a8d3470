"""Token trees: several draft continuations verified in ONE target pass.

Shapes. A static shape ``(4, 2, 2, 1)`` gives the root (the pending token) 4 children, each
of those 2, and so on. ``"auto"`` grows a dynamic tree from the draft's own confidence (as
EAGLE-2 does): each level keeps the candidates with the largest cumulative draft
probability, within a node budget.

Acceptance. Greedy: the longest path whose every token equals the target's argmax. Sampling:
recursive rejection sampling over siblings drawn WITHOUT replacement (Jeon et al. 2024,
"Recursive Speculative Decoding: Accelerating LLM Inference via Sampling Without
Replacement"; the with-replacement form is SpecInfer's multi-step speculative sampling, Miao
et al. 2024). At a node with target distribution p and draft distribution q, the children
c_1, c_2, ... were drawn from q one after another without replacement. Child c_j is accepted
with probability min(1, p(c_j) / q(c_j)); on rejection p <- normalize(max(p - q, 0)) and
q <- q with c_j removed, renormalized (the matching correction for drawing without
replacement); if every child is rejected the token is drawn from the final p. The emitted
tokens are distributed exactly as the target's own samples.

Indexing: nodes 0..N-1 in breadth-first order; ``parents[i]`` is a node index or -1 for the
root. Per-node arrays for the expansion side use index 0 for the root and i + 1 for node i.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specdec.sampling.acceptance import residual_distribution
from specdec.sampling.processors import sample

ROOT = -1
AUTO_TREE_BUDGET = 12  # nodes
AUTO_TREE_DEPTH = 6
AUTO_TREE_WIDTH = 3  # candidates kept per level, and children considered per node


def parse_tree(spec) -> tuple | str | None:
    """None, "auto", or a tuple of per-depth branching factors from "4,2,2,1" / [4, 2, 2, 1]."""
    if spec is None or spec == "auto":
        return spec
    if isinstance(spec, str):
        try:
            spec = [int(part) for part in spec.split(",") if part.strip()]
        except ValueError:
            raise ValueError(f"tree must be \"auto\" or comma-separated branching factors like 4,2,2,1, got {spec!r}") from None
    widths = tuple(int(w) for w in spec)
    if not widths or any(w < 1 for w in widths) or len(widths) > 16:
        raise ValueError(f"tree branching factors must be 1..16 levels of integers >= 1, got {spec!r}")
    return widths


def tree_size(widths: tuple) -> int:
    size, level = 0, 1
    for width in widths:
        level *= width
        size += level
    return size


@dataclass
class DraftTree:
    tokens: list  # [N] token id of each node
    parents: list  # [N] parent node index, ROOT for children of the pending token
    depths: list  # [N] 1-based depth (children of the root are at depth 1)
    fed: int  # the first ``fed`` nodes (all but the deepest level) went through the draft: their KV rows exist
    draw_dists: dict  # expansion index (0 = root, i + 1 = node i) -> [V] distribution its children were drawn from
    deterministic: bool = False  # children chosen, not drawn (suffix proposals): no draw_dists

    def children(self) -> dict:
        """expansion index -> child node indices, in the order they were drawn."""
        kids: dict = {}
        for node, parent in enumerate(self.parents):
            kids.setdefault(parent + 1, []).append(node)
        return kids

    def path_to(self, node: int) -> list:
        path = []
        while node != ROOT:
            path.append(node)
            node = self.parents[node]
        return path[::-1]


def pick_children(dist: np.ndarray, count: int, greedy: bool, rng: np.random.Generator) -> list:
    """``count`` distinct tokens: the most likely (greedy) or a draw without replacement from ``dist`` (Gumbel-top-k).

    dist: [V] the node's draft distribution. Only tokens with positive probability are returned,
    in draw order (for Gumbel-top-k, descending keys = sequential sampling without replacement).
    """
    if greedy:
        count = min(count, int(np.count_nonzero(dist > 0)))
        if count == 0:
            return []
        top = np.argpartition(-dist, count - 1)[:count]  # O(V), then order the few winners
        return [int(t) for t in top[np.argsort(-dist[top], kind="stable")]]
    support = np.flatnonzero(dist > 0)
    count = min(count, len(support))
    keys = np.log(dist[support]) - np.log(-np.log(rng.random(len(support))))
    order = np.argpartition(-keys, count - 1)[:count] if count < len(support) else np.arange(len(support))
    order = order[np.argsort(-keys[order], kind="stable")]
    return [int(t) for t in support[order]]


def allocate_children(
    scores: list,  # [F] cumulative draft probability of each frontier node
    dists: list,  # [F] of [V]: each frontier node's draft distribution
    slots: int,
) -> list:
    """How many children each frontier node gets, from the draft distributions only (EAGLE-2 style).

    The value of a node's k-th child is score x (its k-th largest probability); the ``slots``
    most valuable children are kept. The counts are fixed before any child is drawn, which is
    what keeps sampled trees lossless: a rule that kept or dropped a sampled child by its own
    value would bias recursive rejection sampling.
    """
    values = []
    for node, (score, dist) in enumerate(zip(scores, dists)):
        top = dist[np.argpartition(-dist, slots - 1)[:slots]] if slots < len(dist) else dist
        values += [(score * float(p), node) for p in top if p > 0]
    values.sort(key=lambda item: -item[0])
    counts = [0] * len(scores)
    for _, node in values[:slots]:
        counts[node] += 1
    return counts


def greedy_tree_accept(
    tree: DraftTree,
    target_choice,  # expansion index -> the target's greedy token there (root = 0, after node i = i + 1)
) -> tuple[list, int]:
    """(accepted node indices along one path, the recovered or bonus token). Only visited nodes are scored."""
    kids = tree.children()
    path, expansion = [], 0
    while True:
        wanted = int(target_choice(expansion))
        match = next((child for child in kids.get(expansion, []) if tree.tokens[child] == wanted), None)
        if match is None:
            return path, wanted
        path.append(match)
        expansion = match + 1


def tree_speculative_accept(
    tree: DraftTree,
    target_dist,  # expansion index -> [V] the target's processed distribution there (root = 0, after node i = i + 1)
    rng: np.random.Generator,
    without_replacement: bool = True,
) -> tuple[list, int]:
    """Recursive rejection sampling down the tree (module docstring). Returns (path, recovered or bonus token).

    ``without_replacement=False`` applies the with-replacement correction (q kept as is), which is
    only right for children drawn independently; tests use it to show the test can fail.
    """
    kids = tree.children()
    path, expansion = [], 0
    while True:
        children = kids.get(expansion, [])
        target = np.asarray(target_dist(expansion), dtype=np.float64)
        if not children:
            return path, sample(target, rng)
        if tree.deterministic:
            accepted, target = _accept_chosen(tree, children, target, rng)
            if accepted is None:
                return path, sample(target, rng)
            path.append(accepted)
            expansion = accepted + 1
            continue
        draft = tree.draw_dists[expansion].astype(np.float64)
        accepted = None
        for child in children:
            token = tree.tokens[child]
            if rng.random() * draft[token] < target[token]:
                accepted = child
                break
            target = residual_distribution(target, draft)
            if without_replacement:
                draft = draft.copy()
                draft[token] = 0.0
                total = draft.sum()
                if total <= 0.0:
                    break
                draft /= total
        if accepted is None:
            return path, sample(target, rng)
        path.append(accepted)
        expansion = accepted + 1


def _accept_chosen(
    tree: DraftTree,
    children: list,  # node indices of one expansion's children, distinct tokens
    target: np.ndarray,  # [V] float64 the target's distribution at the expansion
    rng: np.random.Generator,
) -> tuple[int | None, np.ndarray]:
    """Deterministic children (a one-hot draft each): child c is accepted with the current target probability
    of c; on rejection c's probability goes to 0 and the rest is renormalized (the residual of a one-hot
    draft). Token t is then emitted with probability p(t) whichever children were proposed.

    Returns (the accepted child or None, the distribution to draw from when none was accepted)."""
    for child in children:
        token = tree.tokens[child]
        if rng.random() < target[token]:
            return child, target
        target = target.copy()
        target[token] = 0.0
        total = target.sum()
        if total <= 0.0:
            break
        target /= total
    return None, target
