"""What every wire dialect shares: strict request models, errors, and the decoder's refusals in a client's words.

Requests are pydantic models in strict mode that forbid unknown fields: a wrong type, an out-of-range value or
an unknown field is a 400 naming every bad field by the client's path (``one_of`` / ``text_or`` unions keep their
tags out of it). Every request model derives from ``WireModel``, which checks every string of a body (keys
included) before anything reads it: valid JSON can carry a lone surrogate ("\\ud800") that no tokenizer, grammar
engine or JSON answer takes, and such text is a 400 naming the field. specdec's own fields (``Extensions``) are one
model every dialect's body extends, and ``generation_options`` builds the decoder's options from them and the
dialect's sampling fields. What a combination of fields means (the context, the token
budget, a tree with a proposer) is checked once, by the decoder (``GenerationOptions`` and ``make_request``);
its ``GenerationError`` names the option at fault (``error.option``), which ``option_error`` turns into the
dialect's field through the dialect's table of names, without reading the message. Each dialect renders an
``APIError`` in its own shape (OpenAI's ``{"error": {...}}`` by default). Boundary: JSON shapes and the
decoder's options; no routes.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Literal, Union, get_args

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import AfterValidator, BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator
from pydantic_core import PydanticCustomError

from specdec.contract.limits import MAX_DRAFT_TOKENS, MAX_SEED, MAX_STOP_STRINGS
from specdec.decoding.options import ContextLengthError, GenerationError, GenerationOptions, check_text
from specdec.decoding.proposers import proposer_names
from specdec.sampling.processors import SamplingConfig, SamplingError

# what a generating route reserves for one round's proposals when the client leaves the token budget open
DRAFT_ROOM = 64


def first_bad_text(value, path: tuple = ()) -> tuple | None:
    """(the path of the first string in ``value`` that is not valid text, what is wrong), or None. A bad key is
    reported at its object's path (the key itself cannot be shown)."""
    if isinstance(value, str):
        try:
            check_text(value, "text")
        except GenerationError as exc:
            return path, exc.problem
    elif isinstance(value, dict):
        for key, item in value.items():
            if isinstance(key, str) and (bad := first_bad_text(key, path)) is not None:
                return path, f"has a key that {bad[1]}"
            if (bad := first_bad_text(item, (*path, str(key)))) is not None:
                return bad
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            if (bad := first_bad_text(item, (*path, str(index)))) is not None:
                return bad
    return None


class WireModel(BaseModel):
    """The base of every request body: each string in it, keys included, is text a tokenizer takes."""

    @model_validator(mode="before")
    @classmethod
    def _valid_texts(cls, data):
        bad = first_bad_text(data)
        if bad is not None:
            raise PydanticCustomError("invalid_text", "{problem}", {"field": list(bad[0]), "problem": bad[1]})
        return data


class Strict(WireModel):
    model_config = ConfigDict(extra="forbid", strict=True)


# field types of the dialects' models: ``WireModel`` checks every string in a body, these included
Text = str  # a text field
JSONObject = dict  # a JSON object given as a value (a schema, a tool's input, metadata)
ProposerName = Literal[proposer_names()]  # the registry's names (decoding/proposers)


def one_of(*models, default: str | None = None):
    """A union of Strict models told apart by their ``type`` (``default``: the type of an object without one).
    An error names the client's field path alone: the union's tags are the models' names, which ``field_errors``
    drops, and an object of an unknown type is one error saying which types there are."""
    tags = {value: model.__name__ for model in models for value in get_args(model.model_fields["type"].annotation)
            if isinstance(value, str)}

    def which(value):
        kind = value.get("type", default) if isinstance(value, dict) else getattr(value, "type", None)
        return tags.get(kind) if isinstance(kind, str) else None

    known = ", ".join(repr(kind) for kind in tags)
    return Annotated[Union[tuple(Annotated[model, Tag(model.__name__)] for model in models)],
                     Discriminator(which, custom_error_type="unknown_type",
                                   custom_error_message=f"should be an object whose type is one of {known}")]


def text_or(listed):
    """A string, or a list of ``listed``: one alternative's errors only, chosen by the value's JSON type."""
    return Annotated[Union[Annotated[Text, Tag("String")], Annotated[list[listed], Tag("List")]],
                     Discriminator(lambda value: "String" if isinstance(value, str) else
                                   "List" if isinstance(value, list) else None,
                                   custom_error_type="string_or_list",
                                   custom_error_message="should be a string or a list")]


# OpenAI's {token id: bias} (-100..100) and llama-server's forms: keys or [token, bias] pairs whose token is an id or
# text (each of the text's tokens), false for never (logit_bias_pairs reads them)
LogitBias = dict[str, float | Literal[False]] | list[list[int | float | str | Literal[False]]] | None


class Extensions(Strict):
    """specdec's fields, accepted beside every dialect's own: the sampling knobs some APIs lack and speculation."""
    top_k: Annotated[int, Field(ge=0)] = 0
    min_p: Annotated[float, Field(ge=0.0, lt=1.0)] = 0.0
    repetition_penalty: Annotated[float, Field(gt=0.0, le=10.0)] = 1.0
    seed: Annotated[int, Field(ge=0, le=MAX_SEED)] | None = None
    num_draft_tokens: Annotated[int, Field(ge=0, le=MAX_DRAFT_TOKENS)] | Literal["auto"] = "auto"
    proposer: ProposerName | None = None
    tree: str | list[Annotated[int, Field(ge=1)]] | None = None
    logit_bias: "LogitBias" = None


def logit_bias_pairs(bias, encode=None) -> tuple:
    """A body's ``logit_bias`` as ((token id, bias), ...) for ``SamplingConfig``: keys that are digits are ids, other
    text is each of its tokens (``encode``); false is -inf. A key that is neither is a 400 naming the field."""
    if bias is None:
        return ()
    pairs = []
    for item in (bias.items() if isinstance(bias, dict) else bias):
        if len(item) != 2 or isinstance(item[0], (bool, float)) or isinstance(item[1], str):
            raise APIError(400, f"logit_bias: {list(item)!r} is not a [token, bias] pair", param="logit_bias")
        token, value = item
        value = float("-inf") if value is False else value
        if isinstance(token, int) or (isinstance(token, str) and token.strip().lstrip("-").isdigit()):
            pairs.append((int(token), value))
        elif encode is not None:
            pairs += [(token_id, value) for token_id in encode(token)]
        else:
            raise APIError(400, f"logit_bias: {token!r} is not a token id", param="logit_bias")
    return tuple(pairs)


class APIError(Exception):
    """An error answer: HTTP status, one-line message, the field at fault (``param``), a code."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", retry_after: int | None = None, extra: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.retry_after = retry_after
        self.extra = extra or {}  # more fields of the error object (llama-server's n_prompt_tokens, n_ctx)

    def headers(self) -> dict | None:
        return {"Retry-After": str(self.retry_after)} if self.retry_after is not None else None

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.param, self.code, self.kind, self.headers(), self.extra)


def error_response(status, message, param=None, code=None, kind="invalid_request_error", headers=None, extra=None):
    """OpenAI's error shape (also llama-server's)."""
    body = {"error": {"message": message, "type": kind, "param": param, "code": code, **(extra or {})}}
    return JSONResponse(body, status_code=status, headers=headers)


class ClientGone(Exception):
    """The client disconnected before its (non-streaming) answer was ready."""


def sse(payload: dict, event: str | None = None) -> str:
    """One server-sent event (``event:`` line only when named, as Anthropic's and the Responses API's streams)."""
    data = f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"
    return f"event: {event}\n{data}" if event else data


def check_stops(value):
    stops = [value] if isinstance(value, str) else (value or [])
    if len(stops) > MAX_STOP_STRINGS:
        raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
    if any(not s for s in stops):
        raise ValueError("stop strings must be non-empty")
    return value


StopStrings = Annotated[str | list[str], AfterValidator(check_stops)]  # every dialect's ``stop`` field


def field_errors(exc: RequestValidationError) -> tuple[str, str | None]:
    """One message naming every bad field (``temperature: ...; messages.0.role: ...``), and the first field.

    A union field (``stop``: a string or a list) fails once per alternative: its messages are joined."""
    fields: dict = {}
    for error in exc.errors():
        location = _location(error)
        media = _media_part(error, location)
        if media is not None:  # an image (or audio, a file): one clear line, not each union alternative's complaint
            where, kind = media
            return f"{where}: {kind} input is not supported: the served model reads text only", where
        if error.get("type") == "json_invalid":
            detail = (error.get("ctx") or {}).get("error", error.get("msg"))
            return f"the request body is not valid JSON: {detail}", None
        if error.get("type") == "invalid_text":  # WireModel's check: the path inside the model it checked
            location += (error.get("ctx") or {}).get("field", [])
        name = ".".join(location) or "body"
        message = "unknown field" if error.get("type") == "extra_forbidden" else error.get("msg", "invalid")
        message = message.removeprefix("Value error, ")
        if message not in fields.setdefault(name, []):
            fields[name].append(message)
    parts = [f"{name}: {' or '.join(messages)}" for name, messages in fields.items()]
    return "; ".join(parts), next(iter(fields), None)


# content parts of the APIs' media types (OpenAI's chat and Responses, Anthropic's) a text model cannot read
MEDIA_PARTS = {"image": "image", "image_url": "image", "input_image": "image", "document": "document",
               "input_file": "file", "file": "file", "input_audio": "audio", "audio": "audio"}


def _location(error: dict) -> list:
    """The client's field path of a pydantic error: without "body" and pydantic's tags for union alternatives
    ("str", "list[str]", "constrained-int", "literal['auto']")."""
    return [str(p) for p in error.get("loc", ()) if p != "body" and not _UNION_TAG.fullmatch(str(p))]


def _media_part(error: dict, location: list) -> tuple[str, str] | None:
    """(the part's field path, "image" / "audio" / ...) when ``error`` (at ``location``) is about a media content
    part."""
    value = error.get("input")
    if isinstance(value, dict) and isinstance(value.get("type"), str) and value["type"] in MEDIA_PARTS:
        return ".".join(location) or "body", MEDIA_PARTS[value["type"]]
    if location and location[-1] == "type" and isinstance(value, str) and value in MEDIA_PARTS:
        return ".".join(location[:-1]), MEDIA_PARTS[value]
    return None


_UNION_TAG = re.compile(r"(str|int|float|bool|none|list\[.*\]|dict\[.*\]|literal\[.*\]|constrained-\w+|"
                        r"function-\w+\[.*\]|tagged-union\[.*\]|[A-Z]\w+)")
_INDEXED = re.compile(r"^([A-Za-z_]+)(.*)$")  # "stop[1]" -> ("stop", "[1]")


def wire_name(option: str, names: dict) -> str:
    """The client's name for a decoder option: ``names[option]`` (indices kept: ``stop[1]``), else the option."""
    match = _INDEXED.match(option)
    if match and match.group(1) in names:
        return names[match.group(1)] + match.group(2)
    return option


def option_error(exc: ValueError, names: dict, budget_given: bool = True, prompt_field: str | None = None) -> APIError:
    """A 400 for the decoder's refusal (``GenerationError`` / ``SamplingError``, or any one-line ValueError),
    naming the client's field: ``names`` maps decoder options to the dialect's fields (``max_new_tokens`` ->
    ``max_tokens``, ``prompt`` -> ``messages``). A context overflow names the token budget when the client gave
    one (``budget_given``), else the prompt (``prompt_field``, default ``names["prompt"]``), with OpenAI's
    ``context_length_exceeded`` code."""
    if isinstance(exc, ContextLengthError):
        budget = names.get("max_new_tokens", "max_new_tokens")
        param = budget if budget_given else (prompt_field or names.get("prompt", "prompt"))
        # OpenAI's code; llama-server's counts (its routes name the type exceed_context_size_error)
        return APIError(400, f"{param}: {exc.describe(budget)}", param=param, code="context_length_exceeded",
                        extra={"n_prompt_tokens": exc.prompt_tokens, "n_ctx": exc.max_context})
    option, problem = getattr(exc, "option", None), getattr(exc, "problem", None)
    text = " ".join(str(exc).split()) or type(exc).__name__
    if option is None:
        return APIError(400, text)
    field = wire_name(option, names)
    return APIError(400, f"{field} {problem}" if problem else f"{field}: {text}", param=field)


def sampling_config(names: dict, **fields) -> SamplingConfig:
    """``SamplingConfig(**fields)``; a value out of range is a 400 naming the client's field (``names``)."""
    try:
        return SamplingConfig(**fields)
    except SamplingError as exc:
        raise option_error(exc, names) from None


def generation_options(body: Extensions, names: dict, max_new: int, temperature: float, top_p: float,
                       top_k: int | None = None, stop=(), encode=None, **more) -> GenerationOptions:
    """A body's generation fields as a ``GenerationOptions``: its dialect's sampling fields, specdec's extensions
    (``body``), ``more`` (the route's own: stop ids, a constraint, logprobs). A refusal is a 400 naming the field.
    ``encode``: text -> token ids, for ``logit_bias`` keys given as text."""
    tree = ",".join(map(str, body.tree)) if isinstance(body.tree, list) else body.tree
    try:
        sampling = sampling_config(names, temperature=temperature, top_k=body.top_k if top_k is None else top_k,
                                   top_p=top_p, min_p=body.min_p, repetition_penalty=body.repetition_penalty,
                                   logit_bias=logit_bias_pairs(body.logit_bias, encode))
        return GenerationOptions(max_new_tokens=max_new, sampling=sampling, num_draft_tokens=body.num_draft_tokens,
                                 seed=body.seed, stop=tuple(stop), proposer=body.proposer, tree=tree, **more)
    except GenerationError as exc:
        raise option_error(exc, names) from None
