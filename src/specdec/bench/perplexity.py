"""Perplexity of a bundle's models over a text, computed as llama.cpp's ``llama-perplexity -c CONTEXT`` does.

The procedure of llama.cpp's ``tools/perplexity/perplexity.cpp`` (``perplexity()``, no ``--ppl-stride``),
step for step, so that a bundle and the GGUF it was exported from are compared on the same numbers:

- the whole text is tokenized once with special tokens added (``common_tokenize(ctx, text, true)``: a
  BOS first only when the tokenizer adds one). One difference: llama.cpp does not parse special-token
  text in the file (``<|endoftext|>``) as a special token, the bundle's tokenizer does; a text without
  such markers (``tools/inputs/make_eval_text.py``'s) is not affected;
- fewer than ``2 * CONTEXT`` tokens is an error; the text is cut into ``len // CONTEXT`` chunks of
  ``CONTEXT`` consecutive tokens (the tail is dropped), the first ``chunks`` of them used;
- each chunk is evaluated from an empty cache at positions 0..CONTEXT-1; when the tokenizer adds a BOS,
  the chunk's first token is replaced by BOS for the pass (and only for the pass);
- only the second half is scored: the logits at positions ``first = CONTEXT // 2`` .. ``CONTEXT - 2``
  predict the tokens at ``first + 1`` .. ``CONTEXT - 1`` (``CONTEXT - first - 1`` tokens per chunk);
- per scored token: ``-(logit[tok] - max - log(sum(expf(logit - max))))`` with float32 logits and a
  float64 sum, over the full width of the logits; perplexity = ``exp(mean)``, and llama.cpp's
  uncertainty ``ppl * sqrt((mean(nll^2) - mean(nll)^2) / (count - 1))``.

The runtime runs a chunk in passes of ``segment`` tokens (the cache continues between passes), where
llama.cpp runs it in one batch: the arithmetic per row is the same model, rounded in onnxruntime's way.
A draft with a pruned vocabulary scores -inf outside its kept ids: its perplexity is infinite whenever a
scored token is outside them (reported as such; evaluate the unpruned bundle instead).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from specdec.contract.bundle import default_hash_cache, inside, open_bundle
from specdec.contract.manifest import ROLES

log = logging.getLogger(__name__)

DEFAULT_CONTEXT = 512  # llama-perplexity -c 512
DEFAULT_SEGMENT = 128  # tokens per pass (bounds the logits buffer at segment x vocab floats)


@dataclass(frozen=True)
class PerplexityResult:
    role: str
    perplexity: float
    uncertainty: float  # llama.cpp's "+/-": ppl * standard error of the mean negative log-likelihood
    chunks: int
    context: int
    scored_tokens: int
    text_tokens: int
    add_bos: bool
    running: tuple = field(default=())  # perplexity after each chunk (llama.cpp's "[i]value" line)
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return {"role": self.role, "perplexity": self.perplexity, "uncertainty": self.uncertainty,
                "chunks": self.chunks, "context": self.context, "scored_tokens": self.scored_tokens,
                "text_tokens": self.text_tokens, "add_bos": self.add_bos, "running": list(self.running),
                "seconds": round(self.seconds, 2)}


def check_eval_args(context: int, chunks: int | None, segment: int = DEFAULT_SEGMENT) -> None:
    """The options of an evaluation, each a one-line ValueError (checked before any model loads)."""
    for name, value in (("context", context), ("segment", segment)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name} must be an integer, got {value!r}")
    if context < 4:
        raise ValueError(f"context must be at least 4 tokens, got {context}")
    if segment < 1:
        raise ValueError(f"segment must be at least 1 token, got {segment}")
    if chunks is not None and (isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1):
        raise ValueError(f"chunks must be a positive integer (or None for all), got {chunks!r}")


def chunk_count(text_tokens: int, context: int, chunks: int | None) -> int:
    """How many chunks llama-perplexity evaluates: every whole chunk, at most ``chunks``; an error under 2."""
    if text_tokens < 2 * context:
        raise ValueError(f"the text tokenizes to only {text_tokens} tokens: perplexity with a context of {context} "
                         f"needs at least {2 * context} (llama-perplexity's rule)")
    available = text_tokens // context
    return available if chunks is None else min(chunks, available)


def negative_log_likelihoods(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """[R] float64 ``-log softmax(logits[r])[targets[r]]`` as llama.cpp computes it (float32 logits and
    differences, expf, a float64 sum). ``logits``: [R, V] float32."""
    logits = np.asarray(logits, dtype=np.float32)
    rows = np.arange(len(targets))
    peak = logits.max(axis=1, keepdims=True)
    shifted = logits - peak  # float32, as `logits[i] - max_logit` in C
    sums = np.exp(shifted).sum(axis=1, dtype=np.float64)
    return -(shifted[rows, targets].astype(np.float64) - np.log(sums))


def tokenize_like_llama(tokenizer, text: str, bos_token_id: int | None) -> tuple[list[int], bool]:
    """(token ids with special tokens added, whether the tokenizer adds a BOS) of ``text``.

    ``tokenizer``: a ``tokenizers.Tokenizer``. llama.cpp adds BOS when the GGUF says ``add_bos_token``; a
    Hugging Face tokenizer says the same by its post-processor: the ids start with BOS only with special
    tokens added."""
    with_special = tokenizer.encode(text, add_special_tokens=True).ids
    plain = tokenizer.encode(text, add_special_tokens=False).ids
    add_bos = (bos_token_id is not None and len(with_special) > len(plain) and with_special[:1] == [bos_token_id])
    return list(with_special), add_bos


def perplexity_of(runner, tokens, role: str = "model", add_bos: bool = False, bos_token_id: int | None = None,
                  context: int = DEFAULT_CONTEXT, chunks: int | None = None,
                  segment: int = DEFAULT_SEGMENT) -> PerplexityResult:
    """llama-perplexity's number for one model. ``runner``: a ``specdec.runners`` Runner with
    ``max_context >= context`` and ``max_step_tokens >= min(segment, context)``; ``tokens``: the whole text's
    ids (``tokenize_like_llama``)."""
    check_eval_args(context, chunks, segment)
    if add_bos and bos_token_id is None:
        raise ValueError("add_bos needs a bos_token_id")
    tokens = np.asarray(tokens, dtype=np.int64)
    count = chunk_count(len(tokens), context, chunks)
    segment = min(segment, context, runner.max_step_tokens)
    if runner.max_context < context:
        raise ValueError(f"the runner's cache holds {runner.max_context} tokens, less than the context {context}")
    first = context // 2
    started = time.perf_counter()
    nll = nll2 = 0.0
    scored = 0
    running = []
    for chunk in range(count):
        ids = tokens[chunk * context:(chunk + 1) * context].copy()
        targets = ids.copy()  # scored against the original tokens: only the pass sees the BOS
        if add_bos:
            ids[0] = bos_token_id
        runner.reset()
        for start in range(0, context, segment):
            end = min(start + segment, context)
            logits = runner.forward(ids[start:end], np.arange(start, end))
            runner.commit(end - start)
            lo, hi = max(start, first), min(end, context - 1)  # rows whose logits predict a scored token
            if lo < hi:
                values = negative_log_likelihoods(logits[lo - start:hi - start], targets[lo + 1:hi + 1])
                nll += float(values.sum())
                nll2 += float((values * values).sum())
                scored += hi - lo
        running.append(math.exp(nll / scored))
        log.info("%s: chunk %d/%d, running perplexity %.4f", role, chunk + 1, count, running[-1])
    runner.reset()
    mean, mean2 = nll / scored, nll2 / scored
    ppl = math.exp(mean)
    variance = mean2 - mean * mean
    uncertainty = math.sqrt(variance / (scored - 1)) * ppl if variance > 0 and scored > 1 else float("nan")
    return PerplexityResult(role, ppl, uncertainty, count, context, scored, len(tokens), add_bos, tuple(running),
                            time.perf_counter() - started)


def evaluate_bundle(bundle_dir: str | Path, text: str, roles=ROLES, context: int = DEFAULT_CONTEXT,
                    chunks: int | None = None, threads: int | None = None, verify: bool = True,
                    segment: int = DEFAULT_SEGMENT) -> dict:
    """{role: PerplexityResult} for each of ``roles`` the bundle has, over ``text``, on onnxruntime's CPU; a model in
    several weight forms gives one result per form (``target``, ``target-int8``). Every problem (bundle, options, a
    text too short) is a one-line ValueError before a model loads."""
    from tokenizers import Tokenizer

    from specdec.runners.factory import make_runner
    from specdec.runners.vocab_map import load_kept_ids

    check_eval_args(context, chunks, segment)
    unknown = [role for role in roles if role not in ROLES]
    if unknown or not roles:
        raise ValueError(f"roles must be some of {', '.join(ROLES)}, got {list(roles)}")
    root = Path(bundle_dir)
    manifest = open_bundle(root, verify=verify, hash_cache=default_hash_cache())
    models = {role: spec for role, spec in manifest.models().items() if role in roles}
    if not models:
        raise ValueError(f"the bundle has no {' or '.join(roles)} model")
    tokenizer = Tokenizer.from_file(str(inside(root, manifest.tokenizer_file)))
    results = {}
    for role, spec in models.items():
        if context > spec.max_positions:
            raise ValueError(f"context {context} exceeds the {role}'s {spec.max_positions} positions")
        tokens, add_bos = tokenize_like_llama(tokenizer, text, spec.bos_token_id)
        chunk_count(len(tokens), context, chunks)  # a short text fails before the model loads
        kept = load_kept_ids(root, spec)
        if kept is not None:
            log.warning("the %s scores a pruned vocabulary (%d of %d ids): its perplexity is infinite where a "
                        "scored token is outside it", role, len(kept), spec.vocab_size)
        step = min(segment, context)
        # every weight form the bundle carries (the first under the role's name, the others as "target-int8")
        forms = spec.weight_forms or ((None, spec.onnx_file),)
        for index, (form, path) in enumerate(forms):
            name = role if index == 0 else f"{role}-{form}"
            runner = make_runner(str(inside(root, path)), spec, "cpu", context, step, threads, kept_ids=kept)
            try:
                results[name] = perplexity_of(runner, tokens, name, add_bos, spec.bos_token_id, context, chunks, step)
            finally:
                del runner
    return results
