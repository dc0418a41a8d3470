"""What every dialect's answer reports beside its text: the ``specdec`` block (acceptance, rounds, timings),
llama-server's ``timings`` (its native routes; its OpenAI chat route's last chunks) and
token logprobs in OpenAI's item shape (token text, logprob, UTF-8 bytes, alternatives), which OpenAI's chat and
Responses answers and llama-server's ``completion_probabilities`` all build on. Boundary: JSON values from a
finished job; no routes.
"""

from __future__ import annotations

from specdec.serving.jobs import Done


def specdec_fields(done: Done) -> dict:
    """What the answer says about speculation (beside the dialect's own fields)."""
    stats = done.stats
    return {"cached_tokens": stats.cached_tokens, "acceptance_rate": round(stats.acceptance_rate, 4),
            "proposed_tokens": stats.proposed, "accepted_tokens": stats.accepted, "rounds": stats.rounds,
            "target_passes": stats.decode_forwards,  # the decode loop's (completion tokens / this: tokens a pass)
            "rounds_by_source": dict(stats.rounds_by_source), "tokens_per_second": round(stats.tokens_per_s, 2),
            "prefill_seconds": round(stats.prefill_seconds, 4), "decode_seconds": round(stats.decode_seconds, 4),
            "queue_seconds": round(done.queue_seconds, 4)}


def timings(done: Done) -> dict:
    """llama-server's ``timings``: prompt tokens computed and reused, decode speed, draft tokens proposed/accepted."""
    return timings_of(done.stats)


def timings_of(stats) -> dict:
    """``timings`` from a request's ``GenerationStats``: the whole answer's once it is done, the answer so far while
    it runs (the decoder fills them round by round: llama-server's ``timings_per_token``)."""
    computed = stats.prompt_tokens - stats.cached_tokens
    prompt_ms, predicted_ms = stats.prefill_seconds * 1000.0, stats.decode_seconds * 1000.0
    return {"cache_n": stats.cached_tokens, "prompt_n": computed, "prompt_ms": round(prompt_ms, 3),
            "prompt_per_token_ms": round(prompt_ms / computed, 3) if computed else 0.0,
            "prompt_per_second": round(computed / stats.prefill_seconds, 2) if stats.prefill_seconds else 0.0,
            "predicted_n": stats.new_tokens, "predicted_ms": round(predicted_ms, 3),
            "predicted_per_token_ms": round(predicted_ms / stats.new_tokens, 3) if stats.new_tokens else 0.0,
            "predicted_per_second": round(stats.tokens_per_s, 2),
            "draft_n": stats.proposed, "draft_n_accepted": stats.accepted}


def prompt_progress(report) -> dict:
    """llama-server's ``prompt_progress`` from a ``PrefillProgress``: prompt tokens in all, reused, read so far, and
    whole milliseconds since the prefill began."""
    return {"total": report.total, "cache": report.cached, "processed": report.processed,
            "time_ms": int(report.seconds * 1000)}


def logprob_item(codec, token_id: int, logprob: float) -> dict:
    data = codec.piece_bytes(token_id) if hasattr(codec, "piece_bytes") else codec.decode([token_id]).encode()
    return {"token": data.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(data)}


def logprob_entry(codec, entry, top: bool = True) -> dict:
    """One token's logprobs item (token text, logprob, UTF-8 bytes, alternatives)."""
    out = logprob_item(codec, entry.token, entry.logprob)
    if top:
        out["top_logprobs"] = [logprob_item(codec, t, lp) for t, lp in entry.top]
    return out
