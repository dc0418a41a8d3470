"""llama-server's routes that generate nothing: ``GET /props``, ``POST /tokenize``, ``POST /detokenize``.

``/tokenize`` takes text or a list mixing token ids and text (``add_special``: the BOS before a first part that is
text; ``parse_special``: special tokens written in the text are those tokens) and answers ``{"tokens": [...]}``, or
with ``with_pieces`` ``[{"id", "piece"}]`` where a piece that is not valid UTF-8 (part of a character) is its list of
bytes. ``/detokenize`` answers ``{"content": ...}`` with special tokens' text kept, as llama-server does. Token ids
outside the vocabulary are a 400 naming the entry. Tokenizing runs on the event loop's thread pool, never a worker.
"""

from __future__ import annotations

import asyncio

from specdec.serving.dialects.llama_models import DetokenizeRequest, TokenizeRequest
from specdec.serving.jobs import Engine
from specdec.serving.wire import APIError


def check_ids(ids, vocab: int, field: str) -> None:
    for index, token in enumerate(ids):
        if not isinstance(token, str) and token >= vocab:
            raise APIError(400, f"{field}.{index}: token id {token} is not in this model's vocabulary "
                                f"(0..{vocab - 1})", param=f"{field}.{index}")


def build_info() -> str:
    from importlib import metadata

    try:
        return f"specdec {metadata.version('specdec')}"
    except metadata.PackageNotFoundError:  # run from a source tree without installing
        return "specdec (not installed)"


def token_text(codec, token_id: int | None) -> str:
    return "" if token_id is None else codec.piece_bytes(token_id).decode("utf-8", errors="replace")


class TokenRoutes:
    """``POST /tokenize`` and ``POST /detokenize``."""

    def __init__(self, engine: Engine):
        self.engine = engine

    @property
    def codec(self):
        return self.engine.codec

    @property
    def vocab(self) -> int:
        return self.engine.decoder.manifest.target.vocab_size

    async def tokenize(self, body: TokenizeRequest):
        content = body.content
        if not isinstance(content, str):
            check_ids(content, self.vocab, "content")
        ids = await asyncio.to_thread(self.codec.encode_mixed, content, body.add_special, body.parse_special)
        if not body.with_pieces:
            return {"tokens": ids}
        pieces = []
        for token in ids:
            data = self.codec.piece_bytes(token)
            try:
                piece = data.decode("utf-8")
            except UnicodeDecodeError:  # part of a character: its bytes, as llama-server sends them
                piece = list(data)
            pieces.append({"id": token, "piece": piece})
        return {"tokens": pieces}

    async def detokenize(self, body: DetokenizeRequest):
        check_ids(body.tokens, self.vocab, "tokens")
        return {"content": await asyncio.to_thread(self.codec.decode, body.tokens, False)}


class Props:
    """``GET /props``: llama-server's server properties (``default_generation_settings``, ``total_slots``,
    ``model_alias``, ``chat_template``, ``bos_token``, ``eos_token``, ``build_info``, ``endpoint_slots`` ...) and
    specdec's own (``specdec``: the KV caches, the RAM prompt cache, the proposers, whether the bundle has a draft,
    the slot save folder)."""

    def __init__(self, engine: Engine, server):
        self.engine, self.server = engine, server

    async def get(self):
        from specdec.decoding.text.chat import ChatTemplateError, chat_template_of
        from specdec.decoding.proposers import proposer_names
        from specdec.serving.dialects.llama_models import LlamaGeneration

        decoder, pool = self.engine.decoder, self.engine.pool
        try:
            template = chat_template_of(decoder).source
        except ChatTemplateError:
            template = ""
        manifest, codec = decoder.manifest, decoder.codec
        cache = decoder.prompt_cache
        defaults = LlamaGeneration()
        params = {name: getattr(defaults, name) for name in ("n_predict", "temperature", "top_k", "top_p", "min_p",
                                                             "repeat_penalty", "seed", "n_probs", "stream")}
        if self.server.seed is not None:
            params["seed"] = self.server.seed
        eos = sorted(manifest.target.eos_token_ids)
        return {
            "default_generation_settings": {"n_ctx": decoder.max_context, "params": params},
            "total_slots": pool.options.workers, "model_alias": self.server.model_name,
            "model_path": str(decoder.bundle_dir.name), "chat_template": template,
            "modalities": {"vision": False, "video": False, "audio": False},
            "bos_token": token_text(codec, manifest.target.bos_token_id),
            "eos_token": token_text(codec, eos[0] if eos else None),
            "build_info": build_info(),
            "endpoint_slots": self.server.slots_endpoint, "endpoint_props": False, "endpoint_metrics": True,
            "is_sleeping": False,
            "specdec": {
                "max_context": decoder.max_context, "workers": pool.options.workers,
                "has_draft": decoder.draft is not None, "proposers": list(proposer_names()),
                "kv_dtype": {role: spec.kv_dtype for role, spec in manifest.models().items()},
                "quant": {role: spec.quant for role, spec in manifest.models().items()},
                "prompt_cache_mib": round(cache.capacity / 2**20, 1) if cache is not None else 0,
                "suffix_cache_mib": round(decoder.suffix_cache.max_tokens * 4 / 2**20, 1)
                if decoder.suffix_cache is not None else 0,
                "slot_save_path": self.server.slot_save_path is not None,
                "bundle_identity": decoder.identity,
            },
        }


def mount(app, engine: Engine, server) -> None:
    tokens = TokenRoutes(engine)
    app.add_api_route("/tokenize", tokens.tokenize, methods=["POST"])
    app.add_api_route("/detokenize", tokens.detokenize, methods=["POST"])
    app.add_api_route("/props", Props(engine, server).get, methods=["GET"])
