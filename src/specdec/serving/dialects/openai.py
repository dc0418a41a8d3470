"""OpenAI's wire dialect: ``/v1/models``, ``/v1/completions`` (with ``suffix``: fill-in-the-middle),
``/v1/chat/completions`` (``stream: true`` as server-sent events), each also without the ``/v1`` prefix as
llama-server serves them.

A body becomes a ``GenerationOptions`` here (``options_of``), its output format a constraint, a chat's messages
and tools a ``Conversation`` run on the path every chat dialect shares (serving/chat_run.py); the job runs through
the shared ``Engine`` (serving/jobs.py), and the answer is written in OpenAI's shapes: ``choices``, ``usage`` with ``prompt_tokens_details.cached_tokens``, the
``specdec`` block (acceptance, rounds, timings), ``logprobs``, ``tool_calls``. Errors are OpenAI-shaped (wire.py).
"""

from __future__ import annotations

import time
import uuid
from functools import partial
from importlib.metadata import PackageNotFoundError, version

from fastapi import Request
from fastapi.responses import StreamingResponse

from specdec.contract.limits import MAX_SEED
from specdec.decoding.options import GenerationError, GenerationOptions
from specdec.decoding.request import GenerationStats
from specdec.serving.answers import logprob_entry, prompt_progress, specdec_fields, timings, timings_of
from specdec.serving.chat_run import Conversation, render, start_chat
from specdec.serving.dialects.openai_models import ChatCompletionRequest, ChatMessage, CompletionRequest, NamedToolChoice
from specdec.serving.jobs import Done, Engine, Piece
from specdec.serving.turns import output_constraint
from specdec.serving.wire import APIError, generation_options, option_error, sse

RANK = 10  # where this dialect mounts among the others (serving/dialects/__init__.py)

try:
    VERSION = version("specdec")
except PackageNotFoundError:  # run from a source tree that was never installed
    VERSION = "0"

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions

# decoder option -> the OpenAI field that carries it (the rest have the same names)
NAMES = {"max_new_tokens": "max_tokens", "prompt": "prompt", "stop_token_ids": "stop"}
CHAT_NAMES = {**NAMES, "prompt": "messages"}
INSERT_NAMES = {**NAMES, "prefix": "prompt"}  # /v1/completions with a suffix


def finish_reason(done: Done) -> str:
    """OpenAI's "stop" (EOS, end of turn, stop string) or "length"."""
    return "length" if done.finish == "length" else "stop"


def usage(stats: GenerationStats) -> dict:
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.new_tokens,
            "total_tokens": stats.prompt_tokens + stats.new_tokens,
            "prompt_tokens_details": {"cached_tokens": stats.cached_tokens}}


def fingerprint(engine: Engine) -> str:
    """OpenAI's ``system_fingerprint``: what produced the answer (specdec's version and the bundle's identity),
    "b..." as llama-server's build names it."""
    return f"b{VERSION}-{(engine.decoder.identity or '')[:12]}"


def options_of(body, max_new: int, names: dict, **more) -> GenerationOptions:
    """An OpenAI body's generation fields as a ``GenerationOptions`` (``more``: the route's own)."""
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    return generation_options(body, names, max_new, body.temperature, body.top_p, stop=stop, **more)


def body_constraint(body, names: dict):
    """The output constraint a body asks for: ``response_format`` (json_object / json_schema), or llama-server's
    ``grammar`` (GBNF) / ``json_schema``; at most one of them. Records the field in ``names`` so the decoder's
    refusals name it."""
    given = [name for name in ("response_format", "grammar", "json_schema")
             if name in type(body).model_fields and getattr(body, name) is not None and not (
                 name == "response_format" and body.response_format.type == "text")]
    if len(given) > 1:
        raise APIError(400, f"{given[1]}: give one of response_format, grammar, json_schema", param=given[1])
    if not given:
        return None
    name = names["constraint"] = given[0]
    try:
        if name == "grammar":
            return output_constraint("grammar", grammar=body.grammar, field=name)
        if name == "json_schema":
            return output_constraint("json_schema", body.json_schema, field=name)
        form = body.response_format
        if form.type == "json_object":
            return output_constraint("json_object", form.schema_, field=name)
        if form.json_schema is None:
            raise APIError(400, "response_format.json_schema: required with type json_schema",
                           param="response_format")
        return output_constraint("json_schema", form.json_schema.schema_, field=name)
    except GenerationError as exc:
        raise option_error(exc, names) from None


def chat_logprobs(codec, entries) -> dict | None:
    return None if entries is None else {"content": [logprob_entry(codec, e) for e in entries], "refusal": None}


def completion_logprobs(codec, entries, offset: int = 0) -> dict | None:
    """The legacy completions shape: tokens, token_logprobs, top_logprobs (token -> logprob), text_offset."""
    if entries is None:
        return None
    tokens, offsets, tops = [], [], []
    for entry in entries:
        item = logprob_entry(codec, entry)
        tokens.append(item["token"])
        offsets.append(offset)
        offset += len(item["token"])
        tops.append({alt["token"]: alt["logprob"] for alt in item["top_logprobs"]})
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries], "top_logprobs": tops,
            "text_offset": offsets}


def source_block(spans: list | None) -> dict | None:
    """``token_sources``: text by the proposer of its tokens (the web page's colours), for a piece or an answer."""
    if spans is None:
        return None
    return {"sources": [{"text": text, "source": source} for text, source in spans]}


def error_lines(message: str, code: str | None) -> list:
    return [sse({"error": {"message": message, "type": "server_error", "param": None, "code": code}})]


def include_usage(body) -> bool:
    return bool(body.stream_options and body.stream_options.include_usage)


def plain_message(message: ChatMessage) -> dict:
    plain = message.model_dump(exclude_none=True)
    if plain["role"] == "developer":  # OpenAI's newer name for the system role; templates know "system"
        plain["role"] = "system"
    return plain


class Completions:
    """``POST /v1/completions``."""

    def __init__(self, engine: Engine, server):
        self.engine, self.server = engine, server

    async def create(self, body: CompletionRequest, request: Request):
        model = self.server.answer_model(body.model)
        engine = self.engine
        prompt = body.prompt[0] if isinstance(body.prompt, list) and isinstance(body.prompt[0], str) else body.prompt
        names = dict(INSERT_NAMES if body.suffix is not None else NAMES)
        constraint = body_constraint(body, names)
        max_new = body.max_tokens if body.max_tokens is not None else COMPLETION_DEFAULT_MAX_TOKENS
        options = options_of(body, max_new, names, constraint=constraint, logprobs=body.logprobs,
                             encode=partial(engine.codec.encode, special=False))
        try:
            if body.suffix is not None:  # OpenAI's legacy insert mode / Ollama's suffix: fill in the middle
                if not isinstance(prompt, str):
                    raise APIError(400, "suffix: fill-in-the-middle needs a text prompt, not token ids", param="suffix")
                prompt_ids, options = engine.decoder.infill_request(prompt, body.suffix, options)
            else:
                prompt_ids = engine.codec.encode(prompt) if isinstance(prompt, str) else list(prompt)
        except GenerationError as exc:
            raise option_error(exc, names) from None
        prepared = engine.prepare(prompt_ids, options, names, sources=body.token_sources)
        job, first = await engine.start(prepared, request, names)
        ident, created = f"cmpl-{uuid.uuid4().hex[:24]}", int(time.time())
        codec, offset, system = engine.codec, [0], fingerprint(engine)

        def chunk(text, finish, entries=None):
            logprobs = completion_logprobs(codec, entries, offset[0]) if entries is not None else None
            offset[0] += len(text or "")
            return {"id": ident, "object": "text_completion", "created": created, "model": model,
                    "system_fingerprint": system, "choices": [{"index": 0, "text": text or "", "logprobs": logprobs, "finish_reason": finish}]}

        if body.stream:
            def piece_lines(piece: Piece) -> list:
                out = chunk(piece.text, None, piece.logprobs)
                if (block := source_block(piece.spans)) is not None:
                    out["specdec"] = block
                return [sse(out)]

            def last(done: Done) -> list:
                lines = []
                if done.logprobs:  # tokens no piece carried (text held back, e.g. an incomplete character)
                    lines.append(sse(chunk("", None, done.logprobs)))
                final = chunk(None, finish_reason(done))
                final["specdec"] = specdec_fields(done)
                lines.append(sse(final))
                if include_usage(body):
                    lines.append(sse({**chunk(None, None), "choices": [], "usage": usage(done.stats),
                                      "specdec": specdec_fields(done)}))
                return lines + ["data: [DONE]\n\n"]

            return StreamingResponse(engine.events(job, first, piece_lines, last, error_lines),
                                     media_type="text/event-stream")
        text, done, spans = await engine.collect(job, first, request)
        return {**chunk(text, finish_reason(done), done.logprobs), "usage": usage(done.stats),
                "specdec": specdec_fields(done) | (source_block(spans if prepared.sources else None) or {})}


class Chat:
    """``POST /v1/chat/completions``: the bundle's chat template around the messages; ``tools`` rendered by the
    template, the model's calls parsed (decoding/text/tools.py) into ``tool_calls``."""

    def __init__(self, engine: Engine, server):
        self.engine, self.server = engine, server

    async def create(self, body: ChatCompletionRequest, request: Request):
        model = self.server.answer_model(body.model)
        engine = self.engine
        names = dict(CHAT_NAMES)
        if body.max_completion_tokens is not None:
            if body.max_tokens is not None and body.max_tokens != body.max_completion_tokens:
                raise APIError(400, "max_tokens and max_completion_tokens differ: give one", param="max_tokens")
            body = body.model_copy(update={"max_tokens": body.max_completion_tokens})
            names["max_new_tokens"] = "max_completion_tokens"
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs: needs logprobs: true", param="top_logprobs")
        conversation = self.conversation(body, names)
        if body.n > 1:
            if body.stream:
                raise APIError(400, "n: several choices are not streamed: give stream: false or n: 1", param="n")
            return await self.choices(body, request, names, conversation, model)
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        run = await start_chat(engine, request, names, conversation, body.max_tokens,
                               partial(options_of, body, names=names, logprobs=logprobs,
                                       encode=partial(engine.codec.encode, special=False)),
                               sources=body.token_sources, worker=engine.slot(body.id_slot),
                               progress=body.stream and body.return_progress)
        job, first, output = run.job, run.first, run.output
        ident, created = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time())
        codec, system = engine.codec, fingerprint(engine)

        def chunk(delta, finish, entries=None):
            return {"id": ident, "object": "chat.completion.chunk", "created": created, "model": model,
                    "system_fingerprint": system, "choices": [{"index": 0, "delta": delta, "logprobs": chat_logprobs(codec, entries),
                                 "finish_reason": finish}]}

        if body.stream:
            def call_lines(finished) -> list:
                first = len(output.calls) - len(finished)
                return [sse(chunk({"tool_calls": [call.as_openai(first + i)]}, None)) for i, call in enumerate(finished)]

            def piece_lines(piece: Piece) -> list:
                content, finished = output.push(piece.text)
                lines = []
                if content or piece.logprobs:
                    out = chunk({"content": content}, None, piece.logprobs)
                    if body.timings_per_token:  # llama-server's: the timings so far on every chunk
                        out["timings"] = timings_of(run.prepared.stats)
                    # with tool-call parsing the content is not the decoded text: no spans (the page sends no tools)
                    if (block := source_block(piece.spans)) is not None and output.stream is None:
                        out["specdec"] = block
                    lines.append(sse(out))
                return lines + call_lines(finished)

            def last(done: Done) -> list:
                lines = []
                rest, finished = output.finish()
                if rest or done.logprobs:
                    lines.append(sse(chunk({"content": rest} if rest else {}, None, done.logprobs or None)))
                lines += call_lines(finished)
                called = bool(output.calls)
                final = chunk({}, "tool_calls" if called and done.finish != "length" else finish_reason(done))
                final["specdec"] = specdec_fields(done)
                final["timings"] = timings(done)  # llama-server's, on its last chunks
                lines.append(sse(final))
                if include_usage(body):
                    lines.append(sse({**chunk({}, None), "choices": [], "usage": usage(done.stats),
                                      "timings": timings(done), "specdec": specdec_fields(done)}))
                return lines + ["data: [DONE]\n\n"]

            def progress_lines(report) -> list:  # llama-server's: the opening delta again, with the progress
                return [sse({**chunk({"role": "assistant", "content": None}, None),
                             "prompt_progress": prompt_progress(report)})]

            async def events():
                yield sse(chunk({"role": "assistant", "content": None}, None))  # null, as llama-server sends it
                async for line in engine.events(job, first, piece_lines, last, error_lines, progress_lines):
                    yield line

            return StreamingResponse(events(), media_type="text/event-stream")
        content, calls, done = await run.whole(engine, request)
        spans, prepared, turn = run.spans, run.prepared, run.turn
        message = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [call.as_openai() for call in calls]
        finish = "tool_calls" if calls and done.finish != "length" else finish_reason(done)
        verbose = self.server.verbose if body.verbose is None else body.verbose
        debug = {"__verbose": {"prompt": codec.decode(run.turn.ids, skip_special=False), "content": content,
                               "tokens_predicted": done.stats.new_tokens}} if verbose else {}
        return debug | {"id": ident, "object": "chat.completion", "created": created, "model": model,
                "system_fingerprint": system, "choices": [{"index": 0, "message": message, "logprobs": chat_logprobs(codec, done.logprobs),
                             "finish_reason": finish}],
                "usage": usage(done.stats),
                "specdec": specdec_fields(done) | (source_block(spans if prepared.sources and turn.form is None
                                                                else None) or {})}


    async def choices(self, body: ChatCompletionRequest, request: Request, names: dict, conversation: Conversation,
                      model: str) -> dict:
        """``n`` choices, one job after another (the second reads the prompt from the first's cache): choice i
        samples with seed + i (the request's seed, else the server's), or with fresh randomness when neither is
        set; greedy choices are equal. Usage counts the prompt once and every choice's tokens."""
        seed = body.seed if body.seed is not None else self.server.seed
        answers = []
        for index in range(body.n):
            one = body.model_copy(update={"n": 1, "seed": None if seed is None else (seed + index) % (MAX_SEED + 1)})
            answers.append(await self.create(one, request))
        stats = [answer["usage"] for answer in answers]
        completion = sum(item["completion_tokens"] for item in stats)
        first = answers[0]
        return {**first, "choices": [{**answer["choices"][0], "index": index} for index, answer in enumerate(answers)],
                "usage": {**first["usage"], "completion_tokens": completion,
                          "total_tokens": first["usage"]["prompt_tokens"] + completion},
                "specdec": {**first["specdec"], "choices": [answer["specdec"] for answer in answers]}}

    @staticmethod
    def conversation(body: ChatCompletionRequest, names: dict) -> Conversation:
        """The body's messages, tools and output constraint as the turn renderer takes them."""
        tools = [tool.model_dump(exclude_none=True) for tool in body.tools or []]
        choice = body.tool_choice.model_dump() if isinstance(body.tool_choice, NamedToolChoice) else body.tool_choice
        constraint = body_constraint(body, names)
        text_format = names.get("constraint") == "response_format"  # set aside when a call is required
        if body.continue_final_message and body.add_generation_prompt:
            raise APIError(400, "continue_final_message: cannot be true together with add_generation_prompt (the "
                                "answer either continues the final message or starts a new one)",
                           param="continue_final_message")
        add_header = body.add_generation_prompt is not False
        continue_final = body.continue_final_message
        if continue_final is None and body.add_generation_prompt is not None:
            continue_final = False  # an explicit add_generation_prompt says how the prompt ends
        return Conversation([plain_message(m) for m in body.messages], tools, choice, body.parallel_tool_calls,
                            None if text_format else constraint, constraint if text_format else None,
                            continue_final=continue_final, add_generation_prompt=add_header)

    async def template(self, body: ChatCompletionRequest):
        """llama-server's ``POST /apply-template``: the prompt the bundle's chat template makes of the body."""
        self.server.answer_model(body.model)
        names = dict(CHAT_NAMES)
        turn = render(self.engine, self.conversation(body, names), names)
        return {"prompt": self.engine.codec.decode(turn.ids, skip_special=False)}

    async def count(self, body: ChatCompletionRequest):
        """llama-server's ``POST /chat/completions/input_tokens``: the rendered prompt's token count."""
        self.server.answer_model(body.model)
        names = dict(CHAT_NAMES)
        return {"input_tokens": len(render(self.engine, self.conversation(body, names), names).ids)}


class Models:
    """``GET /v1/models``, ``GET /v1/models/{model}``."""

    def __init__(self, server):
        self.server = server

    async def list(self):
        return {"object": "list", "data": [self._card(name) for name in self.server.model_names]}

    async def one(self, model: str):
        self.server.known_model(model)
        return self._card(model)

    @staticmethod
    def _card(name: str) -> dict:
        return {"id": name, "object": "model", "created": 0, "owned_by": "specdec"}


def mount(app, engine: Engine, server) -> None:
    completions, chat, models = Completions(engine, server), Chat(engine, server), Models(server)
    for prefix in ("/v1", ""):  # llama-server answers both
        app.add_api_route(f"{prefix}/models", models.list, methods=["GET"])
        app.add_api_route(f"{prefix}/models/{{model}}", models.one, methods=["GET"])
        app.add_api_route(f"{prefix}/chat/completions", chat.create, methods=["POST"])
        app.add_api_route(f"{prefix}/chat/completions/input_tokens", chat.count, methods=["POST"])
    app.add_api_route("/apply-template", chat.template, methods=["POST"])
    app.add_api_route("/v1/completions", completions.create, methods=["POST"])
