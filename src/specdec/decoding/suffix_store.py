"""Suffix decoding: propose a token tree of what followed the longest earlier match of the recent text.

SuffixDecoding (Oliaro et al. 2024, arXiv 2411.04975; ArcticInference's ``suffix`` method): text
an agent or an editor produces repeats, within a request (the prompt's code rewritten in the
answer) and across requests (the same boilerplate, the same function edited again). Two token
stores are searched each round:

- the request's own prompt and output (``RequestSuffix``), and
- ``SuffixCache``: recent requests' outputs, shared by every worker of a decoder, bounded in
  tokens (oldest requests dropped first), safe under threads.

Matching. The longest suffix of the committed text (up to ``MAX_MATCH`` tokens) that occurred
before is found by vectorized backward extension over a flat token array (requests are
separated by ``SEPARATOR``, which never matches). The continuations of its most recent
occurrences form a trie whose counts give each child's empirical frequency.

Tree. Nodes are taken best-first by path probability: the product, along the path, of each
node's frequency times a confidence factor learned from the verifications so far
(``Calibration``: hits / predicted hits per matched-length bucket, shared by the workers, and refined
by each request's own verifications: ``RequestCalibration``). The
tree is cut where another node would lower the expected tokens per second of the round (the
machine's measured verify cost of each pass width), where the path probability falls below
``MIN_PATH_PROB``, or at ``max_spec_factor x match length`` nodes (SuffixDecoding's adaptive
size). Proposals are deterministic, so acceptance stays exact (decoding/tree.py: a
deterministic child is accepted with the target's probability of it).
"""

from __future__ import annotations

import heapq
import threading
from dataclasses import dataclass

import numpy as np

SEPARATOR = -1  # between requests in a store: never equal to a token, so no match crosses it
MAX_MATCH = 32  # longest suffix of the committed text matched
MAX_OCCURRENCES = 32  # most recent occurrences of the match whose continuations are counted
MAX_DEPTH = 24  # longest path of a proposal tree
MAX_SUFFIX_NODES = 32  # nodes of a proposal tree (one verify pass: the tree plus the pending token)
MIN_PATH_PROB = 0.05  # a node whose path is less likely than this is not proposed
MAX_SPEC_FACTOR = 4.0  # at most this many nodes per matched token (SuffixDecoding's max_spec_factor)
MIN_SPEC_NODES = 4  # ... but at least this many
DEFAULT_CACHE_MIB = 16  # the shared store of recent outputs: 4 bytes a token, about 4 million tokens

# confidence buckets by the length of the match behind an expansion: 1, 2, 3-4, 5-8, 9-16, 17-32, 33+
BUCKET_EDGES = (1, 2, 4, 8, 16, 32)
PRIOR_CONFIDENCE = (0.3, 0.45, 0.6, 0.7, 0.8, 0.85, 0.9)
PRIOR_WEIGHT = 2.0
CALIBRATION_DECAY = 0.995
REQUEST_PRIOR_WEIGHT = 3.0  # a request's own evidence outweighs the shared factors after a few expansions


def bucket(match_length: int) -> int:
    return int(np.searchsorted(BUCKET_EDGES, match_length, side="left"))


def longest_match(
    store: np.ndarray,  # [N] int: tokens, SEPARATOR between requests
    context: np.ndarray,  # [M] int: the committed text's last M tokens (M <= MAX_MATCH)
    limit: int,  # occurrences must end before ``limit`` (their continuation starts at end + 1 < ``limit`` + 1)
) -> tuple[np.ndarray, int]:
    """(end indices of every occurrence of the longest matched suffix of ``context``, its length; 0: none)."""
    if len(context) == 0 or limit <= 0:
        return np.zeros(0, dtype=np.int64), 0
    ends = np.flatnonzero(store[:limit] == context[-1])
    if len(ends) == 0:
        return ends, 0
    length = 1
    for back in range(1, len(context)):
        starts = ends - back
        valid = starts >= 0
        keep = valid & (store[np.where(valid, starts, 0)] == context[-1 - back])
        if not keep.any():
            break
        ends = ends[keep]
        length += 1
    return ends, length


def continuations(store: np.ndarray, ends: np.ndarray, stop: int, depth: int) -> list:
    """What followed the most recent ``MAX_OCCURRENCES`` occurrences: lists of up to ``depth`` tokens, cut at a
    separator and at ``stop`` (store: [N] int; ends: [K] ascending end indices)."""
    found = []
    for end in ends[::-1][:MAX_OCCURRENCES]:
        piece = store[end + 1 : min(end + 1 + depth, stop)]
        cut = np.flatnonzero(piece == SEPARATOR)
        if len(cut):
            piece = piece[: cut[0]]
        if len(piece):
            found.append(piece.tolist())
    return found


class Calibration:
    """How often an expansion's proposed children hold the target's token, against what their frequencies
    predicted, per matched-length bucket: the factor that turns frequencies into acceptance estimates.

    One is shared by the workers (what this model and this traffic did so far); each request keeps its own
    on top (``RequestCalibration``): prose repeats less than code, and a request's own verifications soon
    say which it is."""

    def __init__(self):
        self.hits = np.array(PRIOR_CONFIDENCE) * PRIOR_WEIGHT
        self.predicted = np.full(len(PRIOR_CONFIDENCE), PRIOR_WEIGHT)
        self._lock = threading.Lock()

    def factor(self, match_length: int) -> float:
        b = bucket(match_length)
        return float(self.hits[b] / self.predicted[b])

    def factors(self) -> np.ndarray:
        with self._lock:
            return self.hits / self.predicted

    def observe(self, match_length: int, predicted: float, hit: bool) -> None:
        b = bucket(match_length)
        with self._lock:
            self.hits[b] = self.hits[b] * CALIBRATION_DECAY + hit
            self.predicted[b] = self.predicted[b] * CALIBRATION_DECAY + predicted


class RequestCalibration:
    """One request's factors: the shared calibration's, worth ``REQUEST_PRIOR_WEIGHT`` predicted hits, updated
    by this request's own verifications (which also teach the shared one)."""

    def __init__(self, shared: Calibration):
        self.shared = shared
        self.predicted = np.full(len(PRIOR_CONFIDENCE), REQUEST_PRIOR_WEIGHT)
        self.hits = shared.factors() * self.predicted

    def factor(self, match_length: int) -> float:
        b = bucket(match_length)
        return float(self.hits[b] / self.predicted[b])

    def observe(self, match_length: int, predicted: float, hit: bool) -> None:
        b = bucket(match_length)
        self.hits[b] += hit
        self.predicted[b] += predicted
        self.shared.observe(match_length, predicted, hit)


@dataclass(frozen=True)
class SuffixTree:
    """A proposal: nodes in best-first order (a parent always before its children)."""
    tokens: tuple  # [N] token ids
    parents: tuple  # [N] parent node index, -1 for children of the pending token
    depths: tuple  # [N] 1-based depth
    frequencies: tuple  # [N] the node's empirical frequency among its parent's continuations
    path_probs: tuple  # [N] calibrated probability that the path to the node is accepted
    match_length: int  # tokens of context matched at the root

    @property
    def expected_tokens(self) -> float:
        """Expected tokens a round with this tree emits: the accepted nodes plus the target's own token."""
        return 1.0 + float(sum(self.path_probs))

    def is_chain(self) -> bool:
        return all(parent == node - 1 for node, parent in enumerate(self.parents))

    def cut(self, count: int) -> "SuffixTree":
        return SuffixTree(self.tokens[:count], self.parents[:count], self.depths[:count], self.frequencies[:count],
                          self.path_probs[:count], self.match_length)


EMPTY_TREE = SuffixTree((), (), (), (), (), 0)


def build_tree(pieces: list, match_length: int, calibration, max_nodes: int, max_depth: int) -> SuffixTree:
    """Best-first tree over the trie of ``pieces`` (continuations, most recent first): each node's path
    probability is its parent's times min(1, frequency x the calibration factor of its match length)."""
    if not pieces or max_nodes <= 0 or max_depth <= 0:
        return EMPTY_TREE
    trie: dict = {}  # token -> [count, children, first-seen order]
    for piece in pieces:
        level = trie
        for token in piece[:max_depth]:
            entry = level.get(token)
            if entry is None:
                entry = level[token] = [0, {}]
            entry[0] += 1
            level = entry[1]
    tokens, parents, depths, freqs, probs = [], [], [], [], []
    heap: list = []
    order = 0

    def push(children: dict, total: int, parent: int, depth: int, parent_prob: float) -> None:
        nonlocal order
        factor = calibration.factor(match_length + depth - 1)
        for token, (count, grand) in children.items():
            frequency = count / total
            prob = parent_prob * min(1.0, frequency * factor)
            heapq.heappush(heap, (-prob, order, token, parent, depth, frequency, count, grand))
            order += 1

    push(trie, len(pieces), -1, 1, 1.0)
    while heap and len(tokens) < max_nodes:
        neg_prob, _, token, parent, depth, frequency, count, grand = heapq.heappop(heap)
        if -neg_prob < MIN_PATH_PROB:
            break
        node = len(tokens)
        tokens.append(int(token))
        parents.append(parent)
        depths.append(depth)
        freqs.append(frequency)
        probs.append(-neg_prob)
        if grand and depth < max_depth:
            push(grand, count, node, depth + 1, -neg_prob)
    return SuffixTree(tuple(tokens), tuple(parents), tuple(depths), tuple(freqs), tuple(probs), match_length)


def cost_cut(tree: SuffixTree, pass_cost, pending: int) -> SuffixTree:
    """The first k nodes (k >= 0) that maximize expected tokens per second: (1 + sum of their path
    probabilities) / pass_cost(pending + k). Best-first order makes every prefix a tree."""
    best, best_rate, expected = 0, 1.0 / pass_cost(pending), 1.0
    for k, prob in enumerate(tree.path_probs, start=1):
        expected += prob
        rate = expected / pass_cost(pending + k)
        if rate > best_rate:
            best, best_rate = k, rate
    return tree.cut(best)


class SuffixCache:
    """Recent requests' outputs, one flat int32 store shared by every worker of a decoder (and its calibration).

    Bounded by ``max_tokens``: when a new output does not fit, the oldest outputs are dropped (the newest
    half of the store is kept, cut at a request boundary). Reads and writes take one lock."""

    def __init__(self, max_bytes: int):
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"the suffix cache size must be an integer number of bytes >= 0, got {max_bytes!r}")
        self.max_tokens = max_bytes // 4
        self.store = np.full(min(self.max_tokens, 4096), SEPARATOR, dtype=np.int32)
        self.used = 0
        self.requests = 0
        self.evicted_tokens = 0
        self.calibration = Calibration()
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        return self.store.nbytes

    def clear(self) -> None:
        """Forget every stored output (the learned confidence stays): for benchmarks that time cold requests."""
        with self._lock:
            self.store[: self.used] = SEPARATOR
            self.used = 0

    def add(self, tokens) -> None:
        """Store one request's output (ids); too long for the store: its last part."""
        piece = np.asarray(list(tokens), dtype=np.int32)[-(self.max_tokens - 1):] if self.max_tokens > 1 else []
        if len(piece) == 0:
            return
        with self._lock:
            needed = self.used + len(piece) + 1
            if needed > self.max_tokens:
                self._drop_oldest(len(piece) + 1)
                needed = self.used + len(piece) + 1
            if needed > len(self.store):
                grown = np.full(min(self.max_tokens, max(needed, 2 * len(self.store))), SEPARATOR, dtype=np.int32)
                grown[: self.used] = self.store[: self.used]
                self.store = grown
            self.store[self.used : self.used + len(piece)] = piece
            self.store[self.used + len(piece)] = SEPARATOR
            self.used += len(piece) + 1
            self.requests += 1

    def _drop_oldest(self, room: int) -> None:
        keep_from = max(self.used - max(self.max_tokens // 2, 0), self.used + room - self.max_tokens, 0)
        boundary = np.flatnonzero(self.store[keep_from : self.used] == SEPARATOR)
        keep_from = keep_from + int(boundary[0]) + 1 if len(boundary) else self.used
        kept = self.used - keep_from
        self.store[:kept] = self.store[keep_from : self.used]
        self.store[kept : self.used] = SEPARATOR
        self.evicted_tokens += keep_from
        self.used = kept

    def match(self, context: np.ndarray, depth: int) -> tuple[list, int]:
        """(continuations of the longest match of ``context`` [M] in the store, match length)."""
        with self._lock:
            ends, length = longest_match(self.store, context, self.used)
            return (continuations(self.store, ends, self.used, depth), length) if length else ([], 0)

    def stats(self) -> dict:
        return {"suffix_cache_tokens": self.used, "suffix_cache_bytes": self.nbytes,
                "suffix_cache_requests": self.requests, "suffix_cache_evicted_tokens": self.evicted_tokens}


class RequestSuffix:
    """One request's suffix proposer: its own prompt and output, plus the shared cache of earlier outputs."""

    def __init__(self, max_context: int, cache: SuffixCache | None):
        self.history = np.zeros(max_context, dtype=np.int64)
        self.filled = 0
        self.cache = cache
        self.calibration = RequestCalibration(cache.calibration if cache is not None else Calibration())

    def tree(self, tokens: list, max_nodes: int, max_depth: int) -> SuffixTree:
        """The likelier of the two stores' trees for the text ``tokens`` (before any cost cut)."""
        self.history[self.filled : len(tokens)] = tokens[self.filled :]  # tokens only grow: copy the new tail
        self.filled = len(tokens)
        n = len(tokens)
        context = self.history[max(0, n - MAX_MATCH) : n]
        max_depth = min(max_depth, MAX_DEPTH)
        best = EMPTY_TREE
        # own text: occurrences ending before the last token (the context itself is not an occurrence)
        ends, length = longest_match(self.history, context, n - 1)
        candidates = [(continuations(self.history, ends, n, max_depth), length)] if length else []
        if self.cache is not None:
            candidates.append(self.cache.match(context, max_depth))
        for pieces, length in candidates:
            if not length:
                continue
            size = min(max_nodes, max(MIN_SPEC_NODES, int(MAX_SPEC_FACTOR * length)))
            tree = build_tree(pieces, length, self.calibration, size, max_depth)
            if tree.expected_tokens > best.expected_tokens:
                best = tree
        return best

    def observe(self, tree: SuffixTree, path: list) -> None:
        """Learn from a verified round: ``path`` = accepted node indices. Each expansion the verification visited
        (the root, then each accepted node) predicted the sum of its children's frequencies and hit when the
        target's token was one of them."""
        kids: dict = {}
        for node, parent in enumerate(tree.parents):
            kids.setdefault(parent, []).append(node)
        for step, expansion in enumerate([-1] + list(path)):
            children = kids.get(expansion)
            if not children:
                break
            depth = 0 if expansion == -1 else tree.depths[expansion]
            predicted = float(sum(tree.frequencies[c] for c in children))
            self.calibration.observe(tree.match_length + depth, predicted, step < len(path))
