"""One speculative round as a plain function of explicit inputs, returning a typed ``Round``.

Legend (chain):
  tokens     the committed sequence (prompt + output); its last token is *pending*: the target
             has not yet seen it, so its logits are unknown
  proposals  gamma tokens proposed after ``tokens`` (by the draft model or by lookup)
  rows       target logits for [pending, p_1 .. p_gamma]: row i scores the token after p_1..p_i,
             row i checks p_{i+1}, row gamma gives the bonus token
Each runner's feed is ``tokens[runner.length:]`` (the pending token, plus one more when the draft
must catch up on last round's final token) followed by the round's candidates. After acceptance
each cache keeps only rows of committed tokens (``truncate`` / ``keep_path``): rollback is moving
a length. A round emits the accepted proposals plus one target token (recovered or bonus).

The runners passed in are already timed (runtime/timing.py): no timing happens here.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specdec.decoding.proposers import Proposal
from specdec.contract.limits import MAX_TREE_NODES, PREFILL_CHUNK, refeed_room  # noqa: F401
from specdec.decoding.request import RequestState
from specdec.decoding.rules import TokenRule
from specdec.decoding.tree import AUTO_TREE_BUDGET, AUTO_TREE_DEPTH, AUTO_TREE_WIDTH, ROOT, DraftTree, allocate_children



@dataclass(frozen=True)
class Round:
    source: str  # "draft" | "lookup" | "suffix" | "tree" | "none"
    tokens: list  # emitted: the accepted proposals, then one recovered or bonus token
    proposed: int  # proposals verified (tree: the accepted path's depth budget = deepest level)
    accepted: int


def catch_up(runner, tokens: list, leave: int = 2) -> None:
    """Feed, in chunks, the tokens the runner's cache lacks, leaving at most the last ``leave`` for the next pass."""
    while runner.length < len(tokens) - leave:
        chunk = tokens[runner.length : min(len(tokens) - leave, runner.length + PREFILL_CHUNK)]
        runner.forward(chunk, range(runner.length, runner.length + len(chunk)), last_logits_only=True)
        runner.commit(len(chunk))


def draft_chain(draft, state: RequestState, rule: TokenRule, gamma: int) -> tuple[list, list]:
    """The draft's ``gamma`` proposals and (rejection sampling) the distributions it drew them from."""
    tokens = state.tokens
    catch_up(draft, tokens)
    proposals, dists = [], []
    feed = tokens[draft.length :]
    for step in range(gamma):
        logits = draft.forward(feed, range(draft.length, draft.length + len(feed)))
        draft.commit(len(feed))
        token, dist = rule.propose(logits[-1], state.context(proposals), len(tokens) + step, proposals)
        if dist is not None:
            dists.append(dist)
        proposals.append(token)
        if token in state.eos_ids:
            break
        feed = [token]
    return proposals, dists


def chain_round(target, draft, state: RequestState, rule: TokenRule, proposal: Proposal) -> Round:
    """Propose (draft model / lookup / a suffix chain / nothing), verify in ONE target pass, accept."""
    tokens = state.tokens
    if proposal.source == "draft":
        proposals, draft_dists = draft_chain(draft, state, rule, proposal.count)
    else:
        proposals = list(proposal.tokens)
        draft_dists = rule.sampled_rows(proposals, state.vocab_size)
    catch_up(target, tokens, leave=refeed_room(len(proposals)))
    feed = tokens[target.length :] + proposals
    logits = target.forward(feed, range(target.length, target.length + len(feed)))
    rows = logits[len(feed) - len(proposals) - 1 :]  # [gamma + 1, V]
    contexts = [state.context(proposals[:i]) for i in range(len(proposals) + 1)]
    accepted, next_token = rule.verify_chain(rows, contexts, proposals, draft_dists, len(tokens))
    target.commit(len(feed) - len(proposals) + accepted)
    if proposal.source == "draft":
        # the draft's cache holds tokens + proposals[:-1]; keep only what is committed
        draft.truncate(min(draft.length, len(tokens) + accepted))
    return Round(proposal.source, proposals[:accepted] + [next_token], len(proposals), accepted)


def grow_tree(draft, state: RequestState, rule: TokenRule, shape, budget: int) -> DraftTree:
    """Draft a tree level by level: one draft pass per level, each node seeing only its ancestors."""
    tokens = state.tokens
    catch_up(draft, tokens)
    feed = tokens[draft.length :]
    logits = draft.forward(feed, range(draft.length, draft.length + len(feed)))
    draft.commit(len(feed))
    base = draft.length  # == len(tokens): tree node i is written at slot base + i
    tree = DraftTree(tokens=[], parents=[], depths=[], fed=0, draw_dists={})
    tree.draw_dists[0] = rule.node_distribution(logits[-1], state.context(), [])
    dynamic = shape == "auto"
    widths = [AUTO_TREE_WIDTH] * AUTO_TREE_DEPTH if dynamic else list(shape)
    frontier = [(ROOT, [], 1.0)]  # (node, path tokens, cumulative draft probability)
    for depth, width in enumerate(widths, start=1):
        if dynamic:  # children per node from the draft's confidence, within the node budget
            slots = min(AUTO_TREE_WIDTH, AUTO_TREE_BUDGET - len(tree.tokens))
            counts = allocate_children([f[2] for f in frontier], [tree.draw_dists[f[0] + 1] for f in frontier], slots)
        else:
            counts = [width] * len(frontier)
        candidates = []
        for (parent, path, score), count in zip(frontier, counts):
            dist = tree.draw_dists[parent + 1]
            # children at this depth land at absolute position len(tokens) + depth - 1
            for token in rule.children(dist, count, len(tokens) + depth - 1):
                candidates.append((parent, path + [token], score * float(dist[token])))
        room = MAX_TREE_NODES - len(tree.tokens)
        candidates = [c for c in candidates if len(c[1]) <= budget][: max(room, 0)]
        if not candidates:
            break
        first = len(tree.tokens)
        for parent, path, _ in candidates:
            tree.tokens.append(path[-1])
            tree.parents.append(parent)
            tree.depths.append(depth)
        last_level = depth == len(widths) or (dynamic and len(tree.tokens) >= AUTO_TREE_BUDGET)
        if last_level or depth >= budget:
            break
        level = range(first, len(tree.tokens))
        visible_past = np.zeros((len(level), draft.length), dtype=bool)
        visible_past[:, :base] = True
        for row, node in enumerate(level):
            for ancestor in tree.path_to(node)[:-1]:
                visible_past[row, base + ancestor] = True
        logits = draft.forward([tree.tokens[n] for n in level], [base - 1 + depth] * len(level),
                               parents=[-1] * len(level), visible_past=visible_past)
        draft.commit(len(level))
        tree.fed = len(tree.tokens)
        frontier = []
        for row, (node, (parent, path, score)) in enumerate(zip(level, candidates)):
            tree.draw_dists[node + 1] = rule.node_distribution(logits[row], state.context(path), path)
            frontier.append((node, path, score))
    return tree


def tree_round(target, draft, state: RequestState, rule: TokenRule, shape, budget: int) -> tuple[Round, int]:
    """Grow a draft tree, verify it in ONE target pass, accept a path, compact both caches.

    Returns (the round, tree nodes verified)."""
    tokens = state.tokens
    tree = grow_tree(draft, state, rule, shape, budget)
    path, next_token = verify_tree(target, state, rule, tree)
    draft_first = len(tokens)
    draft.keep_path([draft_first + n for n in path if n < tree.fed], draft_first)
    accepted_tokens = [tree.tokens[n] for n in path]
    return Round("tree", accepted_tokens + [next_token], max(tree.depths, default=0), len(path)), len(tree.tokens)


def verify_tree(target, state: RequestState, rule: TokenRule, tree: DraftTree) -> tuple[list, int]:
    """Verify ``tree`` (children of the pending token and their descendants) in ONE target pass, accept one
    path, and compact the target's cache to it. Returns (accepted node indices, recovered or bonus token)."""
    tokens = state.tokens
    catch_up(target, tokens, leave=refeed_room(len(tree.tokens)))
    prefix = tokens[target.length :]
    start = target.length
    root_row = len(prefix) - 1
    feed = prefix + tree.tokens
    parents = list(range(-1, len(prefix) - 1)) + [root_row if p == ROOT else len(prefix) + p for p in tree.parents]
    positions = list(range(start, start + len(prefix))) + [start + root_row + d for d in tree.depths]
    logits = target.forward(feed, positions, parents=parents)

    def path_tokens(expansion):
        return [] if expansion == 0 else [tree.tokens[n] for n in tree.path_to(expansion - 1)]

    path, next_token = rule.verify_tree(
        tree,
        row=lambda e: logits[root_row + e],
        context_at=lambda e: state.context(path_tokens(e)),
        position_at=lambda e: len(tokens) + (0 if e == 0 else tree.depths[e - 1]),
    )
    # KV compaction: the accepted path's rows move next to the committed ones; nothing else moves
    target_first = start + len(prefix)
    target.keep_path([target_first + n for n in path], target_first)
    redo = target.first_inexact(target_first)
    if redo is not None:
        # a node that skipped an earlier sibling saw a mask other than a chain's: its row is never offered to a
        # later request (Runner.held_prefix), so a chat's next turn would compute everything from it again.
        # Give such rows back: the next pass recomputes them as chain rows, beside its own proposals
        target.truncate(redo)
    return path, next_token


def suffix_round(target, state: RequestState, rule: TokenRule, proposal: Proposal) -> tuple[Round, list]:
    """Verify a suffix proposal tree (deterministic tokens) in ONE target pass. Returns (the round, accepted
    node indices). A chain-shaped proposal goes through ``chain_round``."""
    tree = proposal.tree
    if tree.is_chain():
        played = chain_round(target, None, state, rule, Proposal("suffix", len(tree.tokens), tree.tokens))
        return played, list(range(played.accepted))
    draft_tree = DraftTree(tokens=list(tree.tokens), parents=list(tree.parents), depths=list(tree.depths), fed=0,
                           draw_dists={}, deterministic=True)
    path, next_token = verify_tree(target, state, rule, draft_tree)
    accepted_tokens = [tree.tokens[n] for n in path]
    return Round("suffix", accepted_tokens + [next_token], max(tree.depths), len(path)), path
