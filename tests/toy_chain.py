"""A toy language model in numpy for exact tests of the acceptance math (no ONNX, no decoder).

Scope: the pure acceptance functions (``speculative_accept``, ``tree_speculative_accept``) driven
the way the decoder drives them, on models small enough that the exact joint distribution of
the first few emitted tokens can be enumerated. Boundary: the decoder itself (which context it
gives the processors, seeding, KV bookkeeping) is tested elsewhere.

The target and the draft are bigram logit tables over ``VOCAB`` tokens, deliberately different,
passed through the runtime's own processors (``sampling_distribution``: repetition penalty over
every token seen so far, temperature, top-k). The repetition penalty makes each distribution
depend on the whole prefix, not only the last token, so a row scored on the wrong prefix has a
different distribution.
"""

from __future__ import annotations

import numpy as np
from scipy.stats import chisquare

from specdec.sampling.acceptance import speculative_accept
from specdec.sampling.processors import SamplingConfig, sample, sampling_distribution
from specdec.decoding.tree import ROOT, DraftTree, pick_children, tree_speculative_accept

VOCAB = 5
PROMPT = (0,)
CONFIG = SamplingConfig(temperature=0.9, top_k=3, repetition_penalty=3.0)


class ToyPair:
    """Target and draft next-token distributions for any context (a tuple of token ids)."""

    def __init__(self, seed: int = 7, config: SamplingConfig = CONFIG, vocab: int = VOCAB):
        rng = np.random.default_rng(seed)
        self.vocab = vocab
        self.config = config
        self.target_logits = rng.normal(0.0, 1.5, (vocab, vocab)).astype(np.float32)
        # a draft that agrees only roughly: the same table plus large noise
        self.draft_logits = (self.target_logits + rng.normal(0.0, 1.2, (vocab, vocab))).astype(np.float32)
        self._cache: dict = {}

    def _dist(self, table: str, context: tuple, seen: tuple) -> np.ndarray:
        key = (table, context[-1], frozenset(seen))
        if key not in self._cache:
            logits = (self.target_logits if table == "target" else self.draft_logits)[context[-1]]
            config = self.config
            if table == "untruncated":  # the draft's softmax before top-k
                config = SamplingConfig(temperature=config.temperature, repetition_penalty=config.repetition_penalty)
            self._cache[key] = sampling_distribution(logits, np.array(sorted(set(seen)), dtype=np.int64), config)
        return self._cache[key]

    def target(self, context: tuple, seen: tuple | None = None) -> np.ndarray:
        """p(. | context); ``seen`` = the context the processors see (default: the context itself)."""
        return self._dist("target", context, context if seen is None else seen)

    def draft(self, context: tuple) -> np.ndarray:
        return self._dist("draft", context, context)

    def draft_untruncated(self, context: tuple) -> np.ndarray:
        """What a buggy draft would record: its distribution without top-k truncation."""
        return self._dist("untruncated", context, context)

    def exact_joint(self, count: int, prompt: tuple = PROMPT) -> dict:
        """{(x_1..x_count): target probability}, by enumeration (zero-probability tuples omitted)."""
        joint = {(): 1.0}
        for _ in range(count):
            grown = {}
            for head, prob in joint.items():
                dist = self.target(prompt + head)
                for token in np.flatnonzero(dist):
                    grown[head + (int(token),)] = prob * float(dist[token])
            joint = grown
        return joint


def chain_tokens(pair: ToyPair, gamma: int, count: int, rng: np.random.Generator, accept=speculative_accept,
                 record_untruncated: bool = False, stale_processor_context: bool = False,
                 prompt: tuple = PROMPT) -> tuple[tuple, bool]:
    """Speculative rounds as the decoder runs them, until ``count`` tokens are out.

    Returns (the first ``count`` emitted tokens, whether a bonus token was among them).
    Each round: the draft samples d_1..d_gamma, each from its own distribution after
    [context, d_1..d_{i-1}] (recorded for acceptance); the target scores rows 0..gamma after
    [context, d_1..d_i]; ``accept`` keeps n drafts and emits one recovered/bonus token.
    Mutations (both False = the correct procedure): ``record_untruncated`` records the draft's
    untruncated softmax instead of the top-k distribution it sampled from;
    ``stale_processor_context`` applies the target's processors to the context before the
    drafts (the logits' own prefix is right, the repetition penalty's is not).
    """
    context = prompt
    bonus_in_window = False
    while len(context) - len(prompt) < count:
        drafts, recorded = (), []
        for _ in range(gamma):
            dist = pair.draft(context + drafts)
            recorded.append(pair.draft_untruncated(context + drafts) if record_untruncated else dist)
            drafts += (sample(dist, rng),)
        rows = [pair.target(context + drafts[:i], seen=context if stale_processor_context else None)
                for i in range(gamma + 1)]
        accepted, token = accept(np.array(drafts, dtype=np.int64), np.array(recorded).reshape(gamma, pair.vocab),
                                 np.array(rows), rng)
        if accepted == gamma and len(context) - len(prompt) + gamma < count:
            bonus_in_window = True
        context += drafts[:accepted] + (int(token),)
    return context[len(prompt): len(prompt) + count], bonus_in_window


def tree_tokens(pair: ToyPair, widths: tuple, count: int, rng: np.random.Generator, accept=tree_speculative_accept,
                prompt: tuple = PROMPT) -> tuple:
    """Tree rounds (static shape ``widths``, children drawn without replacement) until ``count`` tokens are out."""
    context = prompt
    while len(context) - len(prompt) < count:
        tokens, parents, depths, draw_dists, contexts = [], [], [], {}, {}
        frontier = [(ROOT, context)]  # (node, its context)
        for depth, width in enumerate(widths, start=1):
            grown = []
            for node, node_context in frontier:
                dist = pair.draft(node_context)
                draw_dists[node + 1] = dist
                for token in pick_children(dist, width, greedy=False, rng=rng):
                    tokens.append(token)
                    parents.append(node)
                    depths.append(depth)
                    contexts[len(tokens)] = node_context + (token,)  # expansion index of the new node
                    grown.append((len(tokens) - 1, node_context + (token,)))
            frontier = grown
        contexts[0] = context
        tree = DraftTree(tokens=tokens, parents=parents, depths=depths, fed=0, draw_dists=draw_dists)
        path, token = accept(tree, lambda expansion: pair.target(contexts[expansion]), rng)
        context += tuple(tokens[node] for node in path) + (int(token),)
    return context[len(prompt): len(prompt) + count]


def exactness_pvalue(samples: list, joint: dict) -> float:
    """Chi-square p-value of sampled tuples against the exact joint ``{tuple: probability}``.

    Tuples with an expected count below 5, and tuples the target cannot produce at all, share
    one pooled cell; if that cell's expected count is ~0, any tuple in it gives p = 0.
    """
    runs = len(samples)
    counts: dict = {}
    for key in samples:
        counts[key] = counts.get(key, 0) + 1
    big = [key for key in joint if joint[key] * runs >= 5]
    expected = [joint[key] * runs for key in big]
    observed = [counts.get(key, 0) for key in big]
    rest_expected, rest_observed = runs - sum(expected), runs - sum(observed)
    if rest_expected < 1e-6:
        if rest_observed > 0:
            return 0.0
    else:
        expected.append(rest_expected)
        observed.append(rest_observed)
    return float(chisquare(observed, np.array(expected) * runs / sum(expected)).pvalue)
