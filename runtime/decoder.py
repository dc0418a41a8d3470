"""The speculative loop: draft proposes, target verifies in one pass, acceptance keeps it exact.

Legend for one round (chain):
  tokens   the committed sequence (prompt + output); its last token is *pending*: the
           target has not yet seen it, so its logits are unknown
  drafts   gamma tokens the draft proposes after ``tokens``
  rows     target logits for [pending, d_1 .. d_gamma]; row i scores the token after
           (pending, d_1..d_i): row i checks d_{i+1}, row gamma gives the bonus token
Each model has its own cache; ``feed`` for a model is always ``tokens[cache.length:]``
(the pending token, plus one more when the draft must catch up on the last round's final
draft or bonus token) followed by that round's candidates. After acceptance each cache
keeps only rows of committed tokens: rollback is moving a length.

``num_draft_tokens=0`` runs plain target-only decoding through the same code: the baseline.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .acceptance import greedy_accept, speculative_accept
from .cost_model import AutoDraftLength, Costs, calibrate
from .lookup import MAX_NGRAM, lookup_match, one_hot_rows
from .tree import (AUTO_TREE_BUDGET, AUTO_TREE_DEPTH, AUTO_TREE_WIDTH, ROOT, DraftTree, greedy_tree_accept,
                   allocate_children, parse_tree, pick_children, tree_size, tree_speculative_accept)
from .bundle import default_hash_cache, inside, open_bundle
from .fused_runner import make_runner  # fused-form bundles get a FusedRunner (helper fused)
from .model_runner import ModelRunner
from .sampling import SamplingConfig, greedy_token, sample, sampling_distribution
from .text import IncrementalDecoder, TextCodec

PREFILL_CHUNK = 64  # tokens per prefill pass: bounds the logits buffer at chunk x vocab floats
MAX_DRAFT_TOKENS = 16
AUTO_MAX_DRAFT_TOKENS = 8
# auto lookup: prior acceptance per matched n-gram size (a longer match predicts its continuation better)
LOOKUP_PRIOR_ACCEPTANCE = {1: 0.3, 2: 0.5, 3: 0.7}
MAX_TREE_NODES = 62  # one verify pass carries at most PREFILL_CHUNK tokens: the tree plus pending/catch-up
PROPOSERS = ("draft", "lookup", "hybrid")
DEFAULT_MAX_CONTEXT = 2048


class GenerationError(ValueError):
    """A request that cannot be served as given (prompt too long, empty, ...)."""


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    rounds: int = 0
    target_forwards: int = 0
    draft_forwards: int = 0
    proposed: int = 0
    accepted: int = 0
    lookup_rounds: int = 0  # rounds whose proposal came from prompt lookup
    tree_nodes: int = 0  # draft tree nodes verified (tree mode)
    prefill_seconds: float = 0.0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    decode_seconds: float = 0.0  # wall time of the decode loop (after prefill)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def mean_accepted_per_round(self) -> float:
        """Draft tokens accepted per target verify pass (each round also emits one target token)."""
        return self.accepted / self.rounds if self.rounds else 0.0

    @property
    def host_seconds(self) -> float:
        """Decode-loop time outside the onnxruntime runs: sampling, acceptance, bookkeeping."""
        return max(0.0, self.decode_seconds - self.draft_seconds - self.verify_seconds)

    @property
    def tokens_per_s(self) -> float:
        """Decode speed: new tokens per second of the decode loop (prefill excluded)."""
        return self.new_tokens / self.decode_seconds if self.decode_seconds > 0 else 0.0

    def as_dict(self) -> dict:
        names = ("acceptance_rate", "mean_accepted_per_round", "host_seconds", "tokens_per_s")
        return {**self.__dict__, **{name: getattr(self, name) for name in names}}

    def summary(self) -> str:
        return (
            f"{self.new_tokens} tokens, {self.tokens_per_s:.1f} tok/s decode, "
            f"acceptance {self.acceptance_rate:.2f} ({self.accepted}/{self.proposed}), "
            f"{self.mean_accepted_per_round:.2f} accepted/round, target passes {self.target_forwards}, "
            f"draft passes {self.draft_forwards}, time draft {self.draft_seconds:.2f}s verify {self.verify_seconds:.2f}s "
            f"host {self.host_seconds:.2f}s prefill {self.prefill_seconds:.2f}s"
        )


@dataclass
class GenerationResult:
    text: str
    token_ids: list  # new tokens only; includes EOS when one was generated
    stats: GenerationStats
    finish_reason: str  # "eos" | "length" | "stop"


@dataclass(frozen=True)
class _Request:
    prompt_ids: tuple
    max_new_tokens: int
    sampling: SamplingConfig
    num_draft_tokens: int | str  # or "auto"
    seed: int | None
    stop: tuple = field(default_factory=tuple)
    proposer: str = "draft"
    tree: tuple | str | None = None  # branching factors per depth, "auto", or None (a chain)
    stop_token_ids: frozenset = frozenset()  # e.g. a chat template's end-of-turn token: ends like EOS


class SpeculativeDecoder:
    """Load a bundle once; ``generate`` / ``stream`` many requests (one at a time per decoder)."""

    def __init__(self, bundle_dir: Path, manifest, target: ModelRunner, draft: ModelRunner | None, codec: TextCodec):
        self.bundle_dir = bundle_dir
        self.manifest = manifest
        self.target = target
        self.draft = draft
        self.codec = codec
        self.eos_ids = frozenset(manifest.target.eos_token_ids)
        self.max_context = target.max_context
        self._busy = threading.Lock()
        self._costs: Costs | None = None
        self._plan = None  # the running request's proposal plan (sees every pass's cost)

    def fork(self) -> "SpeculativeDecoder":
        """A decoder for another thread: shares this one's onnxruntime sessions (weights loaded once),
        tokenizer and measured costs; owns new KV caches and IO bindings (N workers cost N caches)."""
        clone = SpeculativeDecoder(self.bundle_dir, self.manifest, self.target.fork(),
                                   self.draft.fork() if self.draft is not None else None, self.codec)
        clone._costs = self._costs
        return clone

    def costs(self) -> Costs:
        """This machine's measured pass costs (calibrated once, on first use of "auto" or here)."""
        with self._exclusive():
            return self._measured_costs()

    def _measured_costs(self) -> Costs:
        if self._costs is None:
            self._costs = calibrate(self.target, self.draft, max_tokens=AUTO_MAX_DRAFT_TOKENS + 1)
        return self._costs

    @classmethod
    def load(cls, bundle_dir, provider: str = "cpu", max_context: int | None = None, threads: int | None = None,
             verify: bool = True) -> "SpeculativeDecoder":
        """Open ``bundle_dir`` (checking every file's sha256 unless ``verify=False``) on an ORT provider.

        ``max_context`` sizes the preallocated KV caches (default: 2048, or the target's max positions if smaller).
        """
        root = Path(bundle_dir)
        manifest = open_bundle(root, verify=verify, hash_cache=default_hash_cache())
        if max_context is None:
            max_context = min(DEFAULT_MAX_CONTEXT, manifest.target.max_positions)
        if not 2 <= max_context <= manifest.target.max_positions:
            raise ValueError(f"max_context must be in 2..{manifest.target.max_positions} (the target's max positions)")
        step_tokens = max(PREFILL_CHUNK, MAX_DRAFT_TOKENS + 2)
        _check_memory(root, manifest, max_context, step_tokens, provider)
        if provider == "tensorrt-native":
            runners = _tensorrt_runners(root, manifest, max_context)
        else:
            runners = {
                role: make_runner(str(inside(root, spec.onnx_file)), spec, provider, max_context, step_tokens, threads)
                for role, spec in manifest.models().items()
            }
        codec = TextCodec(inside(root, manifest.tokenizer_file))
        return cls(root, manifest, runners["target"], runners.get("draft"), codec)

    # ----------------------------------------------------------------- public API
    def generate(self, prompt, max_new_tokens: int = 128, sampling: SamplingConfig | None = None,
                 num_draft_tokens: int | str = "auto", seed: int | None = 0, stop: Sequence[str] = (),
                 proposer: str | None = None, tree=None, stop_token_ids: Sequence[int] = ()) -> GenerationResult:
        """Generate up to ``max_new_tokens`` after ``prompt`` (text or token ids).

        num_draft_tokens: tokens proposed per round, "auto" (chosen each round from measured costs and
        the running acceptance; falls back to plain decoding when speculation would lose) or 0 (target only).
        proposer: "draft" (the draft model), "lookup" (n-gram prompt lookup, no draft model needed) or
        "hybrid" (lookup when the text repeats, the draft model otherwise; with "auto", whichever promises
        more tokens per second). Default: "hybrid", or "lookup" for a bundle without a draft.
        tree: None (a chain of drafts), branching factors per depth such as "4,2,2,1" or (2, 2, 1), or "auto"
        (a dynamic tree grown from the draft's confidence within a node budget); verified in one target pass.
        """
        request = self._request(prompt, max_new_tokens, sampling, num_draft_tokens, seed, stop, proposer, tree,
                                stop_token_ids)
        with self._exclusive():
            stats = GenerationStats(prompt_tokens=len(request.prompt_ids))
            output: list[int] = []
            finish = "length"
            for new_ids, finish in self._rounds(request, stats):
                output.extend(new_ids)
        text = self.codec.decode(output)
        if finish == "stop":
            text = _cut_at_stop(text, request.stop)
        return GenerationResult(text=text, token_ids=output, stats=stats, finish_reason=finish)

    def stream(self, prompt, max_new_tokens: int = 128, sampling: SamplingConfig | None = None,
               num_draft_tokens: int | str = "auto", seed: int | None = 0, stop: Sequence[str] = (),
               proposer: str | None = None, tree=None, stats: GenerationStats | None = None,
               stop_token_ids: Sequence[int] = ()) -> Iterator[str]:
        """Yield text pieces as rounds complete; the same tokens as ``generate`` with the same arguments."""
        request = self._request(prompt, max_new_tokens, sampling, num_draft_tokens, seed, stop, proposer, tree,
                                stop_token_ids)
        stats = stats if stats is not None else GenerationStats()
        stats.prompt_tokens = len(request.prompt_ids)
        with self._exclusive():
            detok = IncrementalDecoder(self.codec)
            emitted = ""
            for new_ids, finish in self._rounds(request, stats):
                piece = detok.push(new_ids)
                if finish == "stop":
                    piece += detok.flush()
                    piece = _cut_at_stop(emitted + piece, request.stop)[len(emitted):]
                emitted += piece
                if piece:
                    yield piece
            tail = detok.flush()
            if tail:
                yield tail

    # ----------------------------------------------------------------- validation
    def _request(self, prompt, max_new_tokens, sampling, num_draft_tokens, seed, stop, proposer, tree=None,
                 stop_token_ids=()) -> _Request:
        if isinstance(prompt, str):
            if not prompt:
                raise GenerationError("prompt is empty: give some text or token ids")
            prompt_ids = self.codec.encode(prompt)
        else:
            prompt_ids = [int(t) for t in prompt]
            vocab = self.manifest.target.vocab_size
            if any(t < 0 or t >= vocab for t in prompt_ids):
                raise GenerationError(f"prompt token ids must be in 0..{vocab - 1}")
        if not prompt_ids:
            raise GenerationError("prompt is empty: give some text or token ids")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise GenerationError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        if proposer is None:
            proposer = "draft" if tree is not None else ("hybrid" if self.draft is not None else "lookup")
        if proposer not in PROPOSERS:
            raise GenerationError(f"proposer must be one of {', '.join(PROPOSERS)}, got {proposer!r}")
        if num_draft_tokens == "auto":
            longest = AUTO_MAX_DRAFT_TOKENS
        elif isinstance(num_draft_tokens, bool) or not isinstance(num_draft_tokens, int) or not (
            0 <= num_draft_tokens <= MAX_DRAFT_TOKENS
        ):
            raise GenerationError(
                f"num_draft_tokens must be \"auto\" or an integer in 0..{MAX_DRAFT_TOKENS}, got {num_draft_tokens!r}"
            )
        else:
            longest = num_draft_tokens
        if proposer in ("draft", "hybrid") and self.draft is None and num_draft_tokens != 0:
            raise GenerationError(f"this bundle has no draft model: use proposer=\"lookup\" or num_draft_tokens=0")
        sampling = sampling if sampling is not None else SamplingConfig()
        if not isinstance(sampling, SamplingConfig):
            raise GenerationError("sampling must be a SamplingConfig")
        tree = parse_tree(tree)
        if tree is not None:
            if self.draft is None or proposer != "draft":
                raise GenerationError("tree drafting needs a draft model and proposer=\"draft\"")
            nodes = AUTO_TREE_BUDGET if tree == "auto" else tree_size(tree)
            if nodes > MAX_TREE_NODES:
                raise GenerationError(f"a tree of {nodes} nodes exceeds the {MAX_TREE_NODES} nodes one pass may verify")
            longest = max(longest, nodes)
        needed = len(prompt_ids) + max_new_tokens + longest + 1
        if needed > self.max_context:
            raise GenerationError(
                f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({max_new_tokens}) + draft tokens "
                f"({longest}) + 1 = {needed} exceeds max_context {self.max_context}: "
                "shorten the prompt, lower max_new_tokens, or load with a larger max_context"
            )
        stop = (stop,) if isinstance(stop, str) else tuple(stop)
        if any(not s for s in stop):
            raise GenerationError("stop strings must be non-empty")
        vocab = self.manifest.target.vocab_size
        stop_ids = frozenset(int(t) for t in stop_token_ids)
        if any(not 0 <= t < vocab for t in stop_ids):
            raise GenerationError(f"stop_token_ids must be in 0..{vocab - 1}")
        return _Request(tuple(prompt_ids), max_new_tokens, sampling, num_draft_tokens, seed, stop, proposer, tree,
                        stop_ids)

    def _exclusive(self):
        decoder = self

        class _Guard:
            def __enter__(self):
                if not decoder._busy.acquire(blocking=False):
                    raise RuntimeError(
                        "this SpeculativeDecoder is already generating in another thread: "
                        "use one decoder per thread (each holds its own KV cache)"
                    )

            def __exit__(self, *exc):
                decoder._busy.release()

        return _Guard()

    # ----------------------------------------------------------------- the loop
    def _rounds(self, request: _Request, stats: GenerationStats) -> Iterator[tuple[list, str]]:
        """Yield (new token ids, finish reason or "") per round."""
        config = request.sampling
        rng = np.random.default_rng(request.seed)
        tokens = list(request.prompt_ids)
        seen = set(tokens)
        plan = _ProposalPlan(self, request)
        runners = [self.target] + ([self.draft] if plan.uses_draft else [])
        started = time.perf_counter()
        for runner in runners:
            runner.reset()
            self._catch_up(runner, tokens, stats)
        stats.prefill_seconds = time.perf_counter() - started
        self._plan = plan
        try:
            stats.verify_seconds = stats.draft_seconds = 0.0
            started = time.perf_counter()
            produced = 0
            while produced < request.max_new_tokens:
                budget = request.max_new_tokens - produced - 1  # the round's own target token needs one slot
                source, new, proposed, accepted = self._one_round(plan, tokens, seen, budget, config, rng, stats)
                plan.observe(source, proposed, accepted)
                finish = ""
                for index, token in enumerate(new):
                    if token in self.eos_ids or token in request.stop_token_ids:
                        new, finish = new[: index + 1], "eos" if token in self.eos_ids else "stop"
                        break
                if request.stop:
                    new, stopped = self._stop_check(tokens[len(request.prompt_ids):], new, request.stop)
                    finish = "stop" if stopped else finish
                tokens.extend(new)
                seen.update(new)
                produced += len(new)
                stats.rounds += 1
                stats.proposed += proposed
                stats.accepted += accepted
                stats.lookup_rounds += source == "lookup"
                stats.new_tokens = produced
                if not finish and produced >= request.max_new_tokens:
                    finish = "length"
                stats.decode_seconds = time.perf_counter() - started
                yield new, finish
                if finish:
                    return
            stats.decode_seconds = time.perf_counter() - started
        finally:
            self._plan = None

    def _one_round(self, plan, tokens, seen, budget, config, rng, stats) -> tuple[str, list, int, int]:
        """Propose, verify in one target pass, accept: (proposal source, new tokens, proposed, accepted)."""
        if plan.tree is not None and budget > 0:
            new, accepted, proposed = self._tree_round(tokens, seen, plan.tree, budget, config, rng, stats)
            return "tree", new, proposed, accepted
        source, drafts = plan.propose(tokens, budget, len(tokens) - self.draft.length if plan.uses_draft else 0)
        draft_dists = []
        if source == "draft":
            drafts, draft_dists = self._propose(tokens, seen, len(drafts), config, rng, stats)
        elif source == "lookup" and not config.greedy:
            draft_dists = list(one_hot_rows(drafts, self.manifest.target.vocab_size))
        accepted, next_token = self._verify(tokens, seen, drafts, draft_dists, config, rng, stats)
        if source == "draft":
            # the draft's cache holds tokens + drafts[:-1]; keep only what was committed
            self.draft.length = min(self.draft.length, len(tokens) + accepted)
        return source, drafts[:accepted] + [next_token], len(drafts), accepted

    def _timed_forward(self, runner: ModelRunner, feed, first_position, stats: GenerationStats, **tree):
        """One pass, timed into ``stats``. first_position: an int (a chain from there) or explicit positions;
        ``tree``: parents / visible_past for tree passes."""
        positions = range(first_position, first_position + len(feed)) if isinstance(first_position, int) else first_position
        begin = time.perf_counter()
        logits = runner.forward(feed, positions, **tree)
        elapsed = time.perf_counter() - begin
        role = "target" if runner is self.target else "draft"
        if role == "target":
            stats.verify_seconds += elapsed
            stats.target_forwards += 1
        else:
            stats.draft_seconds += elapsed
            stats.draft_forwards += 1
        if self._plan is not None:
            self._plan.observe_pass(role, len(feed), elapsed)
        return logits

    def _catch_up(self, runner: ModelRunner, tokens: list, stats: GenerationStats) -> None:
        """Feed, in chunks, the tokens the runner's cache lacks, leaving at most the last 2 for the next step's feed."""
        while runner.length < len(tokens) - 2:
            chunk = tokens[runner.length : min(len(tokens) - 2, runner.length + PREFILL_CHUNK)]
            self._timed_forward(runner, chunk, runner.length, stats)
            runner.commit(len(chunk))

    def _propose(self, tokens, seen, gamma, config, rng, stats):
        """The draft's gamma tokens and, when sampling, the distributions it really drew them from."""
        draft = self.draft
        self._catch_up(draft, tokens, stats)
        drafts, dists = [], []
        feed = tokens[draft.length :]
        for _ in range(gamma):
            logits = self._timed_forward(draft, feed, draft.length, stats)
            draft.commit(len(feed))
            token, dist = self._draft_step(logits[-1], _context(seen, drafts, config), config, rng)
            if dist is not None:
                dists.append(dist)
            drafts.append(token)
            if token in self.eos_ids:
                break
            feed = [token]
        return drafts, dists

    @staticmethod
    def _draft_step(logits, context, config: SamplingConfig, rng):
        """(token, the distribution it was drawn from, all processors applied; None when greedy)."""
        if config.greedy:
            return greedy_token(logits, context, config), None
        dist = sampling_distribution(logits, context, config)
        return sample(dist, rng), dist

    def _verify(self, tokens, seen, drafts, draft_dists, config, rng, stats) -> tuple[int, int]:
        """One target pass over [pending, *drafts]; returns (accepted count, recovered or bonus token)."""
        target = self.target
        self._catch_up(target, tokens, stats)
        feed = tokens[target.length :] + drafts
        logits = self._timed_forward(target, feed, target.length, stats)
        rows = logits[len(feed) - len(drafts) - 1 :]  # [gamma + 1, V]: row i scores the token after d_1..d_i
        if config.greedy:
            choices = np.array([greedy_token(rows[i], _context(seen, drafts[:i], config), config)
                                for i in range(len(drafts) + 1)])
            accepted, next_token = greedy_accept(np.array(drafts, dtype=np.int64), choices)
        else:
            target_dists = np.stack([sampling_distribution(rows[i], _context(seen, drafts[:i], config), config)
                                     for i in range(len(drafts) + 1)])
            draft_probs = np.stack(draft_dists) if drafts else np.zeros((0, rows.shape[1]))
            accepted, next_token = speculative_accept(np.array(drafts, dtype=np.int64), draft_probs, target_dists, rng)
        target.commit(len(feed) - len(drafts) + accepted)
        return accepted, next_token

    # ----------------------------------------------------------------- trees
    def _node_distribution(self, logits, context, config: SamplingConfig) -> np.ndarray:
        """The distribution a node's children are drawn from (greedy: the softmax of the penalized logits, for ranking)."""
        if config.greedy:
            return sampling_distribution(logits, context, SamplingConfig(temperature=1.0,
                                                                         repetition_penalty=config.repetition_penalty))
        return sampling_distribution(logits, context, config)

    def _grow_tree(self, tokens, seen, shape, budget, config, rng, stats) -> DraftTree:
        """Draft a tree level by level: one draft pass per level, each node seeing only its ancestors."""
        draft = self.draft
        self._catch_up(draft, tokens, stats)
        feed = tokens[draft.length :]
        logits = self._timed_forward(draft, feed, draft.length, stats)
        draft.commit(len(feed))
        base = draft.length  # == len(tokens): tree node i is written at slot base + i
        tree = DraftTree(tokens=[], parents=[], depths=[], fed=0, draw_dists={})
        root_dist = self._node_distribution(logits[-1], _context(seen, [], config), config)
        tree.draw_dists[0] = root_dist
        dynamic = shape == "auto"
        widths = [AUTO_TREE_WIDTH] * AUTO_TREE_DEPTH if dynamic else list(shape)
        frontier = [(ROOT, [], 1.0)]  # (node, path tokens, cumulative draft probability)
        for depth, width in enumerate(widths, start=1):
            if dynamic:  # children per node from the draft's confidence, within the node budget
                slots = min(AUTO_TREE_WIDTH, AUTO_TREE_BUDGET - len(tree.tokens))
                counts = allocate_children([f[2] for f in frontier], [tree.draw_dists[f[0] + 1] for f in frontier], slots)
            else:
                counts = [width] * len(frontier)
            candidates = []
            for (parent, path, score), count in zip(frontier, counts):
                dist = tree.draw_dists[parent + 1]
                for token in pick_children(dist, count, config.greedy, rng):
                    candidates.append((parent, path + [token], score * float(dist[token])))
            room = MAX_TREE_NODES - len(tree.tokens)
            candidates = [c for c in candidates if len(c[1]) <= budget][: max(room, 0)]
            if not candidates:
                break
            first = len(tree.tokens)
            for parent, path, _ in candidates:
                tree.tokens.append(path[-1])
                tree.parents.append(parent)
                tree.depths.append(depth)
            last_level = depth == len(widths) or (dynamic and len(tree.tokens) >= AUTO_TREE_BUDGET)
            if last_level or depth >= budget:
                break
            level = range(first, len(tree.tokens))
            visible_past = np.zeros((len(level), draft.length), dtype=bool)
            visible_past[:, :base] = True
            for row, node in enumerate(level):
                for ancestor in tree.path_to(node)[:-1]:
                    visible_past[row, base + ancestor] = True
            logits = self._timed_forward(draft, [tree.tokens[n] for n in level], [base - 1 + depth] * len(level), stats,
                                         parents=[-1] * len(level), visible_past=visible_past)
            draft.commit(len(level))
            tree.fed = len(tree.tokens)
            frontier = []
            for row, (node, (parent, path, score)) in enumerate(zip(level, candidates)):
                tree.draw_dists[node + 1] = self._node_distribution(logits[row], _context(seen, path, config), config)
                frontier.append((node, path, score))
        return tree

    def _tree_round(self, tokens, seen, shape, budget, config, rng, stats) -> tuple[list, int, int]:
        """One tree round: grow, verify in one target pass, accept a path, compact both caches.

        Returns (new tokens, accepted draft tokens, proposed depth)."""
        tree = self._grow_tree(tokens, seen, shape, budget, config, rng, stats)
        target, draft = self.target, self.draft
        self._catch_up(target, tokens, stats)
        prefix = tokens[target.length :]
        start = target.length
        root_row = len(prefix) - 1
        feed = prefix + tree.tokens
        parents = list(range(-1, len(prefix) - 1)) + [root_row if p == ROOT else len(prefix) + p for p in tree.parents]
        positions = list(range(start, start + len(prefix))) + [start + root_row + d for d in tree.depths]
        logits = self._timed_forward(target, feed, positions, stats, parents=parents)

        def context_at(expansion):
            path = [] if expansion == 0 else [tree.tokens[n] for n in tree.path_to(expansion - 1)]
            return _context(seen, path, config)

        def row(expansion):
            return logits[root_row + expansion]

        if config.greedy:
            path, next_token = greedy_tree_accept(tree, lambda e: greedy_token(row(e), context_at(e), config))
        else:
            path, next_token = tree_speculative_accept(
                tree, lambda e: sampling_distribution(row(e), context_at(e), config), rng)
        # KV compaction: the accepted path's rows move next to the committed ones; nothing else moves
        target_first = start + len(prefix)
        target.move_rows(np.array([target_first + n for n in path], dtype=np.int64), target_first)
        target.length = target_first + len(path)
        draft_first = len(tokens)
        fed_path = [n for n in path if n < tree.fed]
        draft.move_rows(np.array([draft_first + n for n in fed_path], dtype=np.int64), draft_first)
        draft.length = draft_first + len(fed_path)
        stats.tree_nodes += len(tree.tokens)
        return [tree.tokens[n] for n in path] + [next_token], len(path), max(tree.depths, default=0)

    def _stop_check(self, output: list, new: list, stops: tuple) -> tuple[list, bool]:
        """Cut ``new`` right after the token that completes a stop string, if any."""
        for count in range(1, len(new) + 1):
            text = self.codec.decode(output + new[:count])
            if any(stop in text for stop in stops):
                return new[:count], True
        return new, False


def _check_memory(root: Path, manifest, max_context: int, step_tokens: int, provider: str) -> None:
    """Refuse, before allocating, a load that cannot fit (host RAM, or the GPU's free memory)."""
    from specdec.engines.memory import available_host_memory, budget, check_fits

    available = available_host_memory()
    if provider in ("cuda", "tensorrt", "tensorrt-native"):
        try:
            from specdec.engines.cuda_memory import free_device_memory

            available = free_device_memory()
        except (ValueError, RuntimeError):
            pass  # no cuda-python: the provider check reports what is missing
    if available is not None:
        check_fits(budget(root, manifest, max_context, step_tokens), manifest, available, max_context)


def _tensorrt_runners(root: Path, manifest, max_context: int) -> dict:
    from specdec.engines.profiles import ProfileLimits
    from specdec.engines.records import verified_engine
    from specdec.engines.tensorrt_build import current_device
    from specdec.engines.tensorrt_runner import TensorRTRunner

    device = current_device()
    runners = {}
    for role, spec in manifest.models().items():
        path, record = verified_engine(root, manifest, role, device)
        limits = ProfileLimits(record.max_context, record.max_verify, record.max_prefill)
        runners[role] = TensorRTRunner(str(path), spec, limits, max_context)
    return runners


def _context(seen: set, candidates: list, config: SamplingConfig) -> np.ndarray:
    """Unique ids a position sees for the repetition penalty: the sequence plus earlier candidates."""
    if config.repetition_penalty == 1.0:
        return _EMPTY
    return np.fromiter(seen.union(candidates), dtype=np.int64)


_EMPTY = np.zeros(0, dtype=np.int64)


def _cut_at_stop(text: str, stops: tuple) -> str:
    cut = min((text.find(stop) for stop in stops if stop in text), default=-1)
    return text if cut < 0 else text[:cut]


class _ProposalPlan:
    """Per request: where each round's proposal comes from and how long it is.

    Auto lengths: one controller for the draft model and one per matched n-gram size for lookup
    (a 3-gram match's continuation is accepted far more often than a 1-gram's: one pooled rate
    would send too few tokens after long matches and too many after short ones). Auto hybrid
    takes whichever proposal promises more tokens per second this round; the draft's side is
    charged the catch-up pass over the tokens lookup rounds committed since the draft last ran.
    """

    def __init__(self, decoder: SpeculativeDecoder, request: _Request):
        self.request = request
        self.auto = request.num_draft_tokens == "auto"
        self.uses_draft = decoder.draft is not None and request.proposer in ("draft", "hybrid") and (
            self.auto or request.num_draft_tokens > 0 or request.tree is not None
        )
        self.uses_lookup = request.proposer in ("lookup", "hybrid")
        self.tree = request.tree
        self.model_auto = None
        self.lookup_autos: dict = {}
        self.lookup_size = 0  # n-gram size of the latest lookup proposal
        if self.auto and (self.uses_draft or self.uses_lookup):
            costs = decoder._measured_costs()
            if self.uses_draft:
                self.model_auto = AutoDraftLength(costs, max_gamma=AUTO_MAX_DRAFT_TOKENS)
            if self.uses_lookup:
                # a lookup proposal costs nothing to make: only the verify pass grows with its length
                self.lookup_autos = {
                    size: AutoDraftLength(Costs(0.0, costs.verify), max_gamma=AUTO_MAX_DRAFT_TOKENS,
                                          prior_acceptance=LOOKUP_PRIOR_ACCEPTANCE[size])
                    for size in range(1, MAX_NGRAM + 1)
                }
        self.history = np.zeros(decoder.max_context, dtype=np.int64)
        self.filled = 0

    def propose(self, tokens: list, budget: int, draft_lag: int = 0) -> tuple[str, list]:
        """("draft", [None] * gamma) asks the draft model for gamma tokens; ("lookup", ids); ("none", []).

        ``draft_lag``: committed tokens the draft model has not read yet."""
        if budget <= 0:
            return "none", []
        found = []
        if self.uses_lookup:
            limit = min(AUTO_MAX_DRAFT_TOKENS if self.auto else self.request.num_draft_tokens, budget)
            if limit > 0:
                self.history[self.filled : len(tokens)] = tokens[self.filled :]  # tokens only grow: copy the new tail
                self.filled = len(tokens)
                # fixed-length hybrid trusts only 2-gram matches over the draft; auto weighs every match (below)
                min_ngram = 2 if self.uses_draft and not self.auto else 1
                found, self.lookup_size = lookup_match(self.history[: len(tokens)], limit, min_ngram=min_ngram)
                if found and self.auto:
                    found = found[: self.lookup_autos[self.lookup_size].choose()]
        gamma = 0
        if self.uses_draft:
            gamma = min(self.model_auto.choose() if self.auto else self.request.num_draft_tokens, budget)
        if found and gamma and self.auto:
            lookup_rate = self.lookup_autos[self.lookup_size].tokens_per_second(len(found))
            catch_up = self.model_auto.draft_catch_up(draft_lag)
            if self.model_auto.tokens_per_second(gamma, extra_seconds=catch_up) > lookup_rate:
                return "draft", [None] * gamma
            return "lookup", found
        if found:
            return "lookup", found
        if gamma > 0:
            return "draft", [None] * gamma
        return "none", []

    def observe_pass(self, role: str, tokens: int, seconds: float) -> None:
        if self.model_auto is not None:
            self.model_auto.observe_pass(role, tokens, seconds)
        if role == "target":
            for controller in self.lookup_autos.values():
                controller.observe_pass(role, tokens, seconds)

    def observe(self, source: str, proposed: int, accepted: int) -> None:
        controller = self.model_auto if source == "draft" else self.lookup_autos.get(self.lookup_size)
        if source in ("draft", "lookup") and controller is not None:
            controller.observe(proposed, accepted)
