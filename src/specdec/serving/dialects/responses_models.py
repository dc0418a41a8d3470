"""The OpenAI Responses API's request bodies (``POST /v1/responses``, ``POST /v1/responses/input_tokens``), as strict
pydantic models.

Three kinds of field: the ones specdec serves (typed strictly: a wrong type or range is a 400 naming the field);
the ones clients send that cannot change an answer here (``user``, ``service_tier``, ``reasoning`` for a model
that has no reasoning mode, ...: accepted, ignored, and listed in the answer's ``specdec.ignored_fields``); and
everything else (an unknown field, a hosted tool, an image: a 400 naming it). Every text field, and every string
inside a JSON value, must be encodable (a lone surrogate is a 400 naming the field). Input items are the ones an
agent sends back: its messages (string content or ``input_text`` / ``output_text`` parts), the model's
``function_call`` items and the ``function_call_output`` results, with the ``id`` / ``status`` / ``annotations``
the API put on them.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator

from specdec.serving.dialects.openai_models import FunctionSpec
from specdec.serving.wire import Extensions, JSONObject, Strict, Text, one_of, text_or

Status = Literal["in_progress", "completed", "incomplete"]
LOGPROBS_INCLUDE = "message.output_text.logprobs"  # the include value asking for logprobs


class InputText(Strict):
    type: Literal["input_text"]
    text: Text


class OutputText(Strict):
    """An earlier answer's text part, as the API returned it (its annotations and logprobs are not rendered)."""
    type: Literal["output_text"]
    text: Text
    annotations: list[JSONObject] = []
    logprobs: list[JSONObject] | None = None


class InputMessage(Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: text_or(one_of(InputText, OutputText))
    id: Text | None = None
    status: Status | None = None
    phase: Literal["commentary", "final_answer"] | None = None  # an assistant message's label: not rendered


class FunctionCallItem(Strict):
    """A call the model made (an earlier answer's output item)."""
    type: Literal["function_call"]
    call_id: Text
    name: Text
    arguments: Text  # JSON text
    id: Text | None = None
    status: Status | None = None


class FunctionCallOutputItem(Strict):
    """A call's result."""
    type: Literal["function_call_output"]
    call_id: Text
    output: text_or(one_of(InputText))
    id: Text | None = None
    status: Status | None = None


InputItem = one_of(InputMessage, FunctionCallItem, FunctionCallOutputItem, default="message")


class FunctionTool(FunctionSpec):
    """A function tool: the chat route's function spec, flat, with its type."""
    type: Literal["function"]


class NamedFunction(Strict):
    type: Literal["function"]
    name: Text


class FormatText(Strict):
    type: Literal["text"]


class FormatJsonObject(Strict):
    type: Literal["json_object"]


class FormatJsonSchema(Strict):
    type: Literal["json_schema"]
    name: Text
    schema_: JSONObject = Field(alias="schema")
    description: Text | None = None
    strict: bool | None = None


class TextConfig(Strict):
    format: one_of(FormatText, FormatJsonObject, FormatJsonSchema) | None = None
    verbosity: Literal["medium"] | None = None  # the API's default; a model cannot be told "low" / "high" here


class StreamOptions(Strict):
    include_obfuscation: bool | None = None  # padding against length side channels: specdec sends none


class ConversationFields(Strict):
    """What a Responses request renders: the conversation, its tools and its output format (also the body of
    ``/v1/responses/input_tokens``)."""
    model: Text | None = None
    input: text_or(InputItem) | None = None
    instructions: Text | None = None
    previous_response_id: Text | None = None
    tools: list[one_of(FunctionTool)] | None = None  # hosted tools (web search, ...): refused
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    # ignored: a model without a reasoning mode; "auto" truncation (a conversation that does not fit is still a 400)
    reasoning: JSONObject | None = None
    truncation: Literal["auto", "disabled"] | None = None

    @property
    def ignored_fields(self) -> list:
        """The fields given that ask for something specdec does not do (and that cannot change the answer)."""
        given = {name: getattr(self, name) for name in self.model_fields_set}
        return sorted(name for name, asks in IGNORED.items() if given.get(name) is not None and asks(given[name]))


class ResponsesRequest(ConversationFields, Extensions):
    max_output_tokens: int | None = None  # its range is the decoder's (one place)
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None  # None: 1.0, as the API
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    store: bool | None = None  # None: stored, as the API (for previous_response_id)
    metadata: dict[Text, Text] | None = None  # echoed in the answer
    include: list[Text] | None = None  # extra data on hosted tools / reasoning (none here); logprobs: refused
    # llama-server's: a stream reports the prompt's reading (``prompt_progress`` on ``response.in_progress`` events)
    # and carries the timings so far on each text delta
    return_progress: bool = False
    timings_per_token: bool = False

    @field_validator("include")
    @classmethod
    def _no_logprobs(cls, value):
        if value and LOGPROBS_INCLUDE in value:
            raise ValueError(f"{LOGPROBS_INCLUDE} is not served on this route (/v1/chat/completions serves logprobs)")
        return value

    # accepted and ignored (identify the caller, or choose among hosted tiers and caches specdec does not have)
    user: Text | None = None
    safety_identifier: Text | None = None
    prompt_cache_key: Text | None = None
    prompt_cache_retention: Text | None = None
    service_tier: Text | None = None
    background: Literal[False] | None = None  # specdec answers in the foreground only


class InputTokensRequest(ConversationFields):
    """``POST /v1/responses/input_tokens``: the conversation's token count, as rendered for the model."""


# field -> whether its value asks for something specdec does not do (the answer lists those fields)
IGNORED = {"reasoning": bool, "truncation": lambda value: value == "auto", "include": bool,
           "stream_options": lambda value: bool(value.include_obfuscation), "user": bool, "safety_identifier": bool,
           "prompt_cache_key": bool, "prompt_cache_retention": bool, "service_tier": bool}
