"""llama-server's native request bodies (``/completion``, ``/infill``, ``/tokenize``, ``/detokenize``, slot actions).

The fields specdec reads are typed strictly (a wrong type or range is a 400 naming the field); other fields
llama.cpp knows (``samplers``, ``n_indent``, ``mirostat``, an ``input_extra`` chunk's ``time`` ...) are tolerated
and listed in the answer's ``specdec.ignored_fields``, as llama-server ignores what it does not know. ``/completion``
and ``/infill`` share their generation fields (``LlamaGeneration``), typed the same way. Aliases are llama-server's:
``n_predict`` is also ``max_tokens`` / ``max_completion_tokens``, ``n_probs`` is also ``logprobs``.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import ConfigDict, Field, field_validator

from specdec.contract.limits import MAX_DRAFT_TOKENS, MAX_SEED, MAX_TOP_LOGPROBS
from specdec.serving.dialects.openai_models import ProposerName
from specdec.serving.wire import LogitBias, StopStrings, WireModel

Budget = Annotated[int, Field(ge=-1)]  # -1: until EOS or the context is full; 0: prefill only (a warm-up)
TokenId = Annotated[int, Field(ge=0)]


class LlamaBody(WireModel):
    """A llama-server body: unknown fields are kept aside (``ignored_fields``), known ones typed strictly."""
    model_config = ConfigDict(extra="allow", strict=True)

    @property
    def ignored_fields(self) -> list:
        return sorted(self.model_extra or ())


class LlamaGeneration(LlamaBody):
    """The generation fields ``/completion`` and ``/infill`` share (llama.cpp's defaults)."""
    n_predict: Budget = -1
    max_tokens: Budget | None = None  # llama-server's aliases of n_predict
    max_completion_tokens: Budget | None = None
    t_max_predict_ms: Annotated[int, Field(ge=-1)] = 0  # stop once this long after the first token and a newline
    cache_prompt: bool = True
    stop: StopStrings = []
    stream: bool = False
    temperature: Annotated[float, Field(ge=0.0)] = 0.8
    top_k: Annotated[int, Field(ge=0)] = 40
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 0.95
    min_p: Annotated[float, Field(ge=0.0, lt=1.0)] = 0.05
    repeat_penalty: Annotated[float, Field(gt=0.0, le=10.0)] = 1.0
    # {token id or text: bias} or [[token id or text, bias], ...]; false: never (text: each of its tokens)
    logit_bias: LogitBias = None
    seed: Annotated[int, Field(ge=-1, le=MAX_SEED)] = -1  # -1: fresh randomness
    n_probs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] = 0  # alternatives per token (completion_probabilities)
    logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None  # llama-server's alias of n_probs
    id_slot: Annotated[int, Field(ge=-1)] = -1  # the slot (worker) to run on; -1: the server chooses
    return_tokens: bool = False  # the answer's "tokens": the generated ids
    return_progress: bool = False  # a stream reports the prompt's reading (``prompt_progress``) before the first token
    response_fields: list[str] | None = None  # only these fields of the answer ("timings/prompt_n" unnests)
    n_cmpl: int = 1
    n: int = 1  # llama-server's alias of n_cmpl
    model: str | None = None
    # specdec extensions
    num_draft_tokens: Annotated[int, Field(ge=0, le=MAX_DRAFT_TOKENS)] | Literal["auto"] = "auto"
    proposer: ProposerName | None = None
    grammar: str | None = None  # GBNF
    json_schema: dict | None = None

    @field_validator("n_cmpl", "n")
    @classmethod
    def _one_completion(cls, value):
        if value != 1:
            raise ValueError("only 1 completion per request")
        return value

    def budget(self) -> tuple[str, int]:
        """(the field the client gave the token budget in, its value): n_predict, else an alias."""
        for name in ("n_predict", "max_tokens", "max_completion_tokens"):
            if name in self.model_fields_set and getattr(self, name) is not None:
                return name, getattr(self, name)
        return "n_predict", self.n_predict

    def top_alternatives(self) -> tuple[str, int]:
        """(the field giving the alternatives per token, its value): n_probs, else its alias logprobs."""
        if "n_probs" not in self.model_fields_set and self.logprobs is not None:
            return "logprobs", self.logprobs
        return "n_probs", self.n_probs


class InfillChunk(LlamaBody):
    """One ``input_extra`` chunk (``text`` required, as llama-server has it); other keys (llama.vim's ``time``) are
    tolerated as llama-server does."""
    filename: str = "tmp"
    text: str


class InfillRequest(LlamaGeneration):
    """``POST /infill``: the code before and after the cursor, other files, and the text that continues the prefix."""
    input_prefix: str = ""
    input_suffix: str = ""
    input_extra: list[InfillChunk] = []
    prompt: str = ""  # text after the prefix, inside the FIM frame (llama.cpp's layout)

    @property
    def ignored_fields(self) -> list:
        chunks = {f"input_extra.{key}" for chunk in self.input_extra for key in chunk.ignored_fields}
        return sorted(set(super().ignored_fields) | chunks)


MAX_PROMPTS = 16  # prompts of one batched /completion request (run one after another)


class CompletionRequest(LlamaGeneration):
    """``POST /completion`` (and ``/completions``): a text prompt, token ids, or a list mixing both; or several
    prompts, as llama-server takes them: a list of strings, or a list whose items are token lists or strings."""
    prompt: str | dict | list[TokenId | str | dict | list[TokenId | str]]

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, value):
        value = _json_prompt(value) if isinstance(value, dict) else value
        if isinstance(value, list):
            value = [_json_prompt(part) if isinstance(part, dict) else part for part in value]
            if not value:
                raise ValueError("is empty: give some text or token ids")
            if any(isinstance(part, list) for part in value):
                if not all(isinstance(part, (list, str)) for part in value):
                    raise ValueError("mixes token ids with prompts: several prompts are each a list of token ids "
                                     "or a string")
                if any(not part for part in value):
                    raise ValueError("holds an empty prompt: give some text or token ids")
            if len(value) > MAX_PROMPTS and cls.is_batch(value):
                raise ValueError(f"holds {len(value)} prompts: at most {MAX_PROMPTS} per request")
        return value

    @staticmethod
    def is_batch(value) -> bool:
        """Several prompts: a list of two or more strings, or a list holding token lists (llama-server's reading)."""
        return isinstance(value, list) and (any(isinstance(part, list) for part in value) or (
            len(value) > 1 and all(isinstance(part, str) for part in value)))

    def prompts(self) -> list | None:
        """The prompts of a batched request, each one prompt as ``prompt`` takes it; None for one prompt."""
        return list(self.prompt) if self.is_batch(self.prompt) else None


def _json_prompt(value: dict) -> str:
    """llama-server's JSON prompt object, ``{"prompt_string": TEXT, "multimodal_data": [...]}``, as its text; media
    need a multimodal model, which no bundle holds."""
    unknown = sorted(set(value) - {"prompt_string", "multimodal_data"})
    if unknown:
        raise ValueError(f"a JSON prompt holds prompt_string (and multimodal_data), not {', '.join(unknown)}")
    if not isinstance(value.get("prompt_string"), str):
        raise ValueError("a JSON prompt needs prompt_string, a string")
    if value.get("multimodal_data"):
        raise ValueError("multimodal_data: images and audio need a multimodal model, and this server's has none")
    return value["prompt_string"]


class TokenizeRequest(LlamaBody):
    """``POST /tokenize``."""
    content: str | list[TokenId | str] = ""
    add_special: bool = False  # the tokenizer's BOS (before a first part that is text)
    parse_special: bool = True  # special tokens written in the text are those tokens (False: plain text)
    with_pieces: bool = False  # each id with its text (or its bytes when they are not UTF-8)


class DetokenizeRequest(LlamaBody):
    """``POST /detokenize``."""
    tokens: list[TokenId] = []


class SlotFileRequest(LlamaBody):
    """``POST /slots/{id}?action=save|restore``: the file, a name inside ``--slot-save-path``."""
    filename: str | None = None
