"""Draft/target compatibility, checked at export: the same tokenizer in what it does, the same usable vocabulary,
the same special tokens.

Speculative acceptance compares the two models' distributions token id by token id, so any difference in the
vocabulary silently breaks exactness. Tokenizers are compared by what they do, not by the layout of their JSON:
the vocabulary (every id's token), the added and special tokens, the BPE merges, and the ids and text a probe
corpus (code, prose, whitespace runs, CJK, emoji, special-token text) encodes to and decodes back to; a GGUF-derived
tokenizer and a Hugging Face folder's of the same model agree though their JSON differs. The usable vocabulary
is the tokenizer's: a model whose embedding is padded beyond it (Qwen2.5 7B-32B: 152,064 rows for 151,665
tokens) pairs with one that is not, and the padded rows are dropped at export (never sampled). A mismatch is
refused with a message that names the first difference found. The tokenizers and the configs are checked before
either model is exported (``check_tokenizers``, ``check_pair_facts``); the exported graphs are checked again
afterwards (``check_specs``).
"""

from __future__ import annotations

import json
import re


class IncompatiblePair(ValueError):
    pass


def tokenizer_json(tokenizer) -> dict:
    return json.loads(tokenizer.backend_tokenizer.to_str())


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


_PADDING = re.compile(r"\[PAD(\d+)\]")


def tokenizer_size(tokenizer) -> int:
    """The ids that are tokens: ``len(tokenizer)`` without the ``[PAD<id>]`` placeholders a GGUF's tokenizer carries
    for the table rows no token fills (llama.cpp's convert_hf_to_gguf.py writes them), so a GGUF's tokenizer and
    the Hugging Face folder's it came from have one size."""
    size = len(tokenizer)
    while size and _PADDING.fullmatch(tokenizer.convert_ids_to_tokens(size - 1) or "") and \
            _PADDING.fullmatch(tokenizer.convert_ids_to_tokens(size - 1)).group(1) == str(size - 1):
        size -= 1
    return size


def pair_facts(config, generation_config, tokenizer) -> dict:
    """What draft and target must agree on, from configs and tokenizer: the usable vocabulary (the table's rows, or
    the tokenizer's size when the table is padded beyond it), the table's rows, and the special ids."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    rows = getattr(text, "vocab_size", None)
    usable = min(rows, tokenizer_size(tokenizer)) if rows else None
    return {"vocab_size": usable, "table_rows": rows, **special_token_ids_from(generation_config, config, tokenizer)}


def check_pair_facts(target: dict, draft: dict) -> list:
    """Raise IncompatiblePair when the two models' usable vocabularies differ (before any export). Returns notes on
    the special ids that differ: the bundle takes the target's for both models (what ends target-only decoding
    ends speculation too; a draft's end tokens only stop its proposals early), as a Hugging Face folder's
    generation config lists two end tokens where a GGUF of the same family records one."""
    if target["vocab_size"] and draft["vocab_size"] and target["vocab_size"] != draft["vocab_size"]:
        raise IncompatiblePair(
            f"draft and target vocabularies differ: the target scores {target['vocab_size']} tokens (vocab_size "
            f"{target.get('table_rows')}), the draft {draft['vocab_size']} (vocab_size {draft.get('table_rows')})"
        )
    return [f"the draft's {key} {draft[key]} differs from the target's {target[key]}: the bundle uses the target's"
            for key in ("bos_token_id", "eos_token_ids", "pad_token_id") if target[key] != draft[key]]


# What the behaviour check encodes and decodes: code, prose, whitespace runs, digits, CJK, emoji, control and
# special-token text (the added tokens are probed separately), mixed case, a byte-level fallback character.
PROBE_TEXTS = (
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "The quick brown fox jumps over the lazy dog. It's 3.14159, isn't it? Yes -- 42%!",
    "\t\t  indented   spaces\n\n\r\n  trailing  ", "1234567890 0x1F 1e-9 3,141,592",
    "中文字符 日本語のテキスト 한국어 텍스트", "emoji 😀🚀✨ accents àéîõü ß Æ ø",
    "CamelCase snake_case kebab-case SCREAMING_CASE", "<html><body class=\"x\">&amp;</body></html>",
    "\u0000\u001f\u007f\ufeff zero-width\u200bjoiner",
)


def _vocabulary_difference(target, draft) -> str | None:
    size = max(tokenizer_size(target), tokenizer_size(draft))  # the [PAD] placeholders aside
    by_id_target = {index: token for token, index in target.get_vocab().items() if index < size}
    by_id_draft = {index: token for token, index in draft.get_vocab().items() if index < size}
    for index in sorted(set(by_id_target) | set(by_id_draft)):
        a, b = by_id_target.get(index), by_id_draft.get(index)
        if a != b:
            return f"token id {index}: {a!r} in the target, {b!r} in the draft"
    return None


def _added_difference(target, draft) -> str | None:
    a, b = target.backend_tokenizer.get_added_tokens_decoder(), draft.backend_tokenizer.get_added_tokens_decoder()
    for index in sorted(set(a) | set(b)):
        x, y = a.get(index), b.get(index)
        if x is None or y is None or x.content != y.content or bool(x.special) != bool(y.special):
            describe = lambda t: "absent" if t is None else f"{t.content!r}{' (special)' if t.special else ''}"  # noqa: E731
            return f"added token {index}: {describe(x)} in the target, {describe(y)} in the draft"
    return None


def _merges_difference(target, draft) -> str | None:
    a = tokenizer_json(target).get("model", {}) or {}
    b = tokenizer_json(draft).get("model", {}) or {}
    if a.get("type") != b.get("type"):
        return f"tokenizer model: {a.get('type')} in the target, {b.get('type')} in the draft"
    merges_a, merges_b = a.get("merges") or [], b.get("merges") or []
    norm = lambda merge: merge if isinstance(merge, str) else " ".join(merge)  # noqa: E731  (old and new layouts)
    for index, (x, y) in enumerate(zip(merges_a, merges_b)):
        if norm(x) != norm(y):
            return f"BPE merge {index}: {norm(x)!r} in the target, {norm(y)!r} in the draft"
    if len(merges_a) != len(merges_b):
        return f"BPE merges: {len(merges_a)} in the target, {len(merges_b)} in the draft"
    return None


def _behaviour_difference(target, draft) -> str | None:
    a, b = target.backend_tokenizer, draft.backend_tokenizer
    probes = list(PROBE_TEXTS) + [token.content for token in a.get_added_tokens_decoder().values()]
    for text in probes:
        ids_a, ids_b = a.encode(text, add_special_tokens=False).ids, b.encode(text, add_special_tokens=False).ids
        if ids_a != ids_b:
            at = next((i for i, (x, y) in enumerate(zip(ids_a, ids_b)) if x != y), min(len(ids_a), len(ids_b)))
            first = (a.id_to_token(ids_a[at]) if at < len(ids_a) else "end", b.id_to_token(ids_b[at])
                     if at < len(ids_b) else "end")
            return f"encoding {text[:40]!r}: token {at} is {first[0]!r} in the target, {first[1]!r} in the draft"
        if a.decode(ids_a, skip_special_tokens=False) != b.decode(ids_b, skip_special_tokens=False):
            return f"decoding {text[:40]!r}: the two tokenizers give different text back"
    return None


def check_tokenizers(target_tokenizer, draft_tokenizer) -> None:
    """Raise IncompatiblePair naming the first place where the two tokenizers differ in what they do."""
    for check in (_vocabulary_difference, _added_difference, _merges_difference, _behaviour_difference):
        difference = check(target_tokenizer, draft_tokenizer)
        if difference:
            raise IncompatiblePair(f"draft and target tokenizers differ: {difference}")


def check_specs(target, draft):
    """The draft's ModelSpec with the target's special ids (``check_pair_facts``); IncompatiblePair when the exported
    models score different vocabularies."""
    from dataclasses import replace

    if target.vocab_size != draft.vocab_size:
        raise IncompatiblePair(
            f"draft and target vocabularies differ: target has {target.vocab_size} logits, draft {draft.vocab_size}"
        )
    return replace(draft, bos_token_id=target.bos_token_id, eos_token_ids=target.eos_token_ids,
                   pad_token_id=target.pad_token_id)
