"""Constrained output: a grammar (JSON schema, any JSON object, Lark, GBNF, regex) as part of the target distribution.

The constraint is a mask on the target's logits. The row scoring the token at absolute position ``i``
is masked by the grammar state after the sequence's tokens before ``i`` (the committed output plus
the proposals before ``i`` in the round), before any processor (repetition penalty, temperature,
top-k, top-p, min-p). The constrained distribution is therefore the target's distribution restricted
to the allowed tokens and renormalized, and every exactness argument of the unconstrained decoder
(greedy identity, coupled sampling, rejection sampling) applies to it unchanged: the rule
(decoding/rules.py) only sees different rows. The bonus row is masked like every other; draft
proposals are drawn from the draft's masked rows; a proposal the grammar forbids ends the chain (it
could never be accepted, and no row after it is needed).

Engine: llguidance (a Rust matcher with a numpy-facing API, no torch), imported lazily: the core
runtime works without it, and a request that needs it gets a one-line GenerationError. The matcher
advances speculatively over a round's proposals and rolls back to the longest prefix it shares with
the next sequence asked for (``GrammarGuide.mask``), so its state always equals the committed tokens
plus the path being scored. End-of-output tokens (EOS, a chat template's end-of-turn, stop ids) are
allowed exactly where the grammar is complete.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass

import numpy as np

log = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'specdec[constrain]' (llguidance)"
KINDS = ("json_schema", "json_object", "lark", "gbnf", "regex")
# JSON as Python's json.dumps writes it, on one line: '{"a": 1, "b": [2, 3]}'. No free whitespace: a small
# model may otherwise loop on newlines; this is also the layout chat templates render tool calls in.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class ConstraintError(ValueError):
    """A grammar or schema that cannot be compiled, or a missing engine (one line)."""


def _llguidance():
    try:
        import llguidance
        import llguidance.numpy  # noqa: F401
    except ImportError:
        raise ConstraintError(f"constrained output needs llguidance: {INSTALL_HINT}") from None
    return llguidance


@dataclass(frozen=True)
class Constraint:
    """What the output must match. Build with ``Constraint.json_schema(schema)``, ``.json_object()``,
    ``.lark(text)``, ``.gbnf(text)`` or ``.regex(pattern)``; pass as ``generate(..., constraint=...)``."""

    kind: str  # one of KINDS
    source: str  # the schema as JSON text, or the grammar / pattern text

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ConstraintError(f"constraint kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if not isinstance(self.source, str):
            raise ConstraintError(f"constraint source must be text, got {type(self.source).__name__}")

    @classmethod
    def json_schema(cls, schema) -> "Constraint":
        """A JSON value valid against ``schema`` (a dict, or its JSON text)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise ConstraintError(f"json schema is not valid JSON: {exc}") from None
        if isinstance(schema, bool):
            schema = {} if schema else {"not": {}}
        if not isinstance(schema, dict):
            raise ConstraintError(f"json schema must be an object, got {type(schema).__name__}")
        try:
            # key order kept: the output writes properties in the schema's order
            return cls("json_schema", json.dumps(schema, ensure_ascii=False))
        except (TypeError, ValueError) as exc:
            raise ConstraintError(f"json schema is not plain JSON: {exc}") from None

    @classmethod
    def json_object(cls) -> "Constraint":
        """Any JSON object (OpenAI's ``response_format: {"type": "json_object"}``)."""
        return cls("json_object", json.dumps({"type": "object"}))

    @classmethod
    def lark(cls, grammar: str) -> "Constraint":
        """A grammar in llguidance's Lark syntax (``start: ...``; ``%json {...}`` embeds a JSON schema)."""
        return cls("lark", grammar)

    @classmethod
    def gbnf(cls, grammar: str) -> "Constraint":
        """A grammar in llama.cpp's GBNF (``root ::= ...``), llama-server's ``grammar`` field."""
        return cls("gbnf", grammar)

    @classmethod
    def regex(cls, pattern: str) -> "Constraint":
        return cls("regex", pattern)

    def engine_grammar(self) -> str:
        """The grammar in llguidance's serialized form (not yet checked)."""
        llg = _llguidance()
        matcher = llg.LLMatcher
        if self.kind in ("json_schema", "json_object"):
            try:
                return matcher.grammar_from_json_schema(self.source, defaults=_JSON_OPTIONS)
            except ValueError as exc:
                raise ConstraintError(f"json schema: {one_line(exc)}") from None
        if self.kind == "regex":
            return matcher.grammar_from_regex(self.source)
        text = self.source
        if self.kind == "gbnf":
            try:
                from llguidance.gbnf_to_lark import gbnf_to_lark

                text = gbnf_to_lark(text)
            except Exception as exc:  # noqa: BLE001 - the converter raises plain exceptions on bad input
                raise ConstraintError(f"grammar: not valid GBNF: {one_line(exc)}") from None
        return matcher.grammar_from_lark(text)


def one_line(exc_or_text) -> str:
    text = str(exc_or_text).strip()
    return text.splitlines()[0] if text else type(exc_or_text).__name__


@dataclass(frozen=True)
class CompiledConstraint:
    """A constraint checked against one tokenizer: what a Request carries (make_request builds it)."""
    constraint: Constraint
    grammar: str  # llguidance's serialized grammar
    tokenizer: object  # llguidance.LLTokenizer (shared, immutable)
    vocab_size: int


def compile_constraint(constraint: Constraint, codec, vocab_size: int, eos_ids) -> CompiledConstraint:
    """Check ``constraint`` against the decoder's tokenizer; ConstraintError (one line) when it does not compile."""
    if not isinstance(constraint, Constraint):
        raise ConstraintError(f"constraint must be a Constraint (Constraint.json_schema(...), ...), "
                              f"got {type(constraint).__name__}")
    llg = _llguidance()
    tokenizer = grammar_tokenizer(codec, vocab_size, tuple(sorted(eos_ids)))
    key = (id(tokenizer), constraint)
    if key in _COMPILED and _COMPILED[key].tokenizer is tokenizer:
        return _COMPILED[key]  # a repeated schema (an agent's every turn) is checked once
    grammar = constraint.engine_grammar()
    error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
    if error:
        label = {"json_schema": "json schema", "json_object": "json schema", "gbnf": "grammar", "lark": "grammar",
                 "regex": "regex"}[constraint.kind]
        raise ConstraintError(f"{label} does not compile: {one_line(messages[0] if messages else 'invalid')}")
    for message in messages:
        log.info("constraint warning: %s", message)
    compiled = CompiledConstraint(constraint, grammar, tokenizer, vocab_size)
    if len(_COMPILED) >= _COMPILED_MAX:
        _COMPILED.pop(next(iter(_COMPILED)))
    _COMPILED[key] = compiled
    return compiled


_COMPILED: dict = {}
_COMPILED_MAX = 256


_TOKENIZERS: dict = {}


def grammar_tokenizer(codec, vocab_size: int, eos_ids: tuple):
    """llguidance's view of the codec's tokenizer (built once per tokenizer, vocabulary size and EOS set: ~1 s
    for a 150k vocabulary). A ``tokenizers`` byte-level tokenizer is read from its JSON; any other codec
    gives each token's bytes (``codec.token_bytes``, or decoding ids one by one)."""
    key = (id(codec), vocab_size, eos_ids)
    if key in _TOKENIZERS and _TOKENIZERS[key][0] is codec:
        return _TOKENIZERS[key][1]
    llg = _llguidance()
    eos = list(eos_ids) or None
    tokenizer = None
    backend = getattr(codec, "tokenizer", None)
    if backend is not None and hasattr(backend, "to_str"):
        # a padded vocabulary's tokenizer can hold more entries (placeholders) than the rows the decoder samples:
        # llguidance reads them all, and the guide's masks are cut to ``vocab_size``
        size = max(vocab_size, backend.get_vocab_size(with_added_tokens=True))
        try:
            tokenizer = llg.LLTokenizer(backend.to_str(), n_vocab=size, eos_token=eos)
        except Exception as exc:  # noqa: BLE001 - a decoder type llguidance does not read: per-token bytes
            log.debug("llguidance cannot read the tokenizer JSON (%s): per-token bytes", one_line(exc))
    if tokenizer is None:
        tokenizer = llg.LLTokenizer(llg.TokenizerWrapper(_TokenBytes(codec, vocab_size, eos_ids)), n_vocab=vocab_size)
    _TOKENIZERS[key] = (codec, tokenizer)
    return tokenizer


class _TokenBytes:
    """The per-token byte view llguidance's TokenizerWrapper reads (special tokens as b"\\xff" + name)."""

    def __init__(self, codec, vocab_size: int, eos_ids: tuple):
        given = getattr(codec, "token_bytes", None)
        backend = getattr(codec, "tokenizer", None)
        special = set(eos_ids)
        if given is not None:
            tokens = [bytes(piece) for piece in given][:vocab_size]
        else:
            added = {index for index, token in backend.get_added_tokens_decoder().items() if token.special}
            special |= added
            tokens = []
            for index in range(min(vocab_size, backend.get_vocab_size(with_added_tokens=True))):
                piece = backend.id_to_token(index) or ""
                tokens.append(piece.encode() if index in added else
                              backend.decode([index], skip_special_tokens=False).encode("utf-8"))
        tokens += [b""] * (vocab_size - len(tokens))
        for index in special:
            if index < vocab_size:
                tokens[index] = b"\xff" + (tokens[index] or f"[{index}]".encode())
        self.tokens = tokens
        self.eos_token_id = eos_ids[0] if eos_ids else vocab_size - 1
        self.bos_token_id = None
        self.special_token_ids = sorted(i for i in special if i < vocab_size)
        self._codec = codec

    def __call__(self, text):
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return list(self._codec.encode(text, special=False)) if _takes_special(self._codec) else \
            list(self._codec.encode(text))


def _takes_special(codec) -> bool:
    import inspect

    try:
        return "special" in inspect.signature(codec.encode).parameters
    except (TypeError, ValueError):
        return False


class GrammarGuide:
    """One request's grammar state: ``mask(path)`` = the tokens allowed after the committed output + ``path``.

    ``output`` is a callable returning the committed output tokens (the request state's; it only grows).
    ``end_ids``: the ids that end the output (EOS, stop ids): allowed exactly where the grammar may end."""

    def __init__(self, compiled: CompiledConstraint, output, eos_ids, end_ids, stats=None):
        llg = _llguidance()
        self._llg = llg
        self.vocab_size = compiled.vocab_size
        self.matcher = llg.LLMatcher(compiled.tokenizer, compiled.grammar, log_level=0)
        if self.matcher.is_error():
            raise ConstraintError(f"constraint: {one_line(self.matcher.get_error())}")
        self._output = output
        self.eos_ids = np.array(sorted(eos_ids), dtype=np.int64)
        self.end_ids = frozenset(end_ids) | frozenset(eos_ids)
        self._end_array = np.array(sorted(self.end_ids), dtype=np.int64)
        self._stack: list = []  # tokens the matcher has consumed (the committed output, then a speculative path)
        self._synced = 0  # stack[:synced] is known to equal the committed output's prefix
        self._bitmask = llg.numpy.allocate_token_bitmask(1, max(self.vocab_size, compiled.tokenizer.vocab_size))
        self._cache: dict = {}
        self._cache_base = -1
        self.stats = stats  # GenerationStats: grammar_masks / grammar_seconds (None: not counted)

    # ------------------------------------------------------------------ the matcher follows the sequence
    def _align(self, sequence: list) -> None:
        stack, start = self._stack, min(self._synced, len(sequence))
        common = start
        limit = min(len(stack), len(sequence))
        while common < limit and stack[common] == sequence[common]:
            common += 1
        if common < len(stack):
            if not self.matcher.rollback(len(stack) - common):
                raise ConstraintError(f"constraint: rollback failed: {one_line(self.matcher.get_error())}")
            del stack[common:]
        for token in sequence[common:]:
            if not self.matcher.consume_token(int(token)):
                raise ConstraintError(f"constraint: token {token} does not satisfy the grammar "
                                      f"({one_line(self.matcher.get_error())})")
            stack.append(int(token))

    def mask(self, path=()) -> np.ndarray | None:
        """[V] bool: the tokens allowed after output + ``path``; None when ``path`` holds an end token (the
        row after it is never used: the output ends there)."""
        output = self._output()
        if len(output) != self._cache_base:
            self._cache, self._cache_base = {}, len(output)
            self._synced = min(self._synced, len(output))
        key = tuple(int(t) for t in path)
        cached = self._cache.get(key)
        if cached is not None or key in self._cache:
            return cached
        if any(t in self.end_ids for t in key):
            self._cache[key] = None
            return None
        started = time.perf_counter()
        self._align(list(output) + list(key))
        self._synced = max(self._synced, len(output))
        self._llg.numpy.fill_next_token_bitmask(self.matcher, self._bitmask)
        allowed = np.unpackbits(self._bitmask.view(np.uint8), bitorder="little")[: self.vocab_size].astype(bool)
        if allowed[self.eos_ids].any() or self.matcher.is_accepting():  # the grammar may end: every end id may
            allowed[self._end_array[self._end_array < self.vocab_size]] = True
        if self.stats is not None:
            self.stats.grammar_masks += 1
            self.stats.grammar_seconds += time.perf_counter() - started
        if not allowed.any():
            raise ConstraintError("constraint: the grammar allows no token here (the matcher is in an error state: "
                                  f"{one_line(self.matcher.get_error() or 'no token allowed')})")
        self._cache[key] = allowed
        return allowed

    def admissible(self, path) -> int:
        """How many leading tokens of ``path`` (after the committed output) the grammar allows, an end token
        counting where the grammar may end (and nothing after it)."""
        count = 0
        for index, token in enumerate(path):
            allowed = self.mask(path[:index])
            if allowed is None or not allowed[int(token)]:
                break
            count += 1
        return count


def masked(logits: np.ndarray, allowed: np.ndarray | None) -> np.ndarray:
    """[V] logits with every disallowed token at -inf (the constraint, before any processor)."""
    if allowed is None:
        return logits
    return np.where(allowed, logits, np.float32(-np.inf)).astype(logits.dtype, copy=False)


@dataclass(frozen=True)
class TokenLogprob:
    """One emitted token's log-probability under the target's processed distribution at its position, and the
    ``top`` most likely alternatives there as (token id, logprob), best first."""
    token: int
    logprob: float
    top: tuple = ()
