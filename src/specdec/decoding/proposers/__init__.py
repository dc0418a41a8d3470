"""Where proposals come from: one module per proposer, found by the registry below.

A module of this package that defines ``PROPOSER = ProposerEntry(name, make, help, ...)`` is a proposer: the
API's ``proposer=`` choices, the CLI's ``--proposer``, the server's ``proposer`` field and the bench's modes
all read this registry, so adding a proposer is adding one module (and its tests). ``base.py`` holds the
records every proposer shares; ``make_proposer`` builds the one a request asks for.

- ``draft`` (draft.py): the draft model's chains (fixed or "auto" lengths), or its token trees with ``tree=``;
- ``lookup`` (lookup.py): n-gram prompt lookup;
- ``suffix`` (suffix.py): suffix decoding over the request's own text and recent requests' outputs;
- ``hybrid`` (hybrid.py, the default): each round the suffix tree, the draft's chain or nothing, whichever
  promises the most tokens per second from this machine's measured pass costs.
"""

from __future__ import annotations

from functools import lru_cache

from specdec.contract.package_modules import package_modules
from specdec.decoding.proposers.base import (Proposal, Proposer, ProposerEntry, ProposerResources, RoundInput,
                                             RoundResult, chain)

__all__ = ["Proposal", "Proposer", "ProposerEntry", "ProposerResources", "RoundInput", "RoundResult", "chain",
           "default_proposer", "make_proposer", "proposer_entries", "proposer_names"]


@lru_cache(maxsize=1)
def proposer_entries() -> dict:
    """name -> ProposerEntry of every proposer module in this package, in their declared order."""
    found = [module.PROPOSER for module in package_modules(__name__, __path__)
             if isinstance(getattr(module, "PROPOSER", None), ProposerEntry)]
    return {entry.name: entry for entry in sorted(found, key=lambda entry: (entry.rank, entry.name))}


def proposer_names() -> tuple:
    return tuple(proposer_entries())


def default_proposer(has_draft: bool, tree) -> str:
    """The proposer a request that names none gets: the one that verifies trees when it asks for one, else the
    registry's default for a bundle with (or without) a draft model."""
    entries = proposer_entries().values()
    if tree is not None:
        return next(entry.name for entry in entries if entry.accepts_tree)
    return next(entry.name for entry in entries
                if (entry.default_with_draft if has_draft else entry.default_without_draft))


def make_proposer(request, resources: ProposerResources) -> Proposer:
    """The proposer ``request`` asks for (``request.proposer`` is resolved by make_request); target-only
    decoding (``num_draft_tokens=0``) proposes nothing."""
    if request.num_draft_tokens == 0:
        return Proposer()
    return proposer_entries()[request.proposer].make(request, resources)
