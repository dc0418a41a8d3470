"""Suffix decoding proposals: a token tree of what followed the longest earlier match of the recent text.

The matching, the stores (the request's own prompt and output; ``SuffixCache``, recent requests' outputs shared
by a decoder's workers) and the confidence calibration are decoding/suffix_store.py's; this module decides what a
round proposes. Fixed lengths: the tree of up to ``num_draft_tokens`` nodes. "auto": the tree is cut where
another node would lower the round's expected tokens per second on this machine's measured verify costs; the
first round proposes nothing (a turn's first token after one one-token pass, as target-only's).
"""

from __future__ import annotations

from specdec.contract.limits import refeed_room
from specdec.decoding.cost_model import ObservedCosts
from specdec.decoding.proposers.base import Proposal, Proposer, ProposerEntry, RoundInput, RoundResult
from specdec.decoding.suffix_store import MAX_SUFFIX_NODES, RequestSuffix, SuffixTree, cost_cut
from specdec.decoding.tree import DraftTree


class Suffix(Proposer):
    name = "suffix"

    def __init__(self, request, resources):
        self.auto = request.auto
        self.fixed = request.num_draft_tokens
        self.store = RequestSuffix(resources.max_context, resources.suffix_cache)  # .cache: the shared store
        self.pass_costs = ObservedCosts(resources.costs()) if request.auto else None
        self.rounds = 0  # rounds played so far in this request

    def candidate(self, round: RoundInput) -> SuffixTree | None:
        """The suffix tree for this round's text, before any cost cut (None: no room)."""
        limit = min(MAX_SUFFIX_NODES if self.auto else self.fixed, round.room)
        return self.store.tree(round.state.tokens, limit, round.budget) if limit > 0 else None

    def priced(self, tree: SuffixTree | None, round: RoundInput) -> tuple[SuffixTree | None, float]:
        """(the tree cut where it stops paying, its expected tokens per second; 0 without a tree).

        The pass feeds the committed tokens the target lacks before the tree: the pending token, and rows a tree
        gave back (as many as refeed_room lets a pass of up to MAX_SUFFIX_NODES nodes carry, the rest in catch-up
        passes: rounds.py feeds by the same rule). Those rows are paid whatever is proposed, so a proposal is
        priced by the rows it adds to that pass, c(pending + k) - c(pending), on top of a one-token pass's c(1):
        the same bar as target-only decoding, which a tree's sunk rows do not lower."""
        costs = self.pass_costs.costs
        pending = max(1, min(round.target_lag, refeed_room(MAX_SUFFIX_NODES)))
        sunk = costs.verify_cost(pending) - costs.verify_cost(1)

        def pass_cost(rows: int) -> float:  # a pass of the pending token and rows - 1 proposals, sunk rows aside
            return costs.verify_cost(rows + pending - 1) - sunk

        if tree is not None and tree.tokens:
            tree = cost_cut(tree, pass_cost, 1)
        return tree, (tree.expected_tokens / pass_cost(1 + len(tree.tokens)) if tree is not None else 0.0)

    def target_only_rate(self) -> float:
        """Tokens per second of a round that proposes nothing (one one-token target pass)."""
        return 1.0 / self.pass_costs.costs.verify_cost(1)

    def proposal(self, tree: SuffixTree | None) -> Proposal | None:
        if tree is None or not tree.tokens:
            return None
        nodes = DraftTree(tokens=list(tree.tokens), parents=list(tree.parents), depths=list(tree.depths), fed=0,
                          draw_dists={}, deterministic=True)
        return Proposal(self.name, nodes, record=tree, shape="chain" if tree.is_chain() else "tree")

    def propose(self, round: RoundInput) -> Proposal | None:
        if round.budget <= 0:
            return None
        tree = self.candidate(round)
        if not self.auto:
            return self.proposal(tree)
        if self.rounds == 0:
            return None  # the first token as soon as target-only's: a one-token pass, not a wide verify
        return self.proposal(self.priced(tree, round)[0])

    def observe(self, proposal: Proposal | None, result: RoundResult) -> None:
        self.rounds += 1
        if proposal is not None and proposal.source == self.name:
            self.store.observe(proposal.record, list(result.path))

    def observe_pass(self, role: str, tokens: int, seconds: float) -> None:
        if self.pass_costs is not None:
            self.pass_costs.observe_pass(role, tokens, seconds)

    def finish(self, output: list) -> None:
        if self.store.cache is not None:  # later requests match this one's output
            self.store.cache.add(output)


PROPOSER = ProposerEntry("suffix", Suffix, "suffix decoding: the request's text and recent outputs (no draft model)",
                         rank=2, default_without_draft=True)
