"""What every wire dialect shares: strict request models, errors, and the decoder's refusals in a client's words.

Requests are pydantic models in strict mode that forbid unknown fields: a wrong type, an out-of-range value or
an unknown field is a 400 naming every bad field. Every request model derives from ``WireModel``, which checks
every string of a body (keys included) before anything reads it: valid JSON can carry a lone surrogate
("\\ud800") that no tokenizer, grammar engine or JSON answer takes, and such text is a 400 naming the field. What a combination of fields means (the context, the token
budget, a tree with a proposer) is checked once, by the decoder (``GenerationOptions`` and ``make_request``);
its ``GenerationError`` names the option at fault (``error.option``), which ``option_error`` turns into the
dialect's field through the dialect's table of names, without reading the message. Each dialect renders an
``APIError`` in its own shape (OpenAI's ``{"error": {...}}`` by default). Boundary: JSON shapes only.
"""

from __future__ import annotations

import json
import re

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, model_validator
from pydantic_core import PydanticCustomError

from specdec.contract.limits import MAX_STOP_STRINGS
from specdec.decoding.options import ContextLengthError, GenerationError, check_text
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


class APIError(Exception):
    """An error answer: HTTP status, one-line message, the field at fault (``param``), a code."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", retry_after: int | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.retry_after = retry_after

    def headers(self) -> dict | None:
        return {"Retry-After": str(self.retry_after)} if self.retry_after is not None else None

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.param, self.code, self.kind, self.headers())


def error_response(status, message, param=None, code=None, kind="invalid_request_error", headers=None):
    """OpenAI's error shape (also llama-server's)."""
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
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
        if error.get("type") == "json_invalid":
            detail = (error.get("ctx") or {}).get("error", error.get("msg"))
            return f"the request body is not valid JSON: {detail}", None
        location = [str(p) for p in error.get("loc", ()) if p != "body"]
        # drop pydantic's tags for union alternatives ("str", "list[str]", "constrained-int", "literal['auto']")
        location = [p for p in location if not _UNION_TAG.fullmatch(p)]
        if error.get("type") == "invalid_text":  # WireModel's check: the path inside the model it checked
            location += (error.get("ctx") or {}).get("field", [])
        name = ".".join(location) or "body"
        message = "unknown field" if error.get("type") == "extra_forbidden" else error.get("msg", "invalid")
        message = message.removeprefix("Value error, ")
        if message not in fields.setdefault(name, []):
            fields[name].append(message)
    parts = [f"{name}: {' or '.join(messages)}" for name, messages in fields.items()]
    return "; ".join(parts), next(iter(fields), None)


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
        return APIError(400, f"{param}: {exc.describe(budget)}", param=param, code="context_length_exceeded")
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
