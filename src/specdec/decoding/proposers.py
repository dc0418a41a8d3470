"""Where each round's proposal comes from and how long it is: the draft model, suffix matching, prompt lookup,
or none.

A ``ProposalPlan`` is built per request from the request and the machine's measured ``Costs``
(it never calls back into the decoder); it sees every pass's cost (``observe_pass``, fed by the
timing wrapper) and every round's outcome (``observe``), and answers ``propose`` with a typed
``Proposal``. Auto lengths: one controller for the draft model and one per matched n-gram size
for lookup (a 3-gram match's continuation is accepted far more often than a 1-gram's: one pooled
rate would send too few tokens after long matches and too many after short ones).

Suffix matching (decoding/suffix.py) proposes a token tree from the request's own text and from
earlier requests' outputs, each node with a calibrated acceptance estimate; in "auto" the tree is
cut where it stops paying for its wider verify pass. Auto hybrid (the default) takes whichever of
the suffix tree, the draft model's chain and no proposal at all promises the most tokens per
second this round, from the measured pass costs; the draft's side is charged the catch-up pass
over the tokens other rounds committed since the draft last ran. The draft then prefills lazily: its cache
catches up on the prompt in the first round that uses it. The first round of an auto request proposes nothing,
so a turn's first token comes after one one-token pass, as target-only's does (a wide verify pass costs up to
12.7x one on a 2-core AVX2 CPU).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specdec.contract.limits import refeed_room
from specdec.decoding.cost_model import AutoDraftLength, Costs, ObservedCosts, ProbeBudget
from specdec.decoding.lookup import MAX_NGRAM, lookup_match
from specdec.decoding.request import AUTO_MAX_DRAFT_TOKENS, Request
from specdec.decoding.suffix import MAX_SUFFIX_NODES, RequestSuffix, SuffixCache, SuffixTree, cost_cut

DRAFT_CATCH_UP_ROUNDS = 4  # auto hybrid (suffix | draft): the draft's catch-up pass charged over this many rounds
# auto: the longest wait between the draft's probe rounds once probes keep finding it loses (16, 32, 64, 128)
DRAFT_MAX_PROBE_EVERY = 128
# auto: the share of the target's decode seconds the draft's probe rounds may spend (a decoder's ProbeBudget)
DRAFT_PROBE_SHARE = 0.03
# auto lookup: prior acceptance per matched n-gram size (a longer match predicts its continuation better)
LOOKUP_PRIOR_ACCEPTANCE = {1: 0.3, 2: 0.5, 3: 0.7}


@dataclass(frozen=True)
class Proposal:
    source: str  # "draft" (ask the draft model for ``count`` tokens) | "lookup" (``tokens``) | "suffix" (``tree``) | "none"
    count: int
    tokens: tuple = ()  # the lookup proposal
    tree: SuffixTree | None = None  # the suffix proposal


NO_PROPOSAL = Proposal("none", 0)


def plan_uses_draft(request: Request, has_draft: bool) -> bool:
    return has_draft and request.proposer in ("draft", "hybrid") and (
        request.auto or request.num_draft_tokens > 0 or request.tree is not None)


def plan_needs_costs(request: Request, has_draft: bool) -> bool:
    """Whether the plan chooses proposals from measured pass costs: "auto" with the draft's chains, lookup or
    suffix trees. A draft-tree round sizes its tree itself and never reads them."""
    return request.auto and request.tree is None and (
        plan_uses_draft(request, has_draft) or plan_uses_lookup(request) or plan_uses_suffix(request))


def plan_uses_lookup(request: Request) -> bool:
    return request.proposer == "lookup" and request.num_draft_tokens != 0


def plan_uses_suffix(request: Request) -> bool:
    return request.proposer in ("suffix", "hybrid") and request.num_draft_tokens != 0 and request.tree is None


class ProposalPlan:
    def __init__(self, request: Request, has_draft: bool, max_context: int, costs: Costs | None,
                 suffix_cache: SuffixCache | None = None, probe_budget: ProbeBudget | None = None):
        self.request = request
        self.auto = request.auto
        self.uses_draft = plan_uses_draft(request, has_draft)
        self.uses_lookup = plan_uses_lookup(request)
        self.suffix = RequestSuffix(max_context, suffix_cache) if plan_uses_suffix(request) else None
        self.pass_costs = None  # auto: the target's pass costs, following the passes the request runs
        self.model_auto = None
        self.lookup_autos: dict = {}
        self.lookup_size = 0  # n-gram size of the latest lookup proposal
        if plan_needs_costs(request, has_draft):
            if costs is None:
                raise ValueError("auto proposal lengths need measured costs")
            if self.uses_draft:
                self.model_auto = AutoDraftLength(costs, max_gamma=AUTO_MAX_DRAFT_TOKENS,
                                                  max_probe_every=DRAFT_MAX_PROBE_EVERY, budget=probe_budget)
            if self.uses_lookup:
                # a lookup proposal costs nothing to make: only the verify pass grows with its length
                self.lookup_autos = {
                    size: AutoDraftLength(Costs(0.0, costs.verify), max_gamma=AUTO_MAX_DRAFT_TOKENS,
                                          prior_acceptance=LOOKUP_PRIOR_ACCEPTANCE[size])
                    for size in range(1, MAX_NGRAM + 1)
                }
            self.pass_costs = ObservedCosts(costs)
        self.history = np.zeros(max_context if self.uses_lookup else 0, dtype=np.int64)  # lookup's copy of tokens
        self.filled = 0
        self.rounds = 0  # rounds played so far in this request

    def propose(self, tokens: list, budget: int, draft_lag: int = 0, room: int = MAX_SUFFIX_NODES,
                target_lag: int = 1) -> Proposal:
        """This round's proposal. ``draft_lag`` / ``target_lag``: committed tokens the draft / the target has not
        read yet (the target's are 1, the pending token, unless a tree gave rows back); ``room``:
        free cache slots after ``tokens`` (bounds a suffix tree)."""
        if budget <= 0:
            return NO_PROPOSAL
        if self.suffix is not None:
            return self._propose_suffix(tokens, budget, draft_lag, room, target_lag)
        found: list = []
        if self.uses_lookup:
            limit = min(AUTO_MAX_DRAFT_TOKENS if self.auto else self.request.num_draft_tokens, budget)
            if limit > 0:
                self.history[self.filled : len(tokens)] = tokens[self.filled :]  # tokens only grow: copy the new tail
                self.filled = len(tokens)
                # fixed-length hybrid trusts only 2-gram matches over the draft; auto weighs every match (below)
                min_ngram = 2 if self.uses_draft and not self.auto else 1
                found, self.lookup_size = lookup_match(self.history[: len(tokens)], limit, min_ngram=min_ngram)
                if found and self.auto:
                    found = found[: self.lookup_autos[self.lookup_size].choose()]
        gamma = 0
        if self.uses_draft:
            gamma = min(self.model_auto.choose(draft_lag) if self.auto else self.request.num_draft_tokens, budget)
        if found and gamma and self.auto:
            lookup_rate = self.lookup_autos[self.lookup_size].tokens_per_second(len(found))
            catch_up = self.model_auto.draft_catch_up(draft_lag)
            if self.model_auto.tokens_per_second(gamma, extra_seconds=catch_up) > lookup_rate:
                return Proposal("draft", gamma)
            return Proposal("lookup", len(found), tuple(found))
        if found:
            return Proposal("lookup", len(found), tuple(found))
        if gamma > 0:
            return Proposal("draft", gamma)
        return NO_PROPOSAL

    def _propose_suffix(self, tokens: list, budget: int, draft_lag: int, room: int, target_lag: int = 1) -> Proposal:
        """Suffix tree, draft chain or nothing: the most expected tokens per second (auto); fixed lengths: the
        suffix tree of up to ``num_draft_tokens`` nodes when there is one, else the draft's chain."""
        limit = min(MAX_SUFFIX_NODES if self.auto else self.request.num_draft_tokens, room)
        tree = self.suffix.tree(tokens, limit, budget) if limit > 0 else None
        gamma = 0
        if self.uses_draft:
            gamma = min(self.model_auto.choose(draft_lag) if self.auto else self.request.num_draft_tokens, budget)
        if not self.auto:
            if tree is not None and tree.tokens:
                return Proposal("suffix", len(tree.tokens), tree=tree)
            return Proposal("draft", gamma) if gamma > 0 else NO_PROPOSAL
        if self.rounds == 0:
            return NO_PROPOSAL  # the first token as soon as target-only's: a one-token pass, not a wide verify
        costs = self.pass_costs.costs
        # the pass feeds the committed tokens the target lacks before the tree: the pending token, and rows a tree
        # gave back (as many as refeed_room lets a pass of up to MAX_SUFFIX_NODES nodes carry, the rest in catch-up
        # passes: rounds.py feeds by the same rule). Those rows are paid whatever is proposed,
        # so a proposal is priced by the rows it adds to that pass, c(pending + k) - c(pending), on top of a
        # one-token pass's c(1): the same bar as target-only decoding, which a tree's sunk rows do not lower
        pending = max(1, min(target_lag, refeed_room(MAX_SUFFIX_NODES)))
        sunk = costs.verify_cost(pending) - costs.verify_cost(1)

        def pass_cost(rows: int) -> float:  # a pass of the pending token and rows - 1 proposals, sunk rows aside
            return costs.verify_cost(rows + pending - 1) - sunk

        if tree is not None and tree.tokens:
            tree = cost_cut(tree, pass_cost, 1)
        suffix_rate = tree.expected_tokens / pass_cost(1 + len(tree.tokens)) if tree is not None else 0.0
        if gamma > 0:
            # the catch-up pass is paid once, then the draft runs on: spread over DRAFT_CATCH_UP_ROUNDS rounds
            catch_up = self.model_auto.draft_catch_up(draft_lag) / DRAFT_CATCH_UP_ROUNDS
            # a probe round runs whatever the estimates say: it is how a pessimistic estimate recovers
            if self.model_auto.probing or self.model_auto.tokens_per_second(gamma, extra_seconds=catch_up) > max(
                    suffix_rate, 1.0 / costs.verify_cost(1)):
                return Proposal("draft", gamma)
        if tree is not None and tree.tokens:
            return Proposal("suffix", len(tree.tokens), tree=tree)
        return NO_PROPOSAL

    def observe_suffix(self, tree: SuffixTree, path: list) -> None:
        """A verified suffix round: ``path`` = its accepted node indices (the confidence calibration learns)."""
        if self.suffix is not None:
            self.suffix.observe(tree, path)

    def observe_pass(self, role: str, tokens: int, seconds: float) -> None:
        if self.pass_costs is not None:
            self.pass_costs.observe_pass(role, tokens, seconds)
        if self.model_auto is not None:
            self.model_auto.observe_pass(role, tokens, seconds)
        if role == "target":
            for controller in self.lookup_autos.values():
                controller.observe_pass(role, tokens, seconds)

    def observe(self, source: str, proposed: int, accepted: int) -> None:
        self.rounds += 1
        controller = self.model_auto if source == "draft" else self.lookup_autos.get(self.lookup_size)
        if source in ("draft", "lookup") and controller is not None:
            controller.observe(proposed, accepted)
