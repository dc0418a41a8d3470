"""The OpenAI wire format of the server: request models, OpenAI-shaped errors.

Requests are pydantic models in strict mode that forbid unknown fields: a wrong type, an
out-of-range value or an unknown field is a 400 naming every bad field. The bounds here come from the
limits table (contract/limits.py); what a combination of fields means (the context, the token budget,
a tree with a proposer) is checked once, by the decoder's own ``make_request`` (handlers.py maps its
``GenerationError`` to a 400 naming the wire field). Boundary: JSON shapes only.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from typing import Annotated, Literal

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator

from specdec.contract.limits import MAX_DRAFT_TOKENS, MAX_SEED, MAX_STOP_STRINGS, MAX_TOP_LOGPROBS
from specdec.decoding.request import make_request
from specdec.sampling.processors import SamplingConfig


# ----------------------------------------------------------------------------- request models
def _check_stops(value):
    stops = [value] if isinstance(value, str) else (value or [])
    if len(stops) > MAX_STOP_STRINGS:
        raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
    if any(not s for s in stops):
        raise ValueError("stop strings must be non-empty")
    return value


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class JsonSchemaFormat(_Strict):
    name: str = "response"
    description: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    """OpenAI's ``response_format``: "text", "json_object" (any JSON object) or "json_schema" (strict)."""
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None
    schema_: dict | None = Field(default=None, alias="schema")  # vLLM / llama-server's shorthand for json_object


class _GenerationFields(_Strict):
    model: str
    max_tokens: int | None = None  # its range is the decoder's (make_request): one place
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0  # OpenAI's default (0 = greedy)
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: Annotated[int, Field(ge=0, le=MAX_SEED)] | None = None
    user: str | None = None  # accepted and ignored, as by other local servers
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # specdec extensions
    top_k: Annotated[int, Field(ge=0)] = 0
    min_p: Annotated[float, Field(ge=0.0, lt=1.0)] = 0.0
    repetition_penalty: Annotated[float, Field(gt=0.0, le=10.0)] = 1.0
    num_draft_tokens: Annotated[int, Field(ge=0, le=MAX_DRAFT_TOKENS)] | Literal["auto"] = "auto"
    proposer: Literal["draft", "lookup", "suffix", "hybrid"] | None = None
    tree: str | list[Annotated[int, Field(ge=1)]] | None = None
    # constrained output: OpenAI's response_format; llama-server's grammar (GBNF) and json_schema
    response_format: ResponseFormat | None = None
    grammar: str | None = None
    json_schema: dict | None = None

    @field_validator("n")
    @classmethod
    def _one_choice(cls, value):
        if value != 1:
            raise ValueError("only n=1 is supported")
        return value

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, value):
        if value != 0:
            raise ValueError("only 0 is supported (use repetition_penalty)")
        return value

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, value):
        return _check_stops(value)


class CompletionRequest(_GenerationFields):
    prompt: str | list[str] | list[int]
    suffix: str | None = None  # OpenAI's legacy insert / Ollama's: the text after the completion (fill-in-the-middle)
    echo: Literal[False] = False
    logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None  # legacy: alternatives per token

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value):
        if isinstance(value, list) and value and isinstance(value[0], str) and len(value) != 1:
            raise ValueError("only one prompt per request (n=1, no batches)")
        if not value:
            raise ValueError("prompt is empty")
        return value


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str
    arguments: str  # JSON text


class ToolCallMessage(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallMessage] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool result: the call it answers


class FunctionSpec(_Strict):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")]
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class ToolSpec(_Strict):
    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_GenerationFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True


# ----------------------------------------------------------------------------- llama-server's /infill
class InfillChunk(_Strict):
    filename: str = "tmp"
    text: str = ""


class InfillRequest(BaseModel):
    """llama-server's ``POST /infill`` body. Fields llama.cpp knows and specdec does not (``n_probs``,
    ``mirostat``, ``id_slot``, ...) are tolerated and listed in the answer's ``specdec.ignored_fields``;
    the fields below are typed strictly (a wrong type or range is a 400 naming the field)."""
    model_config = ConfigDict(extra="allow", strict=True)

    input_prefix: str = ""
    input_suffix: str = ""
    input_extra: list[InfillChunk] = []
    prompt: str = ""  # text after the prefix, inside the FIM frame (llama.cpp's layout)
    n_predict: Annotated[int, Field(ge=-1)] = -1  # -1: until EOS or the context is full; 0: prefill only (warm-up)
    t_max_predict_ms: Annotated[int, Field(ge=0)] = 0  # stop once this long after the first token and a newline
    cache_prompt: bool = True
    stop: str | list[str] = []
    stream: bool = False
    temperature: Annotated[float, Field(ge=0.0)] = 0.8  # llama.cpp's defaults
    top_k: Annotated[int, Field(ge=0)] = 40
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 0.95
    min_p: Annotated[float, Field(ge=0.0, lt=1.0)] = 0.05
    repeat_penalty: Annotated[float, Field(gt=0.0, le=10.0)] = 1.0
    seed: Annotated[int, Field(ge=-1, le=MAX_SEED)] = -1  # -1: fresh randomness
    model: str | None = None
    # specdec extensions
    num_draft_tokens: Annotated[int, Field(ge=0, le=MAX_DRAFT_TOKENS)] | Literal["auto"] = "auto"
    proposer: Literal["draft", "lookup", "suffix", "hybrid"] | None = None
    grammar: str | None = None  # GBNF
    json_schema: dict | None = None
    n_probs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] = 0  # alternatives per token in completion_probabilities

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, value):
        return _check_stops(value)

    @property
    def ignored_fields(self) -> list:
        return sorted(self.model_extra or ())


# ----------------------------------------------------------------------------- errors
class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", retry_after: int | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.retry_after = retry_after

    def response(self) -> JSONResponse:
        headers = {"Retry-After": str(self.retry_after)} if self.retry_after is not None else None
        return error_response(self.status, self.message, self.param, self.code, self.kind, headers)


def error_response(status, message, param=None, code=None, kind="invalid_request_error", headers=None):
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


def field_errors(exc: RequestValidationError) -> tuple[str, str | None]:
    """One message naming every bad field (``temperature: ...; messages.0.role: ...``), and the first field.

    A union field (``stop``: a string or a list) fails once per alternative: its messages are joined."""
    fields: dict = {}
    for error in exc.errors():
        if error.get("type") == "json_invalid":
            detail = (error.get("ctx") or {}).get("error", error.get("msg"))
            return f"the request body is not valid JSON: {detail}", None
        location = [str(p) for p in error.get("loc", ()) if p != "body"]
        # drop pydantic's tags for union alternatives ("str", "list[str]", "constrained-int", "literal['auto']")
        location = [p for p in location if not _UNION_TAG.fullmatch(p)]
        name = ".".join(location) or "body"
        message = "unknown field" if error.get("type") == "extra_forbidden" else error.get("msg", "invalid")
        message = message.removeprefix("Value error, ")
        if message not in fields.setdefault(name, []):
            fields[name].append(message)
    parts = [f"{name}: {' or '.join(messages)}" for name, messages in fields.items()]
    return "; ".join(parts), next(iter(fields), None)


class ClientGone(Exception):
    """The client disconnected before its (non-streaming) answer was ready."""


_UNION_TAG = re.compile(r"(str|int|float|bool|none|list\[.*\]|dict\[.*\]|literal\[.*\]|constrained-\w+|"
                        r"function-\w+\[.*\]|[A-Z]\w+)")


# ----------------------------------------------------------------------------- the decoder's errors, on the wire
_LEADING_NAME = re.compile(r"[a-z_]+")


def decoder_error(exc: ValueError, wire_names: dict, prompt_field: str = "prompt",
                  budget_given: bool = True) -> APIError:
    """A 400 for the decoder's one-line ``GenerationError`` (or SamplingConfig's ValueError), naming the field.

    The decoder's messages begin with the argument they are about (``num_draft_tokens must be ...``,
    ``prompt (9 tokens) + max_new_tokens (10000) ... exceeds max_context 512``); ``wire_names`` maps a
    decoder argument to the request field a client sent (``max_new_tokens`` -> ``max_tokens``), and the
    message is rewritten in the client's names. A context overflow names the token budget when the
    client gave one (``budget_given``), else the prompt, with OpenAI's ``context_length_exceeded`` code."""
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    for name, field in wire_names.items():
        message = re.sub(rf"\b{name}\b", field, message)
    match = _LEADING_NAME.match(message)
    word = match.group(0) if match else ""
    code = None
    if "exceeds max_context" in message or "context has no room" in message:
        code = "context_length_exceeded"
        param = wire_names.get("max_new_tokens", "max_tokens") if budget_given else prompt_field
    elif word == "prompt":
        param = prompt_field
    elif word in wire_names.values() or word in _FIELDS:
        param = word
    else:
        param = None
    if param is not None and not message.startswith(param):
        message = f"{param}: {message}"
    return APIError(400, message, param=param, code=code)


# the decoder's arguments (make_request's keywords) and SamplingConfig's fields: the names its messages begin with
_FIELDS = frozenset(inspect.signature(make_request).parameters) | {f.name for f in dataclasses.fields(SamplingConfig)}
