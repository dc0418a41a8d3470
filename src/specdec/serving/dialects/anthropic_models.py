"""Anthropic's Messages API request bodies (``POST /v1/messages``, ``POST /v1/messages/count_tokens``), as strict
pydantic models.

Served: ``system`` (a string or text blocks), ``messages`` (roles user / assistant / system; content a string or
``text``, ``tool_use`` and ``tool_result`` blocks), ``tools`` with ``input_schema``, ``tool_choice`` (auto / any /
tool / none, ``disable_parallel_tool_use``), ``stop_sequences``, ``max_tokens`` (required), ``temperature`` /
``top_p`` / ``top_k`` (which the SDK sends through ``extra_body``), ``output_config.format`` (a JSON schema),
``stream``, and specdec's extensions. Accepted and ignored, listed in the answer's ``specdec.ignored_fields``:
``metadata``, ``service_tier``, ``cache_control`` (prompt caching is automatic and exact here), ``thinking`` (the
model has no thinking mode: no thinking blocks come back) and ``output_config.effort``. Anything else is a 400
naming the field, as is every text (or string inside a JSON value) that is not encodable.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator

from specdec.serving.wire import Extensions, JSONObject, Strict, Text, check_stops, one_of, text_or


class CacheControl(Strict):
    """A prompt-cache breakpoint: specdec reuses every cached prefix without being asked (exactly), so it is ignored."""
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(Strict):
    type: Literal["text"]
    text: Text
    cache_control: CacheControl | None = None
    citations: list[JSONObject] | None = None  # an earlier answer's block as the SDK echoes it (none are made here)


class ToolUseBlock(Strict):
    """A call the model made (an earlier answer's block)."""
    type: Literal["tool_use"]
    id: Text
    name: Text
    input: JSONObject
    cache_control: CacheControl | None = None
    # what the SDK echoes back from its own ToolUseBlock (who called the tool, a toolset's name): nothing to render
    caller: JSONObject | None = None
    toolset_name: Text | None = None


class ThinkingBlock(Strict):
    """An earlier answer's reasoning, as a client sends its history back: the assistant message's
    ``reasoning_content``, which templates that render reasoning (Qwen3's <think>) write and others leave out."""
    type: Literal["thinking"]
    thinking: Text
    signature: Text | None = None  # Anthropic's integrity signature: nothing here checks or makes one
    cache_control: CacheControl | None = None


class RedactedThinkingBlock(Strict):
    """Reasoning Anthropic's API encrypted: nothing to render."""
    type: Literal["redacted_thinking"]
    data: Text


class ToolResultBlock(Strict):
    type: Literal["tool_result"]
    tool_use_id: Text
    content: text_or(one_of(TextBlock)) | None = None
    is_error: bool | None = None  # rendered as an "Error: " before the result
    cache_control: CacheControl | None = None


class Message(Strict):
    role: Literal["user", "assistant", "system"]
    content: text_or(one_of(TextBlock, ToolUseBlock, ToolResultBlock, ThinkingBlock, RedactedThinkingBlock))


class Tool(Strict):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")]
    description: Text | None = None
    input_schema: JSONObject
    type: Literal["custom"] | None = None
    strict: bool | None = None  # a required call follows the schema anyway (constrained decoding)
    cache_control: CacheControl | None = None


class _Parallel(Strict):
    disable_parallel_tool_use: bool | None = None  # a required call is exactly one call


class ChooseAuto(_Parallel):
    type: Literal["auto"]


class ChooseAny(_Parallel):
    type: Literal["any"]


class ChooseTool(_Parallel):
    type: Literal["tool"]
    name: Text


class ChooseNone(Strict):
    type: Literal["none"]


class JsonOutputFormat(Strict):
    type: Literal["json_schema"]
    schema_: JSONObject = Field(alias="schema")


class OutputConfig(Strict):
    format: JsonOutputFormat | None = None
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None  # ignored: no reasoning mode


class Metadata(Strict):
    user_id: Text | None = None


class CountTokensRequest(Strict):
    """``POST /v1/messages/count_tokens``: what a request renders (the conversation, its tools)."""
    model: Text | None = None  # as llama-server: optional, any name is the served model
    messages: Annotated[list[Message], Field(min_length=1)]
    system: text_or(one_of(TextBlock)) | None = None
    tools: list[Tool] | None = None
    tool_choice: one_of(ChooseAuto, ChooseAny, ChooseTool, ChooseNone) | None = None
    output_config: OutputConfig | None = None
    thinking: JSONObject | None = None
    cache_control: CacheControl | None = None

    @property
    def ignored_fields(self) -> list:
        """The fields given that ask for something specdec does not do (and that cannot change the answer)."""
        given = self.model_fields_set
        ignored = [name for name in ("metadata", "service_tier", "cache_control")
                   if name in given and getattr(self, name, None) is not None]
        if self.thinking and self.thinking.get("type") != "disabled":
            ignored.append("thinking")
        if self.output_config is not None and self.output_config.effort is not None:
            ignored.append("output_config.effort")
        return sorted(ignored)


class MessagesRequest(CountTokensRequest, Extensions):
    max_tokens: int  # required, as the API; its range is the decoder's (0: a warm-up, as the API)
    stop_sequences: list[Text] | None = None
    stream: bool | None = None
    temperature: Annotated[float, Field(ge=0.0, le=1.0)] | None = None  # None: 1.0, as the API
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None

    @field_validator("stop_sequences")
    @classmethod
    def _stop_strings(cls, value):
        return check_stops(value)
