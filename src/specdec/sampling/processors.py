"""Sampling options and logits processors, with Hugging Face transformers' semantics and order.

Order: the logit bias (OpenAI's and llama-server's ``logit_bias``: added to the model's logits, -inf bans a
token), then as ``GenerationMixin`` builds it: repetition penalty, temperature, top-k, top-p, min-p. Greedy
decoding (temperature 0) applies only the bias and the repetition penalty and takes the argmax, as
transformers' greedy search does. Pure numpy functions over one row
of logits; the caller decides which context each row sees.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

NEG_INF = np.float32(-np.inf)
# Above this |score| / temperature, float32 division would overflow: tiny temperatures take the
# shifted float64 path (the same distribution, without inf - inf = NaN).
_FLOAT32_SAFE = 1e30


class DistributionError(ValueError):
    """No sampling distribution can be formed (NaN/inf logits, or every token's score is -inf)."""


class SamplingError(ValueError):
    """A SamplingConfig field out of range: ``option`` names it, ``problem`` says what is wrong (without the name)."""

    def __init__(self, option: str, problem: str):
        super().__init__(f"{option} {problem}")
        self.option, self.problem = option, problem
# top-p looks at the largest candidates first and sorts the whole vocabulary only when
# they do not already hold top_p of the mass.
_TOP_P_CANDIDATES = 2048


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off
    repetition_penalty: float = 1.0  # 1 = off
    # ((token id, added to its logit), ...) in id order; a dict {id: bias} is taken too. -inf bans the token
    logit_bias: tuple = ()

    def __post_init__(self):
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        for name in ("temperature", "top_p", "min_p", "repetition_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
                raise SamplingError(name, f"must be a number, got {value!r}")
        if not (self.temperature >= 0.0 and np.isfinite(self.temperature)):
            raise SamplingError("temperature", f"must be a finite number >= 0 (0 = greedy), got {self.temperature}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, (int, np.integer)) or self.top_k < 0:
            raise SamplingError("top_k", f"must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise SamplingError("top_p", f"must be in (0, 1], got {self.top_p}")
        if not (0.0 <= self.min_p < 1.0):
            raise SamplingError("min_p", f"must be in [0, 1), got {self.min_p}")
        if not (self.repetition_penalty > 0.0 and np.isfinite(self.repetition_penalty)):
            raise SamplingError("repetition_penalty", f"must be a finite number > 0 (1 = off), got "
                                                      f"{self.repetition_penalty}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


MAX_LOGIT_BIAS = 100.0  # OpenAI's range: -100..100 (and -inf: never)


def _bias_pairs(bias) -> tuple:
    items = bias.items() if isinstance(bias, dict) else bias
    try:
        pairs = [(token, value) for token, value in items]
    except (TypeError, ValueError):
        raise SamplingError("logit_bias", f"must be {{token id: bias}} or (token id, bias) pairs, got {bias!r}") from None
    merged = {}
    for token, value in pairs:
        if isinstance(token, bool) or not isinstance(token, (int, np.integer)) or token < 0:
            raise SamplingError("logit_bias", f"token ids must be integers >= 0, got {token!r}")
        if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) or not (
                -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS or value == -np.inf):
            raise SamplingError("logit_bias", f"values must be numbers in -100..100 (or -inf: never), got {value!r}")
        merged[int(token)] = float(value)
    return tuple(sorted(merged.items()))


def biased(
    logits: np.ndarray,  # [V] raw logits of one position
    bias: tuple,  # ((token id, bias), ...): SamplingConfig.logit_bias
) -> np.ndarray:
    """The logits with ``bias`` added ([V], a copy; the same array when there is none)."""
    if not bias:
        return logits
    ids = np.fromiter((token for token, _ in bias), dtype=np.int64, count=len(bias))
    scores = np.array(logits, copy=True)
    scores[ids] += np.fromiter((value for _, value in bias), dtype=scores.dtype, count=len(bias))
    return scores


def apply_repetition_penalty(
    logits: np.ndarray,  # [V] float32, modified in place
    seen_tokens: np.ndarray,  # [N] int64, unique ids already in the sequence
    penalty: float,
) -> None:
    if penalty == 1.0 or len(seen_tokens) == 0:
        return
    scores = logits[seen_tokens]
    with np.errstate(over="ignore"):  # float32 overflow is caught by the caller (penalized_scores)
        logits[seen_tokens] = np.where(scores < 0, scores * penalty, scores / penalty)


def _softmax(logits: np.ndarray) -> np.ndarray:  # [V] -> [V] float64
    shifted = logits.astype(np.float64) - np.max(logits)
    probs = np.exp(shifted)
    return probs / probs.sum()


def _check_scores(scores: np.ndarray) -> None:  # [V]
    top = scores.max()
    if np.isnan(top) or np.isnan(scores).any():
        raise DistributionError("the model produced NaN logits: no distribution can be formed")
    if not np.isfinite(top):
        which = "+inf" if top > 0 else "-inf for every token"
        raise DistributionError(f"the scores are {which} after the processors: no distribution can be formed")


def penalized_scores(
    logits: np.ndarray,  # [V] raw logits of one position
    seen_tokens: np.ndarray,  # [N] int64 unique ids this position sees
    penalty: float,
) -> np.ndarray:
    """Repetition-penalized scores [V] in float32 as transformers computes them; float64 where an extreme
    penalty would overflow float32 (so no token's score becomes -inf by overflow)."""
    scores = np.array(logits, dtype=np.float32, copy=True)
    apply_repetition_penalty(scores, seen_tokens, penalty)
    if penalty != 1.0 and not np.isfinite(scores[seen_tokens]).all():
        scores = np.array(logits, dtype=np.float64, copy=True)
        apply_repetition_penalty(scores, seen_tokens, penalty)
    _check_scores(scores)
    return scores


def warp(logits: np.ndarray, config: SamplingConfig) -> np.ndarray:
    """Temperature, top-k, top-p, min-p on penalized logits [V]; returns the sampling distribution [V] float64."""
    _check_scores(logits)
    peak = float(np.abs(logits[np.isfinite(logits)]).max())
    if peak / config.temperature < _FLOAT32_SAFE:  # transformers' float32 arithmetic
        scores = logits.astype(np.float32) / np.float32(config.temperature)
    else:  # a tiny temperature: shift first (the top score becomes 0, the rest -> -inf), in float64
        with np.errstate(over="ignore"):  # -> -inf for every token below the top: intended
            scores = (logits.astype(np.float64) - logits.max()) / config.temperature
    vocab = scores.shape[0]
    if 0 < config.top_k < vocab:
        # transformers keeps every token whose score ties the k-th largest
        kth = np.partition(scores, vocab - config.top_k)[vocab - config.top_k]
        scores = np.where(scores < kth, NEG_INF, scores)
    if config.top_p < 1.0:
        scores = _top_p(scores, config.top_p)
    if config.min_p > 0.0:
        probs = _softmax(scores)
        scores = np.where(probs < config.min_p * probs.max(), NEG_INF, scores)
    return _softmax(scores)


def _top_p(scores: np.ndarray, top_p: float) -> np.ndarray:
    """transformers' TopPLogitsWarper: drop the smallest tokens whose cumulative mass is <= 1 - top_p."""
    probs = _softmax(scores)
    vocab = len(scores)
    order = None
    if vocab > _TOP_P_CANDIDATES:
        candidates = np.argpartition(probs, vocab - _TOP_P_CANDIDATES)[vocab - _TOP_P_CANDIDATES :]
        if probs[candidates].sum() > top_p + 1e-6:
            # The kept set lies within the candidates: tokens outside hold < 1 - top_p in total.
            order = candidates[np.argsort(probs[candidates], kind="stable")]
            rest = probs.sum() - probs[order].sum()
            cumulative = rest + np.cumsum(probs[order])
            drop_mask = np.ones(vocab, dtype=bool)
            keep = order[cumulative > 1.0 - top_p]
            keep = order[-1:] if len(keep) == 0 else keep
            drop_mask[keep] = False
            return np.where(drop_mask, NEG_INF, scores)
    order = np.argsort(probs, kind="stable")  # ascending, as transformers sorts
    cumulative = np.cumsum(probs[order])
    remove_sorted = cumulative <= 1.0 - top_p
    remove_sorted[-1] = False  # min_tokens_to_keep = 1
    remove = np.empty(vocab, dtype=bool)
    remove[order] = remove_sorted
    return np.where(remove, NEG_INF, scores)


def sampling_distribution(
    logits: np.ndarray,  # [V] raw logits of one position
    seen_tokens: np.ndarray,  # [N] int64 unique ids in the context this position sees
    config: SamplingConfig,
) -> np.ndarray:
    """The exact distribution a token at this position is drawn from ([V] float64), all processors applied."""
    return warp(penalized_scores(biased(logits, config.logit_bias), seen_tokens, config.repetition_penalty), config)


def greedy_token(logits: np.ndarray, seen_tokens: np.ndarray, config: SamplingConfig) -> int:
    """transformers' greedy choice: argmax of the biased, repetition-penalized logits."""
    logits = biased(logits, config.logit_bias)
    if config.repetition_penalty == 1.0:
        index = int(np.argmax(logits))
        if not np.isfinite(logits[index]) or np.isnan(logits).any():
            _check_scores(logits)
        return index
    return int(np.argmax(penalized_scores(logits, seen_tokens, config.repetition_penalty)))


def sample(probs: np.ndarray, rng: np.random.Generator) -> int:
    """Draw one token id from ``probs`` [V] (non-negative, any positive total) by inverse CDF."""
    cumulative = np.cumsum(probs)
    total = cumulative[-1]
    if not (total > 0.0 and np.isfinite(total)):
        raise DistributionError(f"cannot sample from a distribution of total mass {total}")
    index = int(np.searchsorted(cumulative, rng.random() * total, side="right"))
    index = min(index, len(probs) - 1)
    while probs[index] <= 0.0:  # never return a zero-probability token (float edge at the top of the CDF)
        index -= 1
    return index
