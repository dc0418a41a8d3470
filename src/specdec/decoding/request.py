"""One request: its validated options (``Request``) and its state while it runs (``RequestState``).

``make_request`` turns the public API's arguments into a frozen ``Request`` or raises a
one-line ``GenerationError`` naming the argument. ``RequestState`` owns everything that
changes while the request runs: the sequence, the ids the repetition penalty sees, the
randomness (the seed's per-position noise, or an RNG for ``acceptance="rejection"``), the text
and its stop strings, the statistics. ``commit`` applies a round's tokens: EOS and stop ids,
stop strings, the token budget.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from specdec.contract.limits import AUTO_MAX_DRAFT_TOKENS, MAX_SEED, MAX_TREE_NODES
from specdec.decoding.options import (ContextLengthError, GenerationError, GenerationOptions, check_text,  # noqa: F401
                                      is_int)
from specdec.decoding.text.codec import StopStrings, TextCodec
from specdec.decoding.tree import AUTO_TREE_BUDGET, tree_size
from specdec.sampling.coupling import PositionNoise
from specdec.sampling.processors import SamplingConfig


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose keys/values the target's cache already held (not computed)
    draft_cached_tokens: int = 0  # the same for the draft's cache (when the request uses the draft)
    draft_skipped: bool = False  # the draft's prefill would have cost more than it saves: suffix matching alone proposed
    new_tokens: int = 0
    rounds: int = 0
    target_forwards: int = 0  # every target pass, the prefill's included
    prefill_forwards: int = 0  # the target passes of the prefill (the rest are the decode loop's)
    draft_forwards: int = 0
    proposed: int = 0
    accepted: int = 0
    rejected_rounds: int = 0  # rounds that proposed tokens and rejected one (the per-token estimator's count)
    rounds_by_source: dict = field(default_factory=dict)  # proposer name ("draft", "suffix", ...) -> rounds it proposed
    tree_nodes: int = 0  # tree nodes verified (draft trees, and suffix proposals that branch)
    grammar_masks: int = 0  # token masks the constraint engine computed (with a constraint)
    grammar_seconds: float = 0.0  # time computing them (part of host_seconds)
    prefill_seconds: float = 0.0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    decode_seconds: float = 0.0  # wall time of the decode loop (after prefill)

    @property
    def decode_forwards(self) -> int:
        """Target passes of the decode loop: one verify pass a round (plus a rare catch-up pass in a round whose
        proposal leaves no room to refeed what the target lacks)."""
        return self.target_forwards - self.prefill_forwards

    @property
    def lookup_rounds(self) -> int:
        """Rounds whose proposal came from prompt lookup."""
        return self.rounds_by_source.get("lookup", 0)

    @property
    def suffix_rounds(self) -> int:
        """Rounds whose proposal came from suffix matching (the request's text or earlier outputs)."""
        return self.rounds_by_source.get("suffix", 0)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def token_acceptance(self) -> float:
        """Per-token acceptance of the geometric model (maximum likelihood): accepted / (accepted + rejections)."""
        total = self.accepted + self.rejected_rounds
        return self.accepted / total if total else 0.0

    @property
    def mean_accepted_per_round(self) -> float:
        """Draft tokens accepted per target verify pass (each round also emits one target token)."""
        return self.accepted / self.rounds if self.rounds else 0.0

    @property
    def host_seconds(self) -> float:
        """Decode-loop time outside the model runs: sampling, acceptance, bookkeeping."""
        return max(0.0, self.decode_seconds - self.draft_seconds - self.verify_seconds)

    @property
    def tokens_per_s(self) -> float:
        """Decode speed: new tokens per second of the decode loop (prefill excluded)."""
        return self.new_tokens / self.decode_seconds if self.decode_seconds > 0 else 0.0

    def as_dict(self) -> dict:
        names = ("acceptance_rate", "token_acceptance", "mean_accepted_per_round", "host_seconds", "tokens_per_s",
                 "lookup_rounds", "suffix_rounds", "decode_forwards")
        return {**self.__dict__, "rounds_by_source": dict(self.rounds_by_source),
                **{name: getattr(self, name) for name in names}}

    def summary(self) -> str:
        return (
            f"{self.new_tokens} tokens, {self.tokens_per_s:.1f} tok/s decode, "
            f"acceptance {self.acceptance_rate:.2f} ({self.accepted}/{self.proposed}), "
            f"{self.mean_accepted_per_round:.2f} accepted/round, target passes {self.target_forwards}, "
            f"draft passes {self.draft_forwards}, time draft {self.draft_seconds:.2f}s verify {self.verify_seconds:.2f}s "
            f"host {self.host_seconds:.2f}s prefill {self.prefill_seconds:.2f}s"
        )


@dataclass(frozen=True)
class PrefillProgress:
    """How far a request's prompt has been read (llama-server's ``prompt_progress``), reported before any chunk
    is computed and after each: ``total`` prompt tokens, ``cached`` of them reused from a cache, ``processed`` so
    far (the reused ones included; ``total`` once the prompt is read: the last token or two, computed with the
    first round, count as read), ``seconds`` since the prefill began."""
    total: int
    cached: int
    processed: int
    seconds: float


@dataclass
class GenerationResult:
    text: str
    token_ids: list  # new tokens only; includes EOS (or the stop token / the token completing a stop string)
    stats: GenerationStats
    finish_reason: str  # "eos" | "length" | "stop"
    logprobs: list | None = None  # with generate(logprobs=k): one TokenLogprob per token id (decoding/constraint.py)
    sources: list | None = None  # per token id: the proposer whose accepted proposal it was, or "target"
    stop_string: str | None = None  # the stop string the text ended at (finish_reason "stop" by a stop string)


@dataclass(frozen=True)
class Request:
    """A request checked against the loaded bundle (``make_request``): the caller's ``GenerationOptions`` carried
    whole, and what the check resolved from them (the proposer, the compiled constraint). The loop reads the
    options through the properties below."""
    prompt_ids: tuple
    options: GenerationOptions
    proposer: str  # options.proposer, or the registry's default for this bundle (proposers.default_proposer)
    constraint: object = None  # a CompiledConstraint (decoding/constraint.py): the output matches its grammar

    @property
    def max_new_tokens(self) -> int:
        return self.options.max_new_tokens

    @property
    def sampling(self) -> SamplingConfig:
        return self.options.sampling

    @property
    def num_draft_tokens(self) -> int | str:  # or "auto"
        return self.options.num_draft_tokens

    @property
    def auto(self) -> bool:
        return self.options.auto

    @property
    def seed(self) -> int | None:
        return self.options.seed

    @property
    def stop(self) -> tuple:
        return self.options.stop

    @property
    def tree(self) -> tuple | str | None:  # branching factors per depth, "auto", or None (a chain)
        return self.options.tree

    @cached_property  # read every round (RequestState.commit): made once
    def stop_token_ids(self) -> frozenset:  # e.g. a chat template's end-of-turn token: ends like EOS
        return frozenset(self.options.stop_token_ids)

    @property
    def acceptance(self) -> str:  # how sampled proposals are verified (see sampling/coupling.py)
        return self.options.acceptance

    @property
    def logprobs(self) -> int | None:  # None: off; k: each token's logprob and its k most likely alternatives
        return self.options.logprobs


@dataclass(frozen=True)
class Limits:
    """What the loaded decoder can serve: checked against every request."""
    vocab_size: int
    max_context: int
    has_draft: bool
    eos_ids: frozenset = frozenset()  # the target's EOS ids (a grammar allows them where it may end)


def _prompt_ids(prompt, codec: TextCodec, vocab: int) -> tuple:
    if isinstance(prompt, str):
        if not prompt:
            raise GenerationError.bad("prompt", "is empty: give some text or token ids")
        check_text(prompt, "prompt")
        ids = codec.encode(prompt)
    elif isinstance(prompt, np.ndarray):
        if prompt.ndim != 1 or not np.issubdtype(prompt.dtype, np.integer):
            raise GenerationError.bad("prompt", f"token ids must be a 1-D integer array, got shape {prompt.shape} "
                                                f"{prompt.dtype}")
        ids = [int(t) for t in prompt]
    elif isinstance(prompt, Sequence) and not isinstance(prompt, (bytes, bytearray)):
        if not all(is_int(t) for t in prompt):
            bad = next(t for t in prompt if not is_int(t))
            raise GenerationError.bad("prompt", f"token ids must be integers, got {bad!r}")
        ids = [int(t) for t in prompt]
    else:
        raise GenerationError.bad("prompt", f"must be text or a list of token ids, got {type(prompt).__name__}")
    if not ids:
        raise GenerationError.bad("prompt", "is empty: give some text or token ids")
    if any(t < 0 or t >= vocab for t in ids):
        raise GenerationError.bad("prompt", f"token ids must be in 0..{vocab - 1}")
    return tuple(ids)


def make_request(codec: TextCodec, limits: Limits, prompt, options: GenerationOptions) -> Request:
    """Check ``options`` against the loaded bundle (a draft for the proposer, token ids in the vocabulary, the
    constraint compiled for its tokenizer, the prompt within the context) into a ``Request``; every error is a
    GenerationError naming its option."""
    from specdec.decoding.proposers import default_proposer, proposer_entries

    if not isinstance(options, GenerationOptions):
        raise GenerationError.bad("options", f"must be a GenerationOptions, got {type(options).__name__}")
    proposer, tree = options.proposer, options.tree
    if proposer is None:
        proposer = default_proposer(limits.has_draft, tree)
    longest = AUTO_MAX_DRAFT_TOKENS if options.auto else options.num_draft_tokens
    if tree is not None:
        if not limits.has_draft:
            raise GenerationError.bad("tree", "drafting needs a draft model and proposer=\"draft\"")
        nodes = AUTO_TREE_BUDGET if tree == "auto" else tree_size(tree)
        if nodes > MAX_TREE_NODES:
            raise GenerationError.bad("tree", f"of {nodes} nodes exceeds the {MAX_TREE_NODES} nodes one pass may "
                                              "verify")
        longest = max(longest, nodes)
    if proposer_entries()[proposer].needs_draft and not limits.has_draft and options.num_draft_tokens != 0:
        others = [name for name, entry in proposer_entries().items() if not entry.needs_draft]
        raise GenerationError.bad("proposer", f"{proposer!r} needs a draft model, and this bundle has no draft "
                                              f"model: use {' or '.join(map(repr, others))}, or num_draft_tokens=0")
    if any(t >= limits.vocab_size for t, _ in options.sampling.logit_bias):
        raise GenerationError.bad("logit_bias", f"token ids must be in 0..{limits.vocab_size - 1}")
    if any(t >= limits.vocab_size for t in options.stop_token_ids):
        raise GenerationError.bad("stop_token_ids", f"must be integers in 0..{limits.vocab_size - 1}")
    compiled = None
    if options.constraint is not None:
        from specdec.decoding.constraint import ConstraintError, compile_constraint

        try:
            compiled = compile_constraint(options.constraint, codec, limits.vocab_size, limits.eos_ids)
        except ConstraintError as exc:
            message = str(exc).removeprefix("constraint").lstrip(": ")
            raise GenerationError(f"constraint: {message}", "constraint", f"is not usable: {message}") from None
    prompt_ids = _prompt_ids(prompt, codec, limits.vocab_size)
    needed = len(prompt_ids) + options.max_new_tokens + longest + 1
    if needed > limits.max_context:
        raise ContextLengthError(len(prompt_ids), options.max_new_tokens, longest, limits.max_context)
    return Request(prompt_ids, options, proposer, compiled)


@dataclass
class RequestState:
    """Everything that changes while one request runs. ``tokens`` = prompt + committed output."""

    request: Request
    codec: TextCodec
    eos_ids: frozenset
    vocab_size: int
    tokens: list = field(default_factory=list)
    seen: set = field(default_factory=set)  # unique ids in the sequence (the repetition penalty's context)
    sources: list = field(default_factory=list)  # per output token: the proposer whose proposal it was, or "target"
    stats: GenerationStats = field(default_factory=GenerationStats)
    finish: str = ""  # "" while running, then "eos" | "stop" | "length"

    def __post_init__(self):
        request = self.request
        self.tokens = list(request.prompt_ids)
        self.seen = set(self.tokens)
        self.stats.prompt_tokens = len(self.tokens)
        seed = request.seed if request.seed is not None else int(np.random.SeedSequence().entropy % (MAX_SEED + 1))
        self.noise = PositionNoise(seed, self.vocab_size)  # coupled sampling: noise per absolute position
        self.rng = np.random.default_rng(seed)  # acceptance="rejection": draws in the order the rounds make them
        self.text = StopStrings(self.codec, request.stop)
        self.guide = None  # the grammar's state (decoding/constraint.py), with a constraint
        if request.constraint is not None:
            from specdec.decoding.constraint import GrammarGuide

            self.guide = GrammarGuide(request.constraint, lambda: self.output, self.eos_ids,
                                      request.stop_token_ids, self.stats)
        self.logprobs = {} if request.logprobs is not None else None  # absolute position -> TokenLogprob
        if request.max_new_tokens == 0:  # a warm-up: prefill into the cache, generate nothing
            self.finish = "length"

    @property
    def produced(self) -> int:
        return len(self.tokens) - len(self.request.prompt_ids)

    @property
    def budget(self) -> int:
        """Proposals this round may make: the round's own target token needs one of the remaining slots."""
        return self.request.max_new_tokens - self.produced - 1

    @property
    def output(self) -> list:
        return self.tokens[len(self.request.prompt_ids):]

    @property
    def output_logprobs(self) -> list | None:
        """One TokenLogprob per output token (with ``logprobs``), else None."""
        if self.logprobs is None:
            return None
        start = len(self.request.prompt_ids)
        return [self.logprobs[p] for p in range(start, len(self.tokens))]

    def context(self, candidates=()) -> np.ndarray:
        """[N] unique ids a position sees for the repetition penalty: the sequence plus earlier candidates."""
        if self.request.sampling.repetition_penalty == 1.0:
            return _EMPTY
        return np.fromiter(self.seen.union(candidates), dtype=np.int64)

    def commit(self, new_tokens: list, source: str = "none") -> str:
        """Append a round's tokens (the accepted proposals from ``source``, then the target's own token), cut at EOS /
        a stop id / a stop string / the budget; returns the final text piece."""
        stops = self.request.stop_token_ids
        for index, token in enumerate(new_tokens):
            self.sources.append(source if index < len(new_tokens) - 1 else "target")
            self.tokens.append(token)
            self.seen.add(token)
            if token in self.eos_ids or token in stops:
                self.finish = "eos" if token in self.eos_ids else "stop"
            elif self.text.push(token):
                self.finish = "stop"
            elif self.produced >= self.request.max_new_tokens:
                self.finish = "length"
            if self.finish:
                break
        self.stats.new_tokens = self.produced
        return self.text.take()


_EMPTY = np.zeros(0, dtype=np.int64)
