"""What every proposer shares: the records that pass between a proposer, the verifier and the decoder.

A proposer (one class per module in this package) answers ``propose(round) -> Proposal | None`` each round and
learns from ``observe(proposal, result)`` after the target has verified it; ``observe_pass`` sees every timed
model pass. A ``Proposal`` is a token tree (a chain is a tree whose every node is its predecessor's child),
so the verifier (decoding/rounds.py) never asks who made it. Resources the proposers may use (the draft
model's runner, this machine's measured costs, the shared suffix store, the probe budget) come in one
``ProposerResources`` record; nothing here calls back into the decoder.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from specdec.decoding.tree import ROOT, DraftTree


@dataclass(frozen=True)
class Proposal:
    """One round's proposed tokens as a tree over the pending token (node i's parent: ``tree.parents[i]``)."""
    source: str  # the proposer that made it ("draft", "suffix", "lookup", ...); the verified tokens carry it
    tree: DraftTree  # tokens, parents, depths; draw_dists for sampled drafts, deterministic for lookup / suffix
    record: object = None  # what the proposer keeps to learn from the result (a suffix tree, an n-gram size ...)
    shape: str = "chain"  # how it is verified: "chain" (one row per token) or "tree" (a tree mask, one path kept)

    @property
    def size(self) -> int:
        return len(self.tree.tokens)


def chain(source: str, tokens, draw_dists: dict | None = None, fed: int = 0, record: object = None) -> Proposal:
    """A chain proposal: node i is the child of node i - 1 (node 0 of the pending token). ``draw_dists``: the
    draft's distribution each node was drawn from, by expansion (0: the root), for rejection sampling;
    None: deterministic tokens (one-hot 'draws')."""
    tokens = [int(t) for t in tokens]
    tree = DraftTree(tokens=tokens, parents=[ROOT] + list(range(len(tokens) - 1)) if tokens else [],
                     depths=list(range(1, len(tokens) + 1)), fed=fed, draw_dists=draw_dists or {},
                     deterministic=draw_dists is None)
    return Proposal(source, tree, record)


@dataclass(frozen=True)
class RoundResult:
    """A verified round."""
    source: str  # the proposal's source, "none" for a round without proposals
    tokens: list  # emitted: the accepted proposals, then one recovered or bonus token (the target's own)
    proposed: int  # proposals verified (a tree: its deepest level)
    accepted: int
    path: tuple = ()  # the accepted node indices, root to leaf
    base: int = 0  # len(tokens) when proposed: the absolute position of the first emitted token
    nodes: int = 0  # tree nodes verified beyond a chain's (draft or suffix trees), for the statistics


@dataclass
class RoundInput:
    """What a proposer sees of the request this round."""
    state: object  # the RequestState (tokens = prompt + committed output; the last token is pending)
    rule: object  # the TokenRule: how the draft samples a proposal (greedy, coupled noise, rejection)
    budget: int  # proposals this round may make (the round's own target token takes one more slot)
    room: int  # free cache slots after the committed tokens (bounds a tree)
    target_lag: int  # committed tokens the target has not read (1: the pending token; more after a tree gave rows back)


@dataclass(frozen=True)
class ProposerResources:
    """What a proposer may use. ``costs()`` measures this machine's pass costs on first use (then stored)."""
    max_context: int
    draft: object = None  # the draft model's timed runner, None without one (or when this request skips it)
    costs: Callable | None = None  # () -> Costs
    suffix_cache: object = None  # the decoder's SuffixCache of recent outputs (shared by its workers)
    probe_budget: object = None  # the decoder's ProbeBudget for auto's draft probes (shared by its workers)
    draft_prefill_tokens: int | None = None  # prompt tokens the draft's caches lack (None: not known)
    prefill_per_token: float | None = None  # the target's measured prefill seconds per token (None: not yet)
    draft_reopen_seconds: float = 0.0  # opening the draft's closed session again (0: it is open)


class Proposer:
    """Base class: a proposer proposing nothing. Subclasses set ``name`` and override what they need."""
    name = "none"
    uses_draft_model = False  # reads the draft model (the decoder prefills the draft for it)
    lazy_draft_prefill = False  # the draft reads the prompt in the first round that uses it, not before
    draft_skipped = False  # it could have used the draft model but chose not to (its prefill would not pay)

    def propose(self, round: RoundInput) -> Proposal | None:
        return None

    def observe(self, proposal: Proposal | None, result: RoundResult) -> None:
        pass

    def observe_pass(self, role: str, tokens: int, seconds: float) -> None:
        pass

    def finish(self, output: list) -> None:
        """The request ended with ``output`` (its new token ids)."""


@dataclass(frozen=True)
class ProposerEntry:
    """A registry row: a module of this package that defines ``PROPOSER = ProposerEntry(...)`` is a proposer."""
    name: str
    make: Callable  # (request, ProposerResources) -> Proposer
    help: str
    needs_draft: bool = False  # the request needs a bundle with a draft model (unless num_draft_tokens=0)
    rank: int = 100  # the order lists show the proposers in
    accepts_tree: bool = False  # verifies the token trees ``tree=`` asks for (and is the default with one)
    default_with_draft: bool = False  # the default proposer of a bundle with a draft model
    default_without_draft: bool = False  # the default proposer of a bundle without one
    # (request, ProposerResources, room) -> whether the draft model cannot pay for its catch-up in this conversation
    # even if the answer filled ``room`` tokens: the decoder may then free the draft's session before the prefill
    draft_cannot_pay: Callable | None = None
