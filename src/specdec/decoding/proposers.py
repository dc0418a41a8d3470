"""Where each round's proposal comes from and how long it is: the draft model, prompt lookup, or none.

A ``ProposalPlan`` is built per request from the request and the machine's measured ``Costs``
(it never calls back into the decoder); it sees every pass's cost (``observe_pass``, fed by the
timing wrapper) and every round's outcome (``observe``), and answers ``propose`` with a typed
``Proposal``. Auto lengths: one controller for the draft model and one per matched n-gram size
for lookup (a 3-gram match's continuation is accepted far more often than a 1-gram's: one pooled
rate would send too few tokens after long matches and too many after short ones). Auto hybrid
takes whichever proposal promises more tokens per second this round; the draft's side is
charged the catch-up pass over the tokens lookup rounds committed since the draft last ran.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specdec.decoding.cost_model import AutoDraftLength, Costs
from specdec.decoding.lookup import MAX_NGRAM, lookup_match
from specdec.decoding.request import AUTO_MAX_DRAFT_TOKENS, Request

# auto lookup: prior acceptance per matched n-gram size (a longer match predicts its continuation better)
LOOKUP_PRIOR_ACCEPTANCE = {1: 0.3, 2: 0.5, 3: 0.7}


@dataclass(frozen=True)
class Proposal:
    source: str  # "draft" (ask the draft model for ``count`` tokens) | "lookup" (``tokens``) | "none"
    count: int
    tokens: tuple = ()  # the lookup proposal


NO_PROPOSAL = Proposal("none", 0)


def plan_uses_draft(request: Request, has_draft: bool) -> bool:
    return has_draft and request.proposer in ("draft", "hybrid") and (
        request.auto or request.num_draft_tokens > 0 or request.tree is not None)


def plan_needs_costs(request: Request, has_draft: bool) -> bool:
    """Whether the plan chooses proposal lengths from measured pass costs: "auto" chains (draft or lookup).
    A tree round sizes its tree itself and never reads them."""
    return request.auto and request.tree is None and (plan_uses_draft(request, has_draft) or plan_uses_lookup(request))


def plan_uses_lookup(request: Request) -> bool:
    return request.proposer in ("lookup", "hybrid") and request.num_draft_tokens != 0


class ProposalPlan:
    def __init__(self, request: Request, has_draft: bool, max_context: int, costs: Costs | None):
        self.request = request
        self.auto = request.auto
        self.uses_draft = plan_uses_draft(request, has_draft)
        self.uses_lookup = plan_uses_lookup(request)
        self.model_auto = None
        self.lookup_autos: dict = {}
        self.lookup_size = 0  # n-gram size of the latest lookup proposal
        if plan_needs_costs(request, has_draft):
            if costs is None:
                raise ValueError("auto proposal lengths need measured costs")
            if self.uses_draft:
                self.model_auto = AutoDraftLength(costs, max_gamma=AUTO_MAX_DRAFT_TOKENS)
            if self.uses_lookup:
                # a lookup proposal costs nothing to make: only the verify pass grows with its length
                self.lookup_autos = {
                    size: AutoDraftLength(Costs(0.0, costs.verify), max_gamma=AUTO_MAX_DRAFT_TOKENS,
                                          prior_acceptance=LOOKUP_PRIOR_ACCEPTANCE[size])
                    for size in range(1, MAX_NGRAM + 1)
                }
        self.history = np.zeros(max_context, dtype=np.int64)
        self.filled = 0

    def propose(self, tokens: list, budget: int, draft_lag: int = 0) -> Proposal:
        """This round's proposal. ``draft_lag``: committed tokens the draft model has not read yet."""
        if budget <= 0:
            return NO_PROPOSAL
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
            gamma = min(self.model_auto.choose() if self.auto else self.request.num_draft_tokens, budget)
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

    def observe_pass(self, role: str, tokens: int, seconds: float) -> None:
        if self.model_auto is not None:
            self.model_auto.observe_pass(role, tokens, seconds)
        if role == "target":
            for controller in self.lookup_autos.values():
                controller.observe_pass(role, tokens, seconds)

    def observe(self, source: str, proposed: int, accepted: int) -> None:
        controller = self.model_auto if source == "draft" else self.lookup_autos.get(self.lookup_size)
        if source in ("draft", "lookup") and controller is not None:
            controller.observe(proposed, accepted)
