"""The default proposer: each round the suffix tree, the draft model's chain or nothing, whichever promises
the most tokens per second.

Suffix trees cost nothing to make and pay where text repeats (edits, quoted code); the draft model's chains
pay where it predicts the target well and its step is cheap beside the target's. The choice uses this
machine's measured pass costs (``Suffix.priced``: the tree's expected tokens over its verify pass; the draft's
``AutoDraftLength`` estimate), and charges the draft the catch-up pass over the tokens other rounds committed
since it last ran, spread over ``DRAFT_CATCH_UP_ROUNDS`` rounds. A probe round runs the draft whatever the
estimates say (how a pessimistic estimate recovers; paid from the decoder's probe budget). The draft prefills
lazily: its cache catches up on the prompt in the first round that uses it, and a request whose draft prefill
would cost more than the draft can save (``draft_prefill_loses``) proposes by suffix matching alone.
Fixed lengths: the suffix tree when there is one, else the draft's chain.
"""

from __future__ import annotations

from specdec.decoding.proposers.base import Proposal, Proposer, ProposerEntry, RoundInput, RoundResult
from specdec.decoding.proposers.draft import DraftChain
from specdec.decoding.proposers.suffix import Suffix

DRAFT_CATCH_UP_ROUNDS = 4  # the draft's catch-up pass charged over this many rounds
DRAFT_SAVING = 0.1  # the fraction of decode time the draft model is expected to save over suffix proposals alone


class Hybrid(Proposer):
    name = "hybrid"

    def __init__(self, request, resources):
        self.auto = request.auto
        self.suffix = Suffix(request, resources)
        self.draft = None
        self.draft_skipped = False  # the draft's prefill would cost more than it saves: suffix matching alone
        if resources.draft is not None:
            if request.auto and draft_prefill_loses(request, resources):
                self.draft_skipped = True
            else:
                self.draft = DraftChain(request, resources)
        self.uses_draft_model = self.draft is not None
        self.lazy_draft_prefill = self.uses_draft_model and request.auto and request.max_new_tokens > 0

    def propose(self, round: RoundInput) -> Proposal | None:
        if round.budget <= 0:
            return None
        tree = self.suffix.candidate(round)
        gamma = self.draft.length(round) if self.draft is not None else 0
        if not self.auto:
            return self.suffix.proposal(tree) or (self.draft.drafted(round, gamma) if gamma > 0 else None)
        if self.suffix.rounds == 0:
            return None  # the first token as soon as target-only's: a one-token pass, not a wide verify
        tree, suffix_rate = self.suffix.priced(tree, round)
        if gamma > 0:
            auto = self.draft.auto
            catch_up = auto.draft_catch_up(self.draft.lag(round)) / DRAFT_CATCH_UP_ROUNDS
            if auto.probing or auto.tokens_per_second(gamma, extra_seconds=catch_up) > max(
                    suffix_rate, self.suffix.target_only_rate()):
                return self.draft.drafted(round, gamma)
        return self.suffix.proposal(tree)

    def observe(self, proposal: Proposal | None, result: RoundResult) -> None:
        self.suffix.observe(proposal, result)
        if self.draft is not None:
            self.draft.observe(proposal, result)

    def observe_pass(self, role: str, tokens: int, seconds: float) -> None:
        self.suffix.observe_pass(role, tokens, seconds)
        if self.draft is not None:
            self.draft.observe_pass(role, tokens, seconds)

    def finish(self, output: list) -> None:
        self.suffix.finish(output)


def draft_prefill_loses(request, resources, new_tokens: int | None = None) -> bool:
    """Whether prefilling the draft over what its caches lack would cost more than the draft can save: its
    prefill estimated from the target's measured prefill rate scaled by the draft/target step ratio
    (``resources.draft_prefill_tokens``: the prompt tokens the draft would compute), plus opening its session again
    if it was closed (``resources.draft_reopen_seconds``); its saving as DRAFT_SAVING of the decode time of
    ``new_tokens`` (default: the request's max_new_tokens) target steps (the draft's measured gain over lookup
    alone on a 2-core CPU was about 10%)."""
    if request.tree is not None or resources.draft_prefill_tokens is None:
        return False
    costs = resources.costs()
    per_token = resources.prefill_per_token if resources.prefill_per_token is not None else costs.verify[0] / 5
    draft_prefill = resources.draft_prefill_tokens * per_token * costs.draft_step / costs.verify[0]
    draft_prefill += resources.draft_reopen_seconds
    new_tokens = request.max_new_tokens if new_tokens is None else new_tokens
    return draft_prefill > new_tokens * costs.verify[0] * DRAFT_SAVING


def draft_cannot_pay(request, resources, room: int) -> bool:
    """Auto rounds: the draft's catch-up would cost more than it could save even over ``room`` new tokens."""
    return request.auto and draft_prefill_loses(request, resources, new_tokens=room)


PROPOSER = ProposerEntry("hybrid", Hybrid, "the default: suffix trees, the draft's chains or nothing, by expected "
                         "tokens per second", rank=3, default_with_draft=True, draft_cannot_pay=draft_cannot_pay)
