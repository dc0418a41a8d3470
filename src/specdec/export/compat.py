"""Draft/target compatibility, checked at export: same vocabulary, identical tokenizer, same special tokens.

Speculative acceptance compares the two models' distributions token id by token id, so
any difference in the vocabulary silently breaks exactness. A mismatch is refused with a
message that names the first difference found. The tokenizers and the configs (vocabulary
size, special tokens) are checked before either model is exported (``check_tokenizers``,
``check_pair_facts``); the exported graphs are checked again afterwards (``check_specs``).
"""

from __future__ import annotations

import json


class IncompatiblePair(ValueError):
    pass


# Parts of tokenizer.json that decide how text maps to ids and back. The chat template lives
# elsewhere (tokenizer_config.json), so differing templates are allowed, as for the Qwen pair.
_TOKENIZER_PARTS = ("model", "added_tokens", "normalizer", "pre_tokenizer", "post_processor", "decoder")


def tokenizer_json(tokenizer) -> dict:
    return json.loads(tokenizer.backend_tokenizer.to_str())


def _first_difference(a, b, path: str) -> str | None:
    if type(a) is not type(b):
        return f"{path}: {type(a).__name__} vs {type(b).__name__}"
    if isinstance(a, dict):
        for key in sorted(set(a) | set(b)):
            if key not in a or key not in b:
                return f"{path}.{key}: present in only one"
            found = _first_difference(a[key], b[key], f"{path}.{key}")
            if found:
                return found
        return None
    if isinstance(a, list):
        if len(a) != len(b):
            return f"{path}: {len(a)} vs {len(b)} entries"
        for index, (x, y) in enumerate(zip(a, b)):
            found = _first_difference(x, y, f"{path}[{index}]")
            if found:
                return found
        return None
    return None if a == b else f"{path}: {str(a)[:60]!r} vs {str(b)[:60]!r}"


def special_token_ids(model, tokenizer) -> dict:
    """bos / eos (all of them) / pad ids, merged from the model config, generation config and tokenizer."""
    return special_token_ids_from(getattr(model, "generation_config", None), model.config, tokenizer)


def special_token_ids_from(generation_config, config, tokenizer) -> dict:
    """``special_token_ids`` from the configs alone (before any model is loaded)."""
    eos = set()
    for source in (generation_config, config, tokenizer):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(value, int):
            eos.add(value)
        elif isinstance(value, (list, tuple)):
            eos.update(int(v) for v in value)
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        bos = getattr(config, "bos_token_id", None)
    pad = getattr(tokenizer, "pad_token_id", None)
    return {"bos_token_id": bos, "eos_token_ids": tuple(sorted(eos)), "pad_token_id": pad}


def pair_facts(config, generation_config, tokenizer) -> dict:
    """What draft and target must agree on, from configs and tokenizer: vocab_size and the special ids."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return {"vocab_size": getattr(text, "vocab_size", None),
            **special_token_ids_from(generation_config, config, tokenizer)}


def check_pair_facts(target: dict, draft: dict) -> None:
    """Raise IncompatiblePair when ``pair_facts`` of the two models disagree (before any export)."""
    if target["vocab_size"] and draft["vocab_size"] and target["vocab_size"] != draft["vocab_size"]:
        raise IncompatiblePair(
            f"draft and target vocabularies differ: the target config has vocab_size {target['vocab_size']}, "
            f"the draft {draft['vocab_size']}"
        )
    for key in ("bos_token_id", "eos_token_ids", "pad_token_id"):
        if target[key] != draft[key]:
            raise IncompatiblePair(
                f"draft and target special tokens differ: {key} is {target[key]} for the target, "
                f"{draft[key]} for the draft"
            )


def check_tokenizers(target_tokenizer, draft_tokenizer) -> None:
    """Raise IncompatiblePair naming the first difference between the two tokenizers."""
    target_json, draft_json = tokenizer_json(target_tokenizer), tokenizer_json(draft_tokenizer)
    for part in _TOKENIZER_PARTS:
        difference = _first_difference(target_json.get(part), draft_json.get(part), f"tokenizer.{part}")
        if difference:
            raise IncompatiblePair(f"draft and target tokenizers differ at {difference}")


def check_specs(target, draft) -> None:
    """Raise IncompatiblePair when the exported models disagree on vocabulary or special tokens (ModelSpecs)."""
    if target.vocab_size != draft.vocab_size:
        raise IncompatiblePair(
            f"draft and target vocabularies differ: target has {target.vocab_size} logits, draft {draft.vocab_size}"
        )
    for key in ("bos_token_id", "eos_token_ids", "pad_token_id"):
        if getattr(target, key) != getattr(draft, key):
            raise IncompatiblePair(
                f"draft and target special tokens differ: {key} is {getattr(target, key)} for the target, "
                f"{getattr(draft, key)} for the draft"
            )
