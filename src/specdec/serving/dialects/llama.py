"""llama-server's native dialect: ``/infill`` (fill-in-the-middle, as editor plugins such as llama.vscode send it).

Its request fields (``input_prefix``, ``n_predict``, ``t_max_predict_ms``, ``n_probs`` ...), its answer
(``content``, ``stop``, ``stop_type``, ``tokens_cached``, ``timings``, ``completion_probabilities``), its stream
(``data: {"content": ...}`` lines, the last with ``"stop": true``; no ``[DONE]``). Fields llama.cpp knows and
specdec does not use are accepted and listed in the answer's ``specdec.ignored_fields``.
"""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import StreamingResponse

from specdec.decoding.infill import fim_stop_ids, fim_tokens
from specdec.decoding.options import GenerationError, GenerationOptions
from specdec.serving.dialects.llama_models import InfillRequest
from specdec.serving.answers import logprob_entry, specdec_fields
from specdec.serving.jobs import Done, Engine, Piece
from specdec.serving.turns import output_constraint
from specdec.serving.wire import APIError, option_error, sampling_config, sse

INFILL_RESERVE = 256  # tokens an /infill with n_predict=-1 keeps free for the middle (at most a quarter of the context)

# decoder option -> llama-server's field
NAMES = {"max_new_tokens": "n_predict", "repetition_penalty": "repeat_penalty", "prefix": "input_prefix",
         "suffix": "input_suffix", "extra": "input_extra", "logprobs": "n_probs"}


def llama_answer(text: str, done: Done, stop_ids: set, model: str, ignored: list) -> dict:
    """llama-server's completion answer (its /infill and /completion shape) for a finished request."""
    stats = done.stats
    cached = stats.cached_tokens
    computed = stats.prompt_tokens - cached
    prompt_ms, predicted_ms = stats.prefill_seconds * 1000.0, stats.decode_seconds * 1000.0
    if done.finish == "eos" or (done.finish == "stop" and done.last_token in stop_ids):
        stop_type = "eos"
    else:
        stop_type = "word" if done.finish == "stop" else "limit"
    timings = {"cache_n": cached, "prompt_n": computed, "prompt_ms": round(prompt_ms, 3),
               "prompt_per_token_ms": round(prompt_ms / computed, 3) if computed else 0.0,
               "prompt_per_second": round(computed / stats.prefill_seconds, 2) if stats.prefill_seconds else 0.0,
               "predicted_n": stats.new_tokens, "predicted_ms": round(predicted_ms, 3),
               "predicted_per_token_ms": round(predicted_ms / stats.new_tokens, 3) if stats.new_tokens else 0.0,
               "predicted_per_second": round(stats.tokens_per_s, 2),
               "draft_n": stats.proposed, "draft_n_accepted": stats.accepted}
    return {"index": 0, "content": text, "stop": True, "model": model, "tokens_predicted": stats.new_tokens,
            "tokens_evaluated": stats.prompt_tokens, "tokens_cached": cached, "stop_type": stop_type,
            "timings": timings, "specdec": {**specdec_fields(done), "ignored_fields": ignored}}


def llama_probs(codec, entries) -> list:
    """llama-server's ``completion_probabilities`` (its n_probs answer): id, token, logprob, bytes, top_logprobs."""
    out = []
    for entry in entries:
        item = logprob_entry(codec, entry)
        out.append({"id": entry.token, "token": item["token"], "logprob": item["logprob"], "bytes": item["bytes"],
                    "top_logprobs": [{"id": t, **alt} for (t, _), alt in zip(entry.top, item["top_logprobs"])]})
    return out


def error_lines(message: str, code: str | None) -> list:
    return [sse({"error": {"code": 500, "message": message, "type": "server_error"}})]


def options_of(body, max_new: int, names: dict, **more) -> GenerationOptions:
    """A llama.cpp body's generation fields as a ``GenerationOptions``."""
    constraint = None
    for field in ("grammar", "json_schema"):
        if getattr(body, field, None) is not None:
            if constraint is not None:
                raise APIError(400, "json_schema: give one of grammar, json_schema", param="json_schema")
            names["constraint"] = field
            try:
                constraint = output_constraint("grammar" if field == "grammar" else "json_schema", body.json_schema,
                                               body.grammar, field)
            except GenerationError as exc:
                raise option_error(exc, names) from None
    try:
        sampling = sampling_config(names, temperature=body.temperature, top_k=body.top_k, top_p=body.top_p,
                                   min_p=body.min_p, repetition_penalty=body.repeat_penalty)
        return GenerationOptions(max_new_tokens=max_new, sampling=sampling,
                                 num_draft_tokens=body.num_draft_tokens, seed=None if body.seed == -1 else body.seed,
                                 stop=[body.stop] if isinstance(body.stop, str) else list(body.stop),
                                 proposer=body.proposer, constraint=constraint,
                                 logprobs=body.n_probs or None, **more)
    except GenerationError as exc:
        raise option_error(exc, names) from None


class Infill:
    """``POST /infill``."""

    def __init__(self, engine: Engine, server):
        self.engine, self.server = engine, server

    async def create(self, body: InfillRequest, request: Request):
        model = self.server.answer_model(body.model) if body.model is not None else self.server.model_name
        engine = self.engine
        ignored = body.ignored_fields + ([] if body.cache_prompt else ["cache_prompt"])  # reuse is exact: always on
        names = dict(NAMES)
        extra = [chunk.model_dump() for chunk in body.input_extra]
        given = body.n_predict >= 0
        decoder = engine.decoder
        try:
            if given:
                max_new = body.n_predict
                ids = decoder.infill_prompt(body.input_prefix, body.input_suffix, extra=extra, prompt=body.prompt,
                                            max_new_tokens=max_new)
            else:  # until EOS or the context is full, keeping room for the middle
                reserve = min(INFILL_RESERVE, decoder.max_context // 4)
                ids = decoder.infill_prompt(body.input_prefix, body.input_suffix, extra=extra, prompt=body.prompt,
                                            max_new_tokens=reserve)
                max_new = engine.open_budget(ids)
        except GenerationError as exc:  # no FIM tokens, text that is not text, no room
            raise option_error(exc, names, given, "input_prefix") from None
        stop_ids = fim_stop_ids(fim_tokens(decoder.manifest, engine.codec))
        options = options_of(body, max_new, names, stop_token_ids=stop_ids)
        prepared = engine.prepare(ids, options, names, given, prompt_field="input_prefix")
        prepared.time_limit = body.t_max_predict_ms / 1000.0
        job, first = await engine.start(prepared, request, names)
        codec = engine.codec

        def answer(text: str, done: Done) -> dict:
            out = llama_answer(text, done, set(stop_ids), model, ignored)
            if done.logprobs is not None:
                out["completion_probabilities"] = llama_probs(codec, done.logprobs)
            return out

        def piece_lines(piece: Piece) -> list:
            line = {"index": 0, "content": piece.text, "stop": False}
            if piece.logprobs is not None:
                line["completion_probabilities"] = llama_probs(codec, piece.logprobs)
            return [sse(line)]

        if body.stream:
            return StreamingResponse(engine.events(job, first, piece_lines, lambda done: [sse(answer("", done))],
                                                   error_lines), media_type="text/event-stream")
        text, done, _ = await engine.collect(job, first, request)
        return answer(text, done)


class Props:
    """``GET /props``: llama-server's server properties (``default_generation_settings.n_ctx``, ``total_slots``,
    ``model_alias``, ``chat_template`` ...) and specdec's own (``specdec``: the KV caches, the RAM prompt cache, the
    proposers, whether the bundle has a draft)."""

    def __init__(self, engine: Engine, server):
        self.engine, self.server = engine, server

    async def get(self):
        from specdec.decoding.chat import ChatTemplateError, chat_template_of
        from specdec.decoding.proposers import proposer_names

        decoder, pool = self.engine.decoder, self.engine.pool
        try:
            template = chat_template_of(decoder).source
        except ChatTemplateError:
            template = ""
        manifest = decoder.manifest
        cache = decoder.prompt_cache
        return {
            "default_generation_settings": {"n_ctx": decoder.max_context, "params": {}},
            "total_slots": pool.options.workers, "model_alias": self.server.model_name,
            "model_path": str(decoder.bundle_dir.name), "chat_template": template,
            "modalities": {"vision": False, "audio": False},
            "specdec": {
                "max_context": decoder.max_context, "workers": pool.options.workers,
                "has_draft": decoder.draft is not None, "proposers": list(proposer_names()),
                "kv_dtype": {role: spec.kv_dtype for role, spec in manifest.models().items()},
                "quant": {role: spec.quant for role, spec in manifest.models().items()},
                "prompt_cache_mib": round(cache.capacity / 2**20, 1) if cache is not None else 0,
                "suffix_cache_mib": round(decoder.suffix_cache.max_tokens * 4 / 2**20, 1)
                if decoder.suffix_cache is not None else 0,
            },
        }


def mount(app, engine: Engine, server) -> None:
    app.add_api_route("/infill", Infill(engine, server).create, methods=["POST"])
    app.add_api_route("/props", Props(engine, server).get, methods=["GET"])
