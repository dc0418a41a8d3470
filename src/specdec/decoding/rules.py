"""How rows of logits become tokens, per request: greedy, coupled (seeded, schedule-free), or rejection.

- ``greedy`` (temperature 0): the argmax of the penalized logits; verification accepts a
  proposal while it equals the target's argmax.
- ``coupled`` (the default when sampling): the token at absolute position i is the coupled sample
  ``argmax probs / E_i`` with the seed's noise for position i (sampling/coupling.py); proposals
  use the same noise and are accepted while they equal the target's coupled token, so the
  output is the target's own seeded sample whatever proposed it.
- ``rejection``: modified rejection sampling (sampling/acceptance.py, decoding/tree.py): accept
  d with probability min(1, p/q), else draw from the residual; draws come from one RNG in the
  order the rounds make them, so a fixed schedule reproduces, an adaptive one need not.

Positions: ``position`` arguments are absolute indices in the sequence (prompt + output) of the
token being chosen, never positions within a round.
"""

from __future__ import annotations

import numpy as np

from specdec.sampling.acceptance import greedy_accept, one_hot_rows, speculative_accept
from specdec.sampling.coupling import coupled_token, coupled_top_k
from specdec.sampling.processors import (SamplingConfig, biased, greedy_token, penalized_scores, sample,
                                        sampling_distribution)
from specdec.decoding.constraint import GrammarGuide, TokenLogprob, masked
from specdec.decoding.tree import DraftTree, greedy_tree_accept, pick_children, tree_speculative_accept


class TokenRule:
    """``guide``: the request's grammar (decoding/constraint.py) or None; every row of logits is masked by the
    grammar state after its own prefix (``path``: the tokens between the committed output and the row)
    before any processor. ``logprobs``: None, or a dict the rule fills with each emitted token's
    ``TokenLogprob`` by absolute position, ``top_logprobs`` alternatives each."""

    def __init__(self, config: SamplingConfig, acceptance: str, noise, rng: np.random.Generator,
                 guide: GrammarGuide | None = None, logprobs: dict | None = None, top_logprobs: int = 0):
        self.config = config
        self.mode = "greedy" if config.greedy else acceptance
        self.noise = noise  # PositionNoise
        self.rng = rng
        self.guide = guide
        self.logprobs = logprobs
        self.top_logprobs = top_logprobs

    # ------------------------------------------------------------ the constraint
    def allowed(self, path) -> np.ndarray | None:
        """[V] bool of the tokens the grammar allows after the committed output + ``path`` (None: no constraint)."""
        return None if self.guide is None else self.guide.mask(path)

    def constrained(self, logits: np.ndarray, path) -> np.ndarray:
        """The row as the processors see it: disallowed tokens at -inf."""
        return logits if self.guide is None else masked(logits, self.guide.mask(path))

    def target_distribution(self, logits: np.ndarray, context: np.ndarray, path=()) -> np.ndarray:
        """[V] the exact distribution the target's token after ``path`` is drawn from (constraint included)."""
        return sampling_distribution(self.constrained(logits, path), context, self.config)

    def draft_row(self, logits: np.ndarray, path) -> np.ndarray:
        """A draft's row, masked. A draft that scores none of the allowed tokens (a pruned vocabulary without
        them) proposes from the allowed tokens uniformly: any proposal distribution keeps verification exact."""
        row = self.constrained(logits, path)
        if self.guide is not None and not np.isfinite(row.max()):
            allowed = self.guide.mask(path)
            if allowed is not None:
                row = np.where(allowed, np.float32(0.0), np.float32(-np.inf))
        return row

    # ------------------------------------------------------------ one position
    def choose(self, logits: np.ndarray, context: np.ndarray, position: int, path=()) -> int:
        """The target's token at ``position`` (greedy or coupled; not used by rejection sampling).

        logits: [V] raw; context: [N] ids the repetition penalty sees; path: the tokens after the committed
        output before ``position`` (the constraint's state)."""
        if self.mode == "greedy":
            if self.guide is not None and self.config.repetition_penalty == 1.0 and not self.config.logit_bias:
                allowed = self.guide.mask(path)
                best = int(np.argmax(logits))
                if allowed is None or (allowed[best] and np.isfinite(logits[best])):
                    return best  # the unconstrained argmax is allowed: it is the constrained argmax
                return greedy_token(masked(logits, allowed), context, self.config)
            return greedy_token(self.constrained(logits, path), context, self.config)
        return coupled_token(self.target_distribution(logits, context, path), self.noise.at(position))

    def propose(self, logits: np.ndarray, context: np.ndarray, position: int,
                path=()) -> tuple[int, np.ndarray | None]:
        """The draft's token at ``position`` and, for rejection sampling, the distribution it was drawn from
        (the draft's row masked by the grammar, as the target's is: its proposals stay allowed)."""
        logits = self.draft_row(logits, path)
        if self.mode == "rejection":
            dist = sampling_distribution(logits, context, self.config)
            return sample(dist, self.rng), dist
        if self.mode == "greedy":
            return greedy_token(logits, context, self.config), None
        return coupled_token(sampling_distribution(logits, context, self.config), self.noise.at(position)), None

    def sampled_rows(self, tokens: list, vocab: int) -> list:
        """What a deterministic proposer (lookup) 'sampled' from: one-hot rows, for rejection sampling only."""
        return list(one_hot_rows(tokens, vocab)) if self.mode == "rejection" else []

    # ------------------------------------------------------------ verification
    def verify_chain(
        self,
        rows: np.ndarray,  # [gamma + 1, V]: row i scores the token after the first i proposals
        contexts: list,  # [gamma + 1] of [N]: the penalty context of each row
        proposals: list,  # [gamma] proposed ids
        draft_dists: list,  # [gamma] of [V]: the draft's distributions (rejection sampling only)
        first_position: int,  # absolute position of proposals[0]
    ) -> tuple[int, int]:
        """(accepted count, the recovered or bonus token)."""
        proposals = list(proposals)
        if self.guide is not None and self.mode == "rejection":
            # a proposal the grammar forbids is never accepted (p = 0), and no row after it can be scored: the
            # chain ends before it (rejection sampling scores every row; greedy / coupled stop at a mismatch,
            # and the target's token, always allowed, never matches a forbidden one)
            cut = self.guide.admissible(proposals)
            proposals, draft_dists = proposals[:cut], list(draft_dists)[:cut]
        accepted, token = self._verify_chain(rows, contexts, proposals, draft_dists, first_position)
        if self.logprobs is not None:
            for i in range(accepted + 1):
                emitted = proposals[i] if i < accepted else token
                self.record(first_position + i, rows[i], contexts[i], proposals[:i], emitted)
        return accepted, token

    def _verify_chain(self, rows, contexts, proposals, draft_dists, first_position) -> tuple[int, int]:
        proposed = np.array(proposals, dtype=np.int64)
        if self.mode == "rejection":
            target_probs = np.stack([self.target_distribution(rows[i], contexts[i], proposals[:i])
                                     for i in range(len(proposals) + 1)])
            draft_probs = np.stack(draft_dists) if proposals else np.zeros((0, rows.shape[1]))
            return speculative_accept(proposed, draft_probs, target_probs, self.rng)
        # greedy / coupled: the target's own token at each position, only as far as needed
        choices = []
        for i in range(len(proposals) + 1):
            choices.append(self.choose(rows[i], contexts[i], first_position + i, proposals[:i]))
            if i < len(proposals) and choices[i] != proposals[i]:
                return i, choices[i]
        return greedy_accept(proposed, np.array(choices, dtype=np.int64))

    # ------------------------------------------------------------ logprobs
    def record(self, position: int, logits: np.ndarray, context: np.ndarray, path, token: int) -> None:
        """The emitted ``token``'s log-probability at ``position`` under the target's processed distribution:
        sampling: the distribution it is drawn from (constraint, penalty, temperature, top-k/p, min-p);
        greedy: the constrained, penalized softmax at temperature 1 (greedy takes its argmax)."""
        row = self.constrained(logits, path)
        if self.mode == "greedy":
            scores = penalized_scores(biased(row, self.config.logit_bias), context,
                                      self.config.repetition_penalty).astype(np.float64)
            top = np.max(scores)
            with np.errstate(divide="ignore"):
                logp = scores - top - np.log(np.sum(np.exp(scores - top)))
        else:
            with np.errstate(divide="ignore"):
                logp = np.log(sampling_distribution(row, context, self.config))
        alternatives = ()
        k = min(self.top_logprobs, int(np.count_nonzero(np.isfinite(logp))))
        if k > 0:
            best = np.argpartition(-logp, k - 1)[:k]
            best = best[np.argsort(-logp[best], kind="stable")]
            alternatives = tuple((int(t), float(logp[t])) for t in best)
        self.logprobs[position] = TokenLogprob(int(token), float(logp[int(token)]), alternatives)

    # ------------------------------------------------------------ trees
    def node_distribution(self, logits: np.ndarray, context: np.ndarray, path=()) -> np.ndarray:
        """[V] the distribution a node's children are drawn from (greedy: the penalized softmax, to rank them);
        ``path``: the node's tokens after the committed output (the grammar masks the draft's row)."""
        logits = self.draft_row(logits, path)
        if self.mode == "greedy":
            ranking = SamplingConfig(temperature=1.0, repetition_penalty=self.config.repetition_penalty,
                                     logit_bias=self.config.logit_bias)
            return sampling_distribution(logits, context, ranking)
        return sampling_distribution(logits, context, self.config)

    def children(self, dist: np.ndarray, count: int, position: int) -> list:
        """``count`` distinct child tokens from ``dist`` [V] for the children landing at ``position``."""
        if self.mode == "coupled":
            return coupled_top_k(dist, self.noise.at(position), count)
        return pick_children(dist, count, self.mode == "greedy", self.rng)

    def verify_tree(self, tree: DraftTree, row, context_at, position_at) -> tuple[list, int]:
        """(accepted node path, recovered or bonus token). row(e) [V] logits, context_at(e) [N], position_at(e):
        for expansion e (0 = the root, i + 1 = node i). Only the accepted path's expansions are scored; the
        grammar's state for expansion e is the path of tokens from the root to node e - 1."""

        def path_of(e):
            return [] if e == 0 else [tree.tokens[n] for n in tree.path_to(e - 1)]

        if self.mode == "rejection":
            path, token = tree_speculative_accept(
                tree, lambda e: self.target_distribution(row(e), context_at(e), path_of(e)), self.rng)
        else:
            path, token = greedy_tree_accept(
                tree, lambda e: self.choose(row(e), context_at(e), position_at(e), path_of(e)))
        if self.logprobs is not None:
            expansions = [0] + [node + 1 for node in path]
            emitted = [tree.tokens[node] for node in path] + [token]
            for e, chosen in zip(expansions, emitted):
                self.record(position_at(e), row(e), context_at(e), path_of(e), chosen)
        return path, token
