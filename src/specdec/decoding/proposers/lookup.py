"""Prompt lookup (n-gram) proposals: what followed the latest earlier occurrence of the text's last n-gram.

Saxena 2023, "Prompt Lookup Decoding"; the same idea as llama.cpp's n-gram drafting. The proposal is
deterministic, i.e. a one-hot draft distribution, so the acceptance rule stays exact: a proposed token d is
accepted with the target's probability of d, and on rejection the residual is the target distribution with
d removed. No draft model is needed. With ``num_draft_tokens="auto"`` one length controller per matched
n-gram size: a 3-gram match's continuation is accepted far more often than a 1-gram's, and one pooled rate
would send too few tokens after long matches and too many after short ones.
"""

from __future__ import annotations

import numpy as np

from specdec.contract.limits import AUTO_MAX_DRAFT_TOKENS
from specdec.decoding.cost_model import AutoDraftLength, Costs
from specdec.decoding.proposers.base import Proposal, Proposer, ProposerEntry, RoundInput, RoundResult, chain

MAX_NGRAM = 3
# auto: prior acceptance per matched n-gram size (a longer match predicts its continuation better)
LOOKUP_PRIOR_ACCEPTANCE = {1: 0.3, 2: 0.5, 3: 0.7}


def lookup_match(
    tokens: np.ndarray,  # [N] int64: the committed sequence (prompt + output)
    max_tokens: int,
    max_ngram: int = MAX_NGRAM,
    min_ngram: int = 1,
) -> tuple[list[int], int]:
    """(up to ``max_tokens`` ids that followed the most recent earlier match of the longest suffix n-gram,
    the n-gram size it matched; 0 when none)."""
    length = len(tokens)
    if max_tokens <= 0 or length < 2:
        return [], 0
    for size in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        suffix = tokens[length - size :]
        # candidate starts of earlier occurrences (the suffix itself, at length - size, is excluded)
        window = np.lib.stride_tricks.sliding_window_view(tokens[: length - 1], size)
        matches = np.flatnonzero((window == suffix).all(axis=1))
        matches = matches[matches < length - size]
        if len(matches):
            start = int(matches[-1]) + size
            return [int(t) for t in tokens[start : start + max_tokens]], size
    return [], 0


class Lookup(Proposer):
    name = "lookup"

    def __init__(self, request, resources):
        self.limit = AUTO_MAX_DRAFT_TOKENS if request.auto else request.num_draft_tokens
        self.autos = {}
        if request.auto:
            costs = resources.costs()
            # a lookup proposal costs nothing to make: only the verify pass grows with its length
            self.autos = {size: AutoDraftLength(Costs(0.0, costs.verify), max_gamma=AUTO_MAX_DRAFT_TOKENS,
                                                prior_acceptance=LOOKUP_PRIOR_ACCEPTANCE[size])
                          for size in range(1, MAX_NGRAM + 1)}
        self.history = np.zeros(resources.max_context, dtype=np.int64)  # a copy of the tokens, grown as they grow
        self.filled = 0

    def propose(self, round: RoundInput) -> Proposal | None:
        limit = min(self.limit, round.budget)
        if limit <= 0:
            return None
        tokens = round.state.tokens
        self.history[self.filled : len(tokens)] = tokens[self.filled :]  # tokens only grow: copy the new tail
        self.filled = len(tokens)
        found, size = lookup_match(self.history[: len(tokens)], limit)
        if found and self.autos:
            found = found[: self.autos[size].choose()]
        return chain(self.name, found, record=size) if found else None

    def observe(self, proposal: Proposal | None, result: RoundResult) -> None:
        if proposal is not None and self.autos:
            self.autos[proposal.record].observe(result.proposed, result.accepted)

    def observe_pass(self, role: str, tokens: int, seconds: float) -> None:
        if role == "target":
            for controller in self.autos.values():
                controller.observe_pass(role, tokens, seconds)


PROPOSER = ProposerEntry("lookup", Lookup, "n-gram prompt lookup (no draft model)", rank=1)
