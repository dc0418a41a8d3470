"""llama-server's native request bodies (``/infill``), as pydantic models typed strictly where specdec reads them."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from specdec.contract.limits import MAX_DRAFT_TOKENS, MAX_SEED, MAX_TOP_LOGPROBS
from specdec.serving.dialects.openai_models import ProposerName
from specdec.serving.wire import Strict, check_stops


class InfillChunk(Strict):
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
    proposer: ProposerName | None = None
    grammar: str | None = None  # GBNF
    json_schema: dict | None = None
    n_probs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] = 0  # alternatives per token in completion_probabilities

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, value):
        return check_stops(value)

    @property
    def ignored_fields(self) -> list:
        return sorted(self.model_extra or ())
