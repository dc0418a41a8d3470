"""llama-server's native dialect: ``/completion`` (also ``/completions``, as llama-server maps both to its native
handler), ``/infill`` (fill-in-the-middle, as editor plugins such as llama.vim and llama.vscode send it), and the
routes of ``llama_info.py`` (``/props``, ``/tokenize``, ``/detokenize``) and ``llama_slots.py`` (``/slots``).

Request fields are llama-server's (``n_predict``, ``n_probs``, ``id_slot``, ``t_max_predict_ms``, ``response_fields``
...; llama_models.py), its answer (``content``, ``tokens``, ``stop``, ``stop_type``, ``stopping_word``,
``tokens_cached``, ``timings`` with ``cache_n`` and ``draft_n``, ``completion_probabilities``), its stream (``data:
{"content": ...}`` lines, the last with ``"stop": true``; no ``[DONE]``). Fields llama.cpp knows and specdec does
not use are accepted and listed in the answer's ``specdec.ignored_fields``.

Errors on these routes have one shape that clients of both servers read: llama-server's ``{"error": {"code":
<HTTP status>, "message", "type"}}`` (its type names: ``invalid_request_error``, ``not_supported_error``,
``unavailable_error``, ``exceed_context_size_error`` ...) plus OpenAI's ``param`` (the field at fault).
"""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from specdec.decoding.text.infill import fim_stop_ids, fim_tokens
from specdec.decoding.options import GenerationError, GenerationOptions
from specdec.serving.answers import logprob_entry, prompt_progress, specdec_fields, timings
from specdec.serving.dialects import llama_info, llama_slots
from specdec.serving.dialects.llama_models import CompletionRequest, InfillRequest, LlamaGeneration
from specdec.serving.jobs import Done, Engine, Piece
from specdec.serving.turns import output_constraint
from specdec.serving.wire import APIError, logit_bias_pairs, option_error, sampling_config, sse

RANK = 40  # where this dialect mounts among the others (serving/dialects/__init__.py)

INFILL_RESERVE = 256  # tokens an /infill with n_predict=-1 keeps free for the middle (at most a quarter of the context)

# decoder option -> llama-server's field
NAMES = {"max_new_tokens": "n_predict", "repetition_penalty": "repeat_penalty", "prefix": "input_prefix",
         "suffix": "input_suffix", "extra": "input_extra", "logprobs": "n_probs", "prompt": "prompt"}

LLAMA_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 500: "server_error", 501: "not_supported_error", 503: "unavailable_error"}
# llama-server's own routes, and the un-prefixed chat route its clients call (the /v1 one keeps OpenAI's shape)
PATHS = {"/infill", "/completion", "/completions", "/tokenize", "/detokenize", "/props", "/slots", "/apply-template",
         "/chat/completions", "/chat/completions/input_tokens"}


def owns_errors(path: str) -> bool:
    return path in PATHS or path.startswith("/slots/")


def error_body(status: int, message: str, param=None, code=None, kind: str = "invalid_request_error",
               extra: dict | None = None) -> dict:
    """llama-server's error object (``code``: the HTTP status; its ``type`` names) with OpenAI's ``param``;
    ``extra``: more fields (a context overflow's n_prompt_tokens and n_ctx)."""
    kind = "exceed_context_size_error" if code == "context_length_exceeded" else LLAMA_TYPES.get(status, kind)
    return {"error": {"code": status, "message": message, "type": kind, "param": param, **(extra or {})}}


def error_response(status, message, param=None, code=None, kind="invalid_request_error", headers=None, extra=None):
    return JSONResponse(error_body(status, message, param, code, kind, extra), status_code=status, headers=headers)


def error_lines(message: str, code: str | None) -> list:
    return [sse(error_body(503 if code == "shutting_down" else 500, message, kind="server_error"))]


def stop_type(done: Done, stop_ids: set) -> str:
    if done.finish == "eos" or (done.finish == "stop" and done.last_token in stop_ids):
        return "eos"
    return "word" if done.finish == "stop" else "limit"


def llama_answer(text: str, done: Done, stop_ids: set, model: str, ignored: list) -> dict:
    """llama-server's final completion answer (``/completion`` and ``/infill``) for a finished request."""
    stats = done.stats
    return {"index": 0, "content": text, "stop": True, "model": model, "tokens_predicted": stats.new_tokens,
            "tokens_evaluated": stats.prompt_tokens, "tokens_cached": done.cache_tokens,
            "stop_type": stop_type(done, stop_ids), "stopping_word": done.stop_string or "",
            "has_new_line": "\n" in text, "truncated": False, "timings": timings(done),
            "specdec": {**specdec_fields(done), "ignored_fields": ignored}}


def llama_probs(codec, entries) -> list:
    """llama-server's ``completion_probabilities`` (its n_probs answer): id, token, logprob, bytes, top_logprobs."""
    out = []
    for entry in entries:
        item = logprob_entry(codec, entry)
        out.append({"id": entry.token, "token": item["token"], "logprob": item["logprob"], "bytes": item["bytes"],
                    "top_logprobs": [{"id": t, **alt} for (t, _), alt in zip(entry.top, item["top_logprobs"])]})
    return out


def nested_values(paths: list, answer: dict) -> dict:
    """llama-server's ``response_fields``: only these fields, a path with slashes unnested under its own name
    (``"timings/prompt_n"`` -> ``{"timings/prompt_n": ...}``); a missing one is left out."""
    out = {}
    for path in paths:
        value, found = answer, True
        for key in path.split("/"):
            if isinstance(value, dict) and key in value:
                value = value[key]
            else:
                found = False
                break
        if found:
            out[path] = value
    return out


def options_of(body: LlamaGeneration, max_new: int, names: dict, encode=None, **more) -> GenerationOptions:
    """A llama.cpp body's generation fields as a ``GenerationOptions`` (``encode``: text -> ids, for logit_bias)."""
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
                                   min_p=body.min_p, repetition_penalty=body.repeat_penalty,
                                   logit_bias=logit_bias_pairs(body.logit_bias, encode))
        return GenerationOptions(max_new_tokens=max_new, sampling=sampling,
                                 num_draft_tokens=body.num_draft_tokens, seed=None if body.seed == -1 else body.seed,
                                 stop=[body.stop] if isinstance(body.stop, str) else list(body.stop),
                                 proposer=body.proposer, constraint=constraint,
                                 logprobs=body.top_alternatives()[1] or None, **more)
    except GenerationError as exc:
        raise option_error(exc, names) from None


class Generation:
    """What ``/completion`` and ``/infill`` share: the client's names for the options, the slot, the job, and the
    answer (one JSON object, or a stream of ``data:`` lines) in llama-server's shape."""

    def text_ids(self, text: str) -> list:
        """A logit_bias key's tokens, as llama-server tokenizes it (no BOS)."""
        return self.engine.codec.encode(text, special=False)

    def __init__(self, engine: Engine, server):
        self.engine, self.server = engine, server

    @staticmethod
    def names(body: LlamaGeneration) -> dict:
        return {**NAMES, "max_new_tokens": body.budget()[0], "logprobs": body.top_alternatives()[0]}

    def ignored(self, body: LlamaGeneration) -> list:
        return body.ignored_fields + ([] if body.cache_prompt else ["cache_prompt"])  # reuse is exact: always on

    async def answer(self, body: LlamaGeneration, request: Request, ids: list, options: GenerationOptions,
                     names: dict, budget_given: bool, stop_ids=(), prompt_field: str = "prompt"):
        engine = self.engine
        model = self.server.answer_model(body.model) if body.model is not None else self.server.model_name
        ignored = self.ignored(body)
        prepared = engine.prepare(ids, options, names, budget_given, prompt_field=prompt_field,
                                  worker=self.engine.slot(body.id_slot), progress=body.stream and body.return_progress)
        prepared.time_limit = max(0, body.t_max_predict_ms) / 1000.0
        job, first = await engine.start(prepared, request, names)
        codec, stop_ids = engine.codec, set(stop_ids)
        settings = {"n_predict": body.budget()[1], "seed": body.seed, "temperature": body.temperature,
                    "top_k": body.top_k, "top_p": body.top_p, "min_p": body.min_p,
                    "repeat_penalty": body.repeat_penalty, "stop": list(options.stop),
                    "n_probs": options.logprobs or 0, "stream": body.stream, "t_max_predict_ms": body.t_max_predict_ms,
                    "num_draft_tokens": body.num_draft_tokens, "proposer": body.proposer}
        decoded = [0]

        def final(text: str, done: Done) -> dict:
            out = llama_answer(text, done, stop_ids, model, ignored)
            out.update(id_slot=job.worker, generation_settings=settings,
                       tokens=done.output_ids if body.return_tokens and not body.stream else [],
                       prompt=codec.decode(ids, skip_special=False))
            if done.logprobs:
                out["completion_probabilities"] = llama_probs(codec, done.logprobs)
            return nested_values(body.response_fields, out) if body.response_fields else out  # []: every field

        def piece_lines(piece: Piece) -> list:
            decoded[0] += len(piece.token_ids)
            line = {"index": 0, "content": piece.text, "tokens": piece.token_ids if body.return_tokens else [],
                    "stop": False, "id_slot": job.worker, "tokens_predicted": decoded[0], "tokens_evaluated": len(ids)}
            if piece.logprobs:
                line["completion_probabilities"] = llama_probs(codec, piece.logprobs)
            return [sse(line)]

        def progress_lines(report) -> list:
            return [sse({"index": 0, "content": "", "tokens": [], "stop": False, "id_slot": job.worker,
                         "tokens_predicted": 0, "tokens_evaluated": len(ids),
                         "prompt_progress": prompt_progress(report)})]

        if body.stream:
            return StreamingResponse(engine.events(job, first, piece_lines, lambda done: [sse(final("", done))],
                                                   error_lines, progress_lines), media_type="text/event-stream")
        text, done, _ = await engine.collect(job, first, request)
        return final(text, done)


class Completion(Generation):
    """``POST /completion`` and ``/completions``: llama-server's native completion. The prompt is text, token ids,
    or a list mixing both (tokenized as llama-server does: the tokenizer's BOS only before a first part that is
    text, special tokens written in the text parsed as such)."""

    async def create(self, body: CompletionRequest, request: Request):
        prompts = body.prompts()
        if prompts is not None:  # several prompts: one answer each, in order, as a list (llama-server's batch)
            if body.stream:
                raise APIError(400, "prompt: several prompts are not streamed: give stream: false or one prompt",
                               param="prompt")
            answers = []
            for index, prompt in enumerate(prompts):
                answer = await self.create(body.model_copy(update={"prompt": prompt}), request)
                answers.append({**answer, "index": index} if body.response_fields is None else answer)
            return answers
        names = self.names(body)
        ids = self.engine.codec.encode_mixed(body.prompt, add_special=True)
        budget = body.budget()[1]
        max_new = budget if budget >= 0 else self.engine.open_budget(ids)
        options = options_of(body, max_new, names, encode=self.text_ids)
        return await self.answer(body, request, ids, options, names, budget >= 0)


class Infill(Generation):
    """``POST /infill``: the prompt laid out as llama-server lays it (decoding/text/infill.py); the middle ends at EOS or
    at the tokenizer's FIM markers."""

    async def create(self, body: InfillRequest, request: Request):
        names = self.names(body)
        extra = [chunk.model_dump(include={"filename", "text"}) for chunk in body.input_extra]
        budget = body.budget()[1]
        decoder, engine = self.engine.decoder, self.engine
        try:
            if budget >= 0:
                max_new = budget
                ids = decoder.infill_prompt(body.input_prefix, body.input_suffix, extra=extra, prompt=body.prompt,
                                            max_new_tokens=max_new)
            else:  # until EOS or the context is full, keeping room for the middle
                reserve = min(INFILL_RESERVE, decoder.max_context // 4)
                ids = decoder.infill_prompt(body.input_prefix, body.input_suffix, extra=extra, prompt=body.prompt,
                                            max_new_tokens=reserve)
                max_new = engine.open_budget(ids)
        except GenerationError as exc:  # no FIM tokens, no room
            raise option_error(exc, names, budget >= 0, "input_prefix") from None
        stop_ids = fim_stop_ids(fim_tokens(decoder.manifest, engine.codec))
        options = options_of(body, max_new, names, encode=self.text_ids, stop_token_ids=stop_ids)
        return await self.answer(body, request, ids, options, names, budget >= 0, stop_ids, "input_prefix")


def mount(app, engine: Engine, server) -> None:
    completion = Completion(engine, server)
    for path in ("/completion", "/completions"):  # llama-server: both are its native completion (not OpenAI's)
        app.add_api_route(path, completion.create, methods=["POST"])
    app.add_api_route("/infill", Infill(engine, server).create, methods=["POST"])
    llama_info.mount(app, engine, server)
    llama_slots.mount(app, engine, server)
