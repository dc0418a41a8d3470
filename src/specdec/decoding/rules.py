"""How rows of logits become tokens, per request: greedy, coupled (seeded, schedule-free), or rejection.

- ``greedy`` (temperature 0): the argmax of the penalized logits; verification accepts a
  proposal while it equals the target's argmax.
- ``coupled`` (the default when sampling): the token at absolute position i is the coupled sample
  ``argmax probs / E_i`` with the seed's noise for position i (runtime/coupling.py); proposals
  use the same noise and are accepted while they equal the target's coupled token, so the
  output is the target's own seeded sample whatever proposed it.
- ``rejection``: modified rejection sampling (runtime/acceptance.py, runtime/tree.py): accept
  d with probability min(1, p/q), else draw from the residual; draws come from one RNG in the
  order the rounds make them, so a fixed schedule reproduces, an adaptive one need not.

Positions: ``position`` arguments are absolute indices in the sequence (prompt + output) of the
token being chosen, never positions within a round.
"""

from __future__ import annotations

import numpy as np

from specdec.sampling.acceptance import greedy_accept, speculative_accept
from specdec.sampling.coupling import coupled_token, coupled_top_k
from specdec.decoding.lookup import one_hot_rows
from specdec.sampling.processors import SamplingConfig, greedy_token, sample, sampling_distribution
from specdec.decoding.tree import DraftTree, greedy_tree_accept, pick_children, tree_speculative_accept


class TokenRule:
    def __init__(self, config: SamplingConfig, acceptance: str, noise, rng: np.random.Generator):
        self.config = config
        self.mode = "greedy" if config.greedy else acceptance
        self.noise = noise  # PositionNoise
        self.rng = rng

    # ------------------------------------------------------------ one position
    def choose(self, logits: np.ndarray, context: np.ndarray, position: int) -> int:
        """The target's token at ``position`` (greedy or coupled; not used by rejection sampling).

        logits: [V] raw; context: [N] ids the repetition penalty sees."""
        if self.mode == "greedy":
            return greedy_token(logits, context, self.config)
        return coupled_token(sampling_distribution(logits, context, self.config), self.noise.at(position))

    def propose(self, logits: np.ndarray, context: np.ndarray, position: int) -> tuple[int, np.ndarray | None]:
        """The draft's token at ``position`` and, for rejection sampling, the distribution it was drawn from."""
        if self.mode == "rejection":
            dist = sampling_distribution(logits, context, self.config)
            return sample(dist, self.rng), dist
        return self.choose(logits, context, position), None

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
        proposed = np.array(proposals, dtype=np.int64)
        if self.mode == "rejection":
            target_probs = np.stack([sampling_distribution(rows[i], contexts[i], self.config)
                                     for i in range(len(proposals) + 1)])
            draft_probs = np.stack(draft_dists) if proposals else np.zeros((0, rows.shape[1]))
            return speculative_accept(proposed, draft_probs, target_probs, self.rng)
        # greedy / coupled: the target's own token at each position, only as far as needed
        choices = []
        for i in range(len(proposals) + 1):
            choices.append(self.choose(rows[i], contexts[i], first_position + i))
            if i < len(proposals) and choices[i] != proposals[i]:
                return i, choices[i]
        return greedy_accept(proposed, np.array(choices, dtype=np.int64))

    # ------------------------------------------------------------ trees
    def node_distribution(self, logits: np.ndarray, context: np.ndarray) -> np.ndarray:
        """[V] the distribution a node's children are drawn from (greedy: the penalized softmax, to rank them)."""
        if self.mode == "greedy":
            ranking = SamplingConfig(temperature=1.0, repetition_penalty=self.config.repetition_penalty)
            return sampling_distribution(logits, context, ranking)
        return sampling_distribution(logits, context, self.config)

    def children(self, dist: np.ndarray, count: int, position: int) -> list:
        """``count`` distinct child tokens from ``dist`` [V] for the children landing at ``position``."""
        if self.mode == "coupled":
            return coupled_top_k(dist, self.noise.at(position), count)
        return pick_children(dist, count, self.mode == "greedy", self.rng)

    def verify_tree(self, tree: DraftTree, row, context_at, position_at) -> tuple[list, int]:
        """(accepted node path, recovered or bonus token). row(e) [V] logits, context_at(e) [N], position_at(e):
        for expansion e (0 = the root, i + 1 = node i)."""
        if self.mode == "rejection":
            return tree_speculative_accept(
                tree, lambda e: sampling_distribution(row(e), context_at(e), self.config), self.rng)
        return greedy_tree_accept(tree, lambda e: self.choose(row(e), context_at(e), position_at(e)))
