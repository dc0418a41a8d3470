"""Constrained output stays exact under speculation (scripted runners: no torch, no onnxruntime).

- greedy: every proposer, length and tree emits exactly constrained target-only's tokens;
- seeded (coupled) sampling: the same tokens as constrained target-only sampling with that seed;
- logprobs: identical whichever proposer produced the token;
- the first three tokens of constrained speculative sampling (coupled and rejection, chains and trees,
  bonus rows reached) follow the exact constrained distribution, computed here independently of the
  engine (a pure-Python rule for the language); three planted bugs make that test fail decisively.
"""

import json

import numpy as np
import pytest

pytest.importorskip("llguidance")

from specdec import Constraint, GenerationError, SamplingConfig  # noqa: E402
from specdec.decoding.constraint import ConstraintError, GrammarGuide  # noqa: E402

from specdec.decoding.suffix_store import SuffixCache  # noqa: E402
from scripted import scripted_decoder  # noqa: E402


class PieceCodec:
    """Token i -> a fixed byte string; ``token_bytes`` is what the grammar engine reads."""

    def __init__(self, pieces):
        self.token_bytes = list(pieces)

    def encode(self, text: str) -> list:
        out, data, i = [], text.encode(), 0
        while i < len(data):  # longest piece first
            best = max((t for t, p in enumerate(self.token_bytes) if p and data.startswith(p, i)),
                       key=lambda t: len(self.token_bytes[t]))
            out.append(best)
            i += len(self.token_bytes[best])
        return out

    def decode(self, ids) -> str:
        return b"".join(self.token_bytes[int(i)] for i in ids).decode("utf-8", errors="replace")


JSON_PIECES = [b"{", b"}", b'"', b"a", b"b", b":", b" ", b",", b"1", b"2", b"[", b"]", b'"a"', b'": ', b"true", b""]
SCHEMA = {"type": "object", "properties": {"a": {"type": "array", "items": {"type": "integer"}},
                                           "b": {"type": "boolean"}},
          "required": ["a", "b"], "additionalProperties": False}
MODES = [
    dict(num_draft_tokens=1, proposer="draft"),
    dict(num_draft_tokens=3, proposer="draft"),
    dict(num_draft_tokens="auto", proposer="draft"),
    dict(num_draft_tokens="auto", proposer="lookup"),
    dict(num_draft_tokens=4, proposer="lookup"),
    dict(num_draft_tokens="auto", proposer="hybrid"),
    dict(num_draft_tokens="auto", proposer="suffix"),
    dict(num_draft_tokens=4, proposer="suffix"),
    dict(tree="2,2,1"),
    dict(tree="auto"),
]
PROMPTS = ([1, 2, 3], [4], [0, 2, 3, 2, 13])
SAMPLED = [SamplingConfig(temperature=0.8), SamplingConfig(temperature=1.0, top_k=6, top_p=0.9, repetition_penalty=1.3)]


@pytest.fixture(scope="module")
def json_decoder():
    decoder = scripted_decoder(vocab=16, eos=15, draft_noise=0.6, seed=0)
    decoder.codec = PieceCodec(JSON_PIECES)
    decoder.suffix_cache = SuffixCache(1 << 20)  # earlier answers feed suffix trees (branching ones too)
    return decoder


def _valid(text: str) -> bool:
    value = json.loads(text)
    return (set(value) == {"a", "b"} and isinstance(value["b"], bool)
            and all(isinstance(x, int) for x in value["a"]))


@pytest.mark.parametrize("mode", MODES, ids=str)
def test_greedy_constrained_speculation_equals_constrained_target_only(json_decoder, mode):
    constraint = Constraint.json_schema(SCHEMA)
    for prompt in PROMPTS:
        base = json_decoder.generate(prompt, max_new_tokens=60, num_draft_tokens=0, constraint=constraint)
        spec = json_decoder.generate(prompt, max_new_tokens=60, constraint=constraint, **mode)
        assert spec.token_ids == base.token_ids and spec.text == base.text
        assert base.finish_reason == "eos" and _valid(base.text), base.text


def test_a_draft_that_cannot_score_the_allowed_tokens_still_proposes():
    """A pruned draft vocabulary without the grammar's tokens ("{" here): proposals fall back to the allowed
    tokens, and the output is still constrained target-only's."""
    decoder = scripted_decoder(vocab=16, eos=15, draft_noise=0.6, seed=0)
    decoder.codec = PieceCodec(JSON_PIECES)
    decoder.draft.model.table[..., 0] = -np.inf  # the draft never scores "{"
    constraint = Constraint.json_schema(SCHEMA)
    base = decoder.generate(PROMPTS[0], max_new_tokens=60, num_draft_tokens=0, constraint=constraint)
    for mode in (MODES[1], MODES[6], dict(num_draft_tokens=2, proposer="draft", acceptance="rejection",
                                          sampling=SAMPLED[0], seed=1)):
        spec = decoder.generate(PROMPTS[0], max_new_tokens=60, constraint=constraint, **mode)
        assert spec.finish_reason == "eos" and _valid(spec.text)
        if "sampling" not in mode:
            assert spec.token_ids == base.token_ids


@pytest.mark.parametrize("config", SAMPLED, ids=str)
@pytest.mark.parametrize("mode", [MODES[1], MODES[3], MODES[6]], ids=str)
def test_seeded_constrained_sampling_equals_constrained_target_only(json_decoder, mode, config):
    constraint = Constraint.json_schema(SCHEMA)
    for seed in range(3):
        base = json_decoder.generate(PROMPTS[0], max_new_tokens=60, sampling=config, num_draft_tokens=0, seed=seed,
                                     constraint=constraint)
        spec = json_decoder.generate(PROMPTS[0], max_new_tokens=60, sampling=config, seed=seed,
                                     constraint=constraint, **mode)
        assert spec.token_ids == base.token_ids, seed
        if base.finish_reason == "eos":
            assert _valid(base.text), base.text


@pytest.mark.parametrize("constrained", [False, True])
@pytest.mark.parametrize("config", [SamplingConfig(), SAMPLED[1]], ids=["greedy", "sampled"])
def test_logprobs_are_the_same_whichever_proposer_found_the_token(json_decoder, constrained, config):
    constraint = Constraint.json_schema(SCHEMA) if constrained else None
    base = json_decoder.generate(PROMPTS[2], max_new_tokens=30, sampling=config, seed=1, num_draft_tokens=0,
                                 constraint=constraint, logprobs=3)
    assert len(base.logprobs) == len(base.token_ids)
    for entry, token in zip(base.logprobs, base.token_ids):
        assert entry.token == token and entry.logprob <= 0.0 and len(entry.top) <= 3
        assert entry.top[0][1] >= entry.logprob - 1e-12  # the best alternative is at least as likely
        if config.greedy:
            assert entry.top[0][0] == token  # greedy takes the (constrained) argmax
    for mode in MODES:
        spec = json_decoder.generate(PROMPTS[2], max_new_tokens=30, sampling=config, seed=1, constraint=constraint,
                                     logprobs=3, **mode)
        assert spec.token_ids == base.token_ids
        for a, b in zip(spec.logprobs, base.logprobs):
            assert a.token == b.token and abs(a.logprob - b.logprob) < 1e-9, mode
            assert [t for t, _ in a.top] == [t for t, _ in b.top]


def test_logprobs_stream_and_off(json_decoder):
    assert json_decoder.generate([1], max_new_tokens=5).logprobs is None
    stream = json_decoder.stream([1], max_new_tokens=5, logprobs=0, num_draft_tokens=2, proposer="draft")
    "".join(stream)
    assert len(stream.logprobs) == len(stream.token_ids) and all(e.top == () for e in stream.logprobs)


@pytest.mark.parametrize("kwargs, start", [
    (dict(constraint={"type": "object"}), "constraint must be a Constraint"),
    (dict(constraint=Constraint.lark("start: (")), "constraint: grammar does not compile"),
    (dict(constraint=Constraint.gbnf("root ::= (")), "constraint: grammar"),
    (dict(constraint=Constraint.json_schema({"type": "strnig"})), "constraint: json schema does not compile"),
    (dict(logprobs=21), "logprobs must be None or an integer in 0..20"),
    (dict(logprobs=True), "logprobs must be"),
])
def test_bad_constraints_are_one_line_errors(json_decoder, kwargs, start):
    with pytest.raises(GenerationError) as info:
        json_decoder.generate([1], max_new_tokens=4, **kwargs)
    assert str(info.value).startswith(start) and "\n" not in str(info.value)


def test_constraint_builders_check_their_input():
    with pytest.raises(ConstraintError, match="not valid JSON"):
        Constraint.json_schema("{")
    with pytest.raises(ConstraintError, match="must be an object"):
        Constraint.json_schema([1])
    with pytest.raises(ConstraintError, match="kind must be one of"):
        Constraint("yaml", "")


def test_gbnf_and_regex_constraints(json_decoder):
    gbnf = json_decoder.generate([1], max_new_tokens=20, constraint=Constraint.gbnf('root ::= "[" ("1" | "2")+ "]"'),
                                 num_draft_tokens=3, proposer="draft")
    assert gbnf.finish_reason == "eos" and gbnf.text[0] == "[" and gbnf.text[-1] == "]"
    assert set(gbnf.text[1:-1]) <= {"1", "2"} and gbnf.text[1:-1]
    regex = json_decoder.generate([1], max_new_tokens=20, constraint=Constraint.regex("(ab)+"))
    assert regex.finish_reason in ("eos", "length") and set(regex.text.replace("ab", "")) == set()


def test_without_the_engine_a_constrained_request_is_one_line(json_decoder, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_llguidance(name, *args, **kwargs):
        if name.startswith("llguidance"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_llguidance)
    with pytest.raises(GenerationError, match=r"constraint: constrained output needs llguidance: pip install"):
        json_decoder.generate([1], max_new_tokens=4, constraint=Constraint.json_object())
    assert json_decoder.generate([1], max_new_tokens=4).token_ids  # unconstrained requests never import it


# ---------------------------------------------------------------- the exact constrained distribution
# Pieces "a", "b", "c", "ab", "ca" and EOS; the language: at most two "a" in all (prefix-closed, always complete;
# its state is a count, so a matcher that kept a rejected proposal's "a" forbids too early).
STAT_PIECES = [b"a", b"b", b"c", b"ab", b"ca", b""]
STAT_EOS = 5
STAT_GRAMMAR = Constraint.lark("start: /[bc]*(a[bc]*(a[bc]*)?)?/")
STAT_PROMPT = [1, 2]
STAT_CONFIG = SamplingConfig(temperature=1.5, top_p=0.8, repetition_penalty=1.3)
RUNS = 1500


def allowed_after(text: str) -> np.ndarray:
    """The language's rule, independently of the engine: a token is allowed unless the text then holds 3 "a"."""
    return np.array([(text.encode() + piece).count(b"a") <= 2 for piece in STAT_PIECES[:STAT_EOS]] + [True])


def exact_constrained_joint(model, config, length=3) -> dict:
    """{output tokens (ending at EOS or after ``length``): probability} of constrained target-only sampling."""
    from specdec.sampling.processors import sampling_distribution

    joint, frontier = {}, {(): 1.0}
    for _ in range(length):
        grown = {}
        for out, prob in frontier.items():
            sequence = list(STAT_PROMPT) + list(out)
            text = b"".join(STAT_PIECES[t] for t in out).decode()
            row = np.where(allowed_after(text), model.logits(sequence), -np.inf).astype(np.float32)
            dist = sampling_distribution(row, np.array(sorted(set(sequence)), dtype=np.int64), config)
            for token in np.flatnonzero(dist):
                target = joint if token == STAT_EOS else grown
                target[out + (int(token),)] = prob * float(dist[token])
        frontier = grown
    joint.update(frontier)
    return joint


@pytest.fixture(scope="module")
def stat_decoder():
    decoder = scripted_decoder(vocab=6, eos=STAT_EOS, draft_noise=0.5, seed=5)
    decoder.codec = PieceCodec(STAT_PIECES)
    return decoder


def constrained_pvalue(decoder, mode, acceptance, runs=RUNS):
    from scipy.stats import chisquare

    joint = exact_constrained_joint(decoder.target.model, STAT_CONFIG)
    keys = sorted(joint)
    counts = dict.fromkeys(keys, 0)

    def draw(seed):
        try:
            return tuple(decoder.generate(STAT_PROMPT, max_new_tokens=3, sampling=STAT_CONFIG, seed=seed,
                                          acceptance=acceptance, constraint=STAT_GRAMMAR, **mode).token_ids)
        except (ConstraintError, GenerationError):
            return "refused"  # a committed token the grammar forbids: an outcome of probability 0

    outcomes = [draw(seed) for seed in range(runs)]  # serial: the engine's threads do not survive a fork
    invalid = sum(1 for out in outcomes if out not in counts)
    for out in outcomes:
        if out in counts:
            counts[out] += 1
    expected = np.array([joint[k] for k in keys]) * runs
    observed = np.array([counts[k] for k in keys], dtype=float)
    big = expected >= 5  # pool the rare cells (and impossible outcomes) so the chi-square approximation holds
    pooled_observed, pooled_expected = observed[~big].sum() + invalid, expected[~big].sum()
    observed, expected = observed[big], expected[big]
    if pooled_observed or pooled_expected:  # an impossible outcome seen: expected ~0, a decisive chi-square
        observed = np.append(observed, pooled_observed)
        expected = np.append(expected, max(pooled_expected, 1e-9))
        expected *= observed.sum() / expected.sum()
    return chisquare(observed, expected).pvalue


STAT_MODES = [dict(num_draft_tokens=3, proposer="draft"), dict(tree="2,1")]


@pytest.mark.parametrize("mode, acceptance", [(STAT_MODES[0], "coupled"), (STAT_MODES[0], "rejection"),
                                              (STAT_MODES[1], "rejection")], ids=str)
def test_constrained_sampling_follows_the_exact_constrained_distribution(stat_decoder, mode, acceptance):
    assert constrained_pvalue(stat_decoder, mode, acceptance) > 1e-3


def _plant_unmasked_bonus_row(monkeypatch):
    """The bonus row (after every proposal was accepted) is scored without the grammar's mask."""
    from specdec.decoding import rules

    original_verify, original_constrained = rules.TokenRule._verify_chain, rules.TokenRule.constrained

    def verify(self, rows, contexts, proposals, draft_dists, first_position):
        self._bonus_path = len(proposals) if len(proposals) else None
        try:
            return original_verify(self, rows, contexts, proposals, draft_dists, first_position)
        finally:
            self._bonus_path = None

    def constrained(self, logits, path):
        if getattr(self, "_bonus_path", None) == len(path):
            return logits
        return original_constrained(self, logits, path)

    monkeypatch.setattr(rules.TokenRule, "_verify_chain", verify)
    monkeypatch.setattr(rules.TokenRule, "constrained", constrained)


def _plant_no_rollback(monkeypatch):
    """The matcher keeps a rejected proposal's state: its bookkeeping moves back, the matcher does not."""

    def align(self, sequence):
        stack = self._stack
        common = min(self._synced, len(sequence))
        while common < min(len(stack), len(sequence)) and stack[common] == sequence[common]:
            common += 1
        del stack[common:]  # forgot self.matcher.rollback(...)
        for token in sequence[common:]:
            if not self.matcher.consume_token(int(token)):
                raise ConstraintError("token does not satisfy the grammar")
            stack.append(int(token))

    monkeypatch.setattr(GrammarGuide, "_align", align)


def _plant_mask_after_top_p(monkeypatch):
    """The grammar's mask applied to the processed distribution (after top-p) instead of the raw logits."""
    from specdec.decoding import rules
    from specdec.sampling.processors import sampling_distribution

    def target_distribution(self, logits, context, path=()):
        dist = sampling_distribution(logits, context, self.config)
        allowed = self.allowed(path)
        if allowed is not None:
            dist = np.where(allowed, dist, 0.0)
            if dist.sum() == 0:
                dist = np.where(allowed, 1.0, 0.0)
            dist = dist / dist.sum()
        return dist

    monkeypatch.setattr(rules.TokenRule, "target_distribution", target_distribution)


@pytest.mark.parametrize("plant, acceptance", [
    (_plant_unmasked_bonus_row, "coupled"),
    (_plant_unmasked_bonus_row, "rejection"),
    (_plant_no_rollback, "coupled"),
    (_plant_no_rollback, "rejection"),
    (_plant_mask_after_top_p, "coupled"),
    (_plant_mask_after_top_p, "rejection"),
], ids=["unmasked-bonus-coupled", "unmasked-bonus-rejection", "no-rollback-coupled", "no-rollback-rejection",
        "mask-after-top-p-coupled", "mask-after-top-p-rejection"])
def test_planted_constraint_bugs_fail_the_distribution_test(stat_decoder, monkeypatch, plant, acceptance):
    """Negative controls: each bug makes the same check fail decisively."""
    plant(monkeypatch)
    assert constrained_pvalue(stat_decoder, dict(num_draft_tokens=3, proposer="draft"), acceptance, runs=600) < 1e-4


def test_a_padded_tokenizer_compiles_tool_calls_with_its_added_markers():
    """A padded-vocabulary bundle's tokenizer (Qwen2.5's GGUF: placeholders after the real tokens, so the tokenizer
    holds more entries than the rows the decoder samples) and a non-special added marker (``<tool_call>``): the
    tool-call grammar compiles, requires the marker as its one token, and masks are cut to the sampled rows."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    from specdec.decoding.constraint import compile_constraint
    from specdec.decoding.text.codec import TextCodec
    from specdec.decoding.text.tools import TOOL_FORMATS, tool_call_constraint

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    backend = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(alphabet))}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(["<|end|>"])
    backend.add_tokens([AddedToken("<tool_call>", special=False), AddedToken("</tool_call>", special=False)])
    vocab_size = backend.get_vocab_size(with_added_tokens=True)  # the rows the decoder samples
    backend.add_tokens([f"[PAD{i}]" for i in range(vocab_size, vocab_size + 13)])  # the padded rows' placeholders
    codec = TextCodec.__new__(TextCodec)
    codec.tokenizer = backend
    start = backend.token_to_id("<tool_call>")
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    constraint = tool_call_constraint([tool], TOOL_FORMATS[0], codec=codec)
    compiled = compile_constraint(constraint, codec, vocab_size, {backend.token_to_id("<|end|>")})
    guide = GrammarGuide(compiled, lambda: [], {backend.token_to_id("<|end|>")}, ())
    allowed = guide.mask()
    assert allowed.shape == (vocab_size,) and np.flatnonzero(allowed).tolist() == [start]
