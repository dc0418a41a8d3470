"""OpenAI's request bodies (chat completions, completions), as strict pydantic models.

Bounds come from the limits table (contract/limits.py); what a combination of fields means is the decoder's
to check (wire.py). The specdec extensions (``num_draft_tokens``, ``proposer``, ``tree``, ``top_k``, ``min_p``,
``repetition_penalty``, ``token_sources``) and llama-server's ``grammar`` / ``json_schema`` are accepted
beside OpenAI's fields.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator

from specdec.contract.limits import MAX_TOP_LOGPROBS
from specdec.serving.wire import (Extensions, JSONObject, ProposerName, StopStrings, Strict,  # noqa: F401 (ProposerName:
                                  Text)  # llama's)


class StreamOptions(Strict):
    include_usage: bool = False


class JsonSchemaFormat(Strict):
    name: str = "response"
    description: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(Strict):
    """OpenAI's ``response_format``: "text", "json_object" (any JSON object) or "json_schema" (strict)."""
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None
    schema_: dict | None = Field(default=None, alias="schema")  # vLLM / llama-server's shorthand for json_object


class _GenerationFields(Extensions):
    model: str | None = None  # llama-server does not require it: any name, or none, is the served model
    max_tokens: int | None = None  # its range is the decoder's (make_request): one place
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0  # OpenAI's default (0 = greedy)
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: StopStrings | None = None
    user: str | None = None  # accepted and ignored, as by other local servers
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # specdec extensions (beside Extensions': top_k, min_p, repetition_penalty, seed, num_draft_tokens, proposer, tree):
    # the answer's text split by the proposer of its tokens (each chunk's / the answer's specdec.sources): the web
    # page's colours; ignored with tool-call parsing (the content is then not the decoded text)
    token_sources: bool = False
    # constrained output: OpenAI's response_format; llama-server's grammar (GBNF) and json_schema
    response_format: ResponseFormat | None = None
    grammar: str | None = None
    json_schema: dict | None = None

    @field_validator("n")
    @classmethod
    def _one_choice(cls, value):
        if value != 1:
            raise ValueError("only n=1 is supported here")
        return value

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, value):
        if value != 0:
            raise ValueError("only 0 is supported (use repetition_penalty)")
        return value


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


class TextPart(Strict):
    type: Literal["text"]
    text: str


class FunctionCall(Strict):
    name: str
    arguments: str  # JSON text


class ToolCallMessage(Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallMessage] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool result: the call it answers
    # an assistant's earlier reasoning (DeepSeek's and llama-server's field), for templates that render it (Qwen3's
    # <think> blocks); a template that does not read it leaves it out
    reasoning_content: Text | None = None


class FunctionSpec(Strict):
    """A function the model may call (the chat route's ``tools[].function``, the Responses API's flat tool)."""
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")]
    description: Text | None = None
    parameters: JSONObject | None = None
    strict: bool | None = None


class ToolSpec(Strict):
    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: NamedFunction


MAX_CHOICES = 8  # n on the chat route: the choices run one after another (each reuses the prompt's cache)


class ChatCompletionRequest(_GenerationFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] = 1  # several choices: not streamed
    id_slot: Annotated[int, Field(ge=-1)] = -1  # llama-server's: the worker (slot) to run on; -1: any

    @field_validator("n")
    @classmethod
    def _one_choice(cls, value):  # replaces the completions' n=1 check: the bounds above apply
        return value
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    # vLLM's and llama-server's: continue a final assistant message (default: when the conversation ends with one)
    continue_final_message: bool | None = None
    add_generation_prompt: bool | None = None  # end with the assistant's header (default: unless continuing)
    # llama-server's: every streamed chunk carries ``timings`` so far; the last chunks carry them whether asked or not
    timings_per_token: bool = False
    # llama-server's: a stream's chunks report the prompt's reading (``prompt_progress``) before the first token
    return_progress: bool = False
    # llama-server's: a non-streamed answer carries ``__verbose`` (the rendered prompt, the answer); None: the
    # server's --verbose
    verbose: bool | None = None
