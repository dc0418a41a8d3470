"""Seeded sampling that does not depend on the schedule: Gumbel-max coupling by absolute position.

The token at absolute position i is ``argmax_j probs_i[j] / E_i[j]`` where ``E_i`` is a vector
of Exp(1) noise that depends only on (seed, i): the exponential race, equivalent to
Gumbel-max (argmax log p + G), an exact sample of ``probs_i``. Because the noise of a position
never depends on what was proposed before it, the target's token at each position is fixed by
the seed alone, and speculation cannot change it:

- the draft proposes ``argmax q_i / E_i`` with the same noise (tree children: the k largest
  keys, i.e. Gumbel-top-k, all children of one depth sharing position i's noise);
- verification accepts a proposal while it equals the target's own coupled token
  (chains: up to the first mismatch; trees: the child that matches; lookup: the same);
- at the first mismatch, or after the last proposal, the target's coupled token is emitted.

So with a seed, every mode (target-only, any g, auto, lookup, hybrid, trees) emits exactly the
tokens target-only sampling emits with that seed (Daliri et al. 2024, "Coupling without
communication and drafter-invariant speculative decoding"). The output is still an exact
sample of the target: positions' noises are independent. Acceptance is at least (1 - TV) /
(1 + TV) per token, a little below modified rejection sampling's 1 - TV, which stays available
as ``acceptance="rejection"``.
"""

from __future__ import annotations

import numpy as np

NOISE_WINDOW = 96  # positions kept: a round touches at most the pending token + the tree/chain depth


class PositionNoise:
    """Exp(1) noise [V] per absolute position, a pure function of (seed, position); cached for a few positions."""

    def __init__(self, seed: int, vocab: int):
        self.seed = seed
        self.vocab = vocab
        self._cache: dict = {}

    def at(self, position: int) -> np.ndarray:  # -> [V] float64, every entry > 0
        noise = self._cache.get(position)
        if noise is None:
            rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, position])))
            noise = rng.standard_exponential(self.vocab)
            if len(self._cache) >= NOISE_WINDOW:
                for old in sorted(self._cache)[: NOISE_WINDOW // 2]:
                    del self._cache[old]
            self._cache[position] = noise
        return noise


def coupled_token(
    probs: np.ndarray,  # [V] a distribution (any positive total), zero outside its support
    noise: np.ndarray,  # [V] Exp(1) noise of this position
) -> int:
    """argmax probs / noise: an exact sample of ``probs`` whose randomness is the position's noise."""
    return int(np.argmax(probs / noise))


def coupled_top_k(
    probs: np.ndarray,  # [V]
    noise: np.ndarray,  # [V]
    count: int,
) -> list:
    """The ``count`` tokens with the largest keys probs / noise, best first (Gumbel-top-k: a draw of
    ``count`` distinct tokens without replacement; the first is ``coupled_token``). Zero-probability
    tokens are never returned."""
    count = min(count, int(np.count_nonzero(probs > 0)))
    if count <= 0:
        return []
    keys = probs / noise
    top = np.argpartition(-keys, count - 1)[:count]
    return [int(t) for t in top[np.argsort(-keys[top], kind="stable")]]
