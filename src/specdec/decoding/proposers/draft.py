"""The draft model's proposals: a chain of its own tokens, or a token tree grown from its confidence.

``DraftChain``: ``gamma`` tokens drafted one pass at a time, each from the draft's processed distribution
(greedy, the seed's coupled noise, or a draw for rejection sampling); with ``num_draft_tokens="auto"`` the
length comes from ``AutoDraftLength`` (decoding/cost_model.py): the measured pass costs and the running
acceptance, probe rounds paid from the decoder's ``ProbeBudget``. ``DraftTree`` (``tree=``): one draft pass per
level, each node seeing only its ancestors; children per node fixed by the shape or, for "auto", by the
draft's own distributions before any child is drawn (what keeps sampled trees exact). After verification
the draft's cache keeps only committed rows: ``truncate`` for a chain, ``keep_path`` for a tree.
"""

from __future__ import annotations

import numpy as np

from specdec.contract.limits import AUTO_MAX_DRAFT_TOKENS, MAX_TREE_NODES
from specdec.decoding.cost_model import AutoDraftLength
from specdec.decoding.proposers.base import Proposal, Proposer, ProposerEntry, RoundInput, RoundResult, chain
from specdec.decoding.rounds import catch_up
from specdec.decoding.tree import AUTO_TREE_BUDGET, AUTO_TREE_DEPTH, AUTO_TREE_WIDTH, ROOT, DraftTree, allocate_children

# auto: the longest wait between the draft's probe rounds once probes keep finding it loses (16, 32, 64, 128)
DRAFT_MAX_PROBE_EVERY = 128


class DraftChain(Proposer):
    name = "draft"
    uses_draft_model = True

    def __init__(self, request, resources):
        self.draft = resources.draft
        self.fixed = None if request.auto else request.num_draft_tokens
        self.auto = AutoDraftLength(resources.costs(), max_gamma=AUTO_MAX_DRAFT_TOKENS,
                                    max_probe_every=DRAFT_MAX_PROBE_EVERY,
                                    budget=resources.probe_budget) if request.auto else None

    def lag(self, round: RoundInput) -> int:
        """Committed tokens the draft has not read (its catch-up before it can propose)."""
        return len(round.state.tokens) - self.draft.length

    def length(self, round: RoundInput) -> int:
        """This round's chain length (auto: the controller's choice, which counts rounds and may start a probe)."""
        gamma = self.auto.choose(self.lag(round)) if self.auto is not None else self.fixed
        return min(gamma, round.budget)

    def propose(self, round: RoundInput) -> Proposal | None:
        if round.budget <= 0:
            return None
        gamma = self.length(round)
        return self.drafted(round, gamma) if gamma > 0 else None

    def drafted(self, round: RoundInput, gamma: int) -> Proposal:
        """Run the draft for ``gamma`` tokens (fewer when it proposes EOS)."""
        state, rule = round.state, round.rule
        tokens = state.tokens
        catch_up(self.draft, tokens)
        proposals, dists = [], {}
        feed = tokens[self.draft.length :]
        for step in range(gamma):
            logits = self.draft.forward(feed, range(self.draft.length, self.draft.length + len(feed)))
            self.draft.commit(len(feed))
            token, dist = rule.propose(logits[-1], state.context(proposals), len(tokens) + step, proposals)
            if dist is not None:
                dists[step] = dist
            proposals.append(token)
            if token in state.eos_ids:
                break
            feed = [token]
        return chain(self.name, proposals, dists, fed=len(proposals))

    def observe(self, proposal: Proposal | None, result: RoundResult) -> None:
        if proposal is None or proposal.source != self.name:
            return
        # the draft's cache holds tokens + proposals[:-1]; keep only what is committed
        self.draft.truncate(min(self.draft.length, result.base + result.accepted))
        if self.auto is not None:
            self.auto.observe(result.proposed, result.accepted)

    def observe_pass(self, role: str, tokens: int, seconds: float) -> None:
        if self.auto is not None:
            self.auto.observe_pass(role, tokens, seconds)


class DraftTreeProposer(Proposer):
    name = "draft"
    uses_draft_model = True

    def __init__(self, request, resources):
        self.draft = resources.draft
        self.shape = request.tree

    def propose(self, round: RoundInput) -> Proposal | None:
        if round.budget <= 0:
            return None
        tree = grow_tree(self.draft, round.state, round.rule, self.shape, round.budget)
        return Proposal(self.name, tree, shape="tree")

    def observe(self, proposal: Proposal | None, result: RoundResult) -> None:
        if proposal is not None:
            tree = proposal.tree
            self.draft.keep_path([result.base + n for n in result.path if n < tree.fed], result.base)


def grow_tree(draft, state, rule, shape, budget: int) -> DraftTree:
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


def _make(request, resources) -> Proposer:
    return DraftTreeProposer(request, resources) if request.tree is not None else DraftChain(request, resources)


PROPOSER = ProposerEntry("draft", _make, "the draft model's chains, or its token trees with tree=", needs_draft=True,
                         rank=0, accepts_tree=True)
