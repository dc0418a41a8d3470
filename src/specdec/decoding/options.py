"""Generation options: one frozen, validated record that the API, the CLI, the bench and every server dialect build.

``GenerationOptions`` holds what a caller chooses about one generation. Its own checks need nothing but the
values (types, ranges, a tree's shape); what needs the loaded bundle (the prompt against the context, a draft
model for ``proposer="draft"``, token ids inside the vocabulary, a constraint compiled for the tokenizer) is
``decoding.request.make_request``'s. Every failure is a ``GenerationError`` whose ``option`` names the option
and whose ``problem`` says what is wrong without repeating the name, so a server says it under its own field
name (``max_tokens must be ...``) without reading the message.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from specdec.contract.limits import MAX_DRAFT_TOKENS, MAX_SEED, MAX_TOP_LOGPROBS
from specdec.decoding.tree import parse_tree
from specdec.sampling.processors import SamplingConfig

ACCEPTANCE_RULES = ("coupled", "rejection")


class GenerationError(ValueError):
    """A request that cannot be served as given. ``option``: the option (or input) at fault, when one is;
    ``problem``: the message without that name (``str(error)`` is ``f"{option} {problem}"`` then)."""

    def __init__(self, message: str, option: str | None = None, problem: str | None = None):
        super().__init__(message)
        self.option = option
        self.problem = problem

    @classmethod
    def bad(cls, option: str, problem: str) -> "GenerationError":
        return cls(f"{option} {problem}", option, problem)


class ContextLengthError(GenerationError):
    """The prompt, the token budget and one round's proposals do not fit the loaded context."""

    def __init__(self, prompt_tokens: int, max_new_tokens: int, draft_tokens: int, max_context: int):
        self.prompt_tokens, self.max_new_tokens = prompt_tokens, max_new_tokens
        self.draft_tokens, self.max_context = draft_tokens, max_context
        super().__init__(self.describe(), "max_new_tokens")

    @property
    def needed(self) -> int:
        return self.prompt_tokens + self.max_new_tokens + self.draft_tokens + 1

    def describe(self, budget: str = "max_new_tokens") -> str:
        """The message, with the token budget under the caller's name for it (``max_tokens``, ``n_predict``)."""
        return (f"prompt ({self.prompt_tokens} tokens) + {budget} ({self.max_new_tokens}) + draft tokens "
                f"({self.draft_tokens}) + 1 = {self.needed} exceeds max_context {self.max_context}: shorten the "
                f"prompt, lower {budget}, or load with a larger max_context")


def is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def check_text(value, name: str) -> str:
    """Text a tokenizer can encode: a str without lone surrogates (valid JSON can carry them: "\\ud800")."""
    if not isinstance(value, str):
        raise GenerationError.bad(name, f"must be text, got {type(value).__name__}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise GenerationError.bad(name, f"is not valid text: {exc.reason} at character {exc.start}") from None
    return value


@dataclass(frozen=True)
class GenerationOptions:
    """How to generate. Build with keywords (``GenerationOptions(max_new_tokens=64)``) or change one with
    ``options.replace(seed=7)``; both validate. ``SpeculativeDecoder.generate(prompt, options, **changes)``
    takes one (the keywords alone build it).

    max_new_tokens: tokens to generate at most (0: prefill only, a warm-up).
    sampling: a ``SamplingConfig`` (default greedy).
    num_draft_tokens: proposals per round: "auto" (chosen each round from this machine's measured pass costs and
        the running acceptance), an integer, or 0 (target-only decoding: the baseline).
    seed: with sampling, the output is the target's own seeded sample in every mode; None: fresh randomness.
    stop: stop strings (the text ends before the first one); stop_token_ids: ids that end like EOS.
    proposer: where proposals come from (``decoding/proposers``): "draft", "lookup", "suffix", "hybrid", ...;
        None: "hybrid" (suffix trees, the draft model's chains or nothing, each round by expected tokens per
        second), "suffix" for a bundle without a draft, "draft" with a tree.
    tree: None (a chain), branching factors per depth ("4,2,2,1" or (2, 2, 1)) or "auto": a draft tree verified
        in one target pass.
    acceptance: "coupled" (default: seeded, schedule-independent) or "rejection" (modified rejection sampling).
    constraint: a ``Constraint`` the output must match (exact under speculation).
    logprobs: None, or k: each token's log-probability and its k most likely alternatives.
    """

    max_new_tokens: int = 128
    sampling: SamplingConfig | None = None
    num_draft_tokens: int | str = "auto"
    seed: int | None = None
    stop: tuple = ()
    stop_token_ids: tuple = ()
    proposer: str | None = None
    tree: tuple | str | None = None
    acceptance: str = "coupled"
    constraint: object = None
    logprobs: int | None = None

    def __post_init__(self):
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 (frozen: normalize once)
        if not is_int(self.max_new_tokens) or self.max_new_tokens < 0:
            raise GenerationError.bad("max_new_tokens", f"must be an integer >= 0 (0: prefill only), got "
                                                        f"{self.max_new_tokens!r}")
        set_("max_new_tokens", int(self.max_new_tokens))
        if self.sampling is None:
            set_("sampling", SamplingConfig())
        elif not isinstance(self.sampling, SamplingConfig):
            raise GenerationError.bad("sampling", f"must be a SamplingConfig, got {type(self.sampling).__name__}")
        if self.num_draft_tokens != "auto":
            if not is_int(self.num_draft_tokens) or not 0 <= self.num_draft_tokens <= MAX_DRAFT_TOKENS:
                raise GenerationError.bad("num_draft_tokens", f"must be \"auto\" or an integer in "
                                                              f"0..{MAX_DRAFT_TOKENS}, got {self.num_draft_tokens!r}")
            set_("num_draft_tokens", int(self.num_draft_tokens))
        if self.seed is not None:
            if not is_int(self.seed) or not 0 <= self.seed <= MAX_SEED:
                raise GenerationError.bad("seed", f"must be None or an integer in 0..2**63-1, got {self.seed!r}")
            set_("seed", int(self.seed))
        set_("stop", _stop_strings(self.stop))
        set_("stop_token_ids", _token_ids(self.stop_token_ids))
        self._check_proposer()
        if self.acceptance not in ACCEPTANCE_RULES:
            raise GenerationError.bad("acceptance", f"must be one of {', '.join(ACCEPTANCE_RULES)}, got "
                                                    f"{self.acceptance!r}")
        if self.constraint is not None:
            from specdec.decoding.constraint import Constraint

            if not isinstance(self.constraint, Constraint):
                raise GenerationError.bad("constraint", f"must be a Constraint (Constraint.json_schema(...), ...), "
                                                        f"got {type(self.constraint).__name__}")
        if self.logprobs is not None:
            if not is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
                raise GenerationError.bad("logprobs", f"must be None or an integer in 0..{MAX_TOP_LOGPROBS} "
                                                      f"(alternatives per token), got {self.logprobs!r}")
            set_("logprobs", int(self.logprobs))

    def _check_proposer(self) -> None:
        from specdec.decoding.proposers import proposer_names

        names = proposer_names()
        if self.proposer is not None and self.proposer not in names:
            raise GenerationError.bad("proposer", f"must be one of {', '.join(names)}, got {self.proposer!r}")
        tree = self.tree
        if tree is not None and (isinstance(tree, (bytes, bytearray)) or not isinstance(tree, (str, Sequence))):
            raise GenerationError.bad("tree", f"must be \"auto\", a shape like \"2,2,1\" or a list of branching "
                                              f"factors, got {tree!r}")
        try:
            object.__setattr__(self, "tree", parse_tree(tree))
        except (ValueError, TypeError) as exc:
            message = str(exc).splitlines()[0]
            raise GenerationError(message, "tree", message.removeprefix("tree ")) from None
        if self.tree is not None:
            if self.num_draft_tokens == 0:
                raise GenerationError.bad("tree", "needs speculation: num_draft_tokens=0 means target-only decoding")
            from specdec.decoding.proposers import proposer_entries

            entries = proposer_entries()
            if self.proposer is not None and not entries[self.proposer].accepts_tree:
                takes = next(name for name, row in entries.items() if row.accepts_tree)
                raise GenerationError.bad("tree", f"drafting needs a draft model and proposer=\"{takes}\"")

    @property
    def auto(self) -> bool:
        return self.num_draft_tokens == "auto"

    def replace(self, **changes) -> "GenerationOptions":
        """A copy with ``changes`` applied (validated); an unknown name is a GenerationError naming it."""
        known = {f.name for f in dataclasses.fields(self)}
        for name in changes:
            if name not in known:
                raise GenerationError.bad(name, f"is not a generation option (known: {', '.join(sorted(known))})")
        return dataclasses.replace(self, **changes) if changes else self

    @classmethod
    def build(cls, options: "GenerationOptions | None" = None, **changes) -> "GenerationOptions":
        """``options`` (default: the defaults) with ``changes`` applied: what the API's keywords become."""
        if options is not None and not isinstance(options, GenerationOptions):
            raise GenerationError.bad("options", f"must be a GenerationOptions, got {type(options).__name__}")
        return (options if options is not None else cls()).replace(**changes)


def _stop_strings(stop) -> tuple:
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = (stop,)  # a bare string is one stop string, not its characters
    if not isinstance(stop, (Sequence, set, frozenset)) or not all(isinstance(s, str) for s in stop):
        raise GenerationError.bad("stop", f"must be a string or a list of strings, got {stop!r}")
    if any(not s for s in stop):
        raise GenerationError.bad("stop", "strings must be non-empty")
    for index, text in enumerate(stop):
        check_text(text, f"stop[{index}]" if len(stop) > 1 else "stop")
    return tuple(dict.fromkeys(stop))


def _token_ids(ids) -> tuple:
    if isinstance(ids, (str, bytes)) or not isinstance(ids, (Sequence, set, frozenset)):
        raise GenerationError.bad("stop_token_ids", f"must be a list of token ids, got {ids!r}")
    if not all(is_int(t) and t >= 0 for t in ids):
        raise GenerationError.bad("stop_token_ids", "must be integers >= 0")
    return tuple(dict.fromkeys(int(t) for t in ids))

