"""Fill-in-the-middle prompts, laid out as llama.cpp's server lays them (so an editor plugin sees the same model input):

    [repo]myproject\\n [file_sep]name\\n text ... [file_sep]filename\\n [prefix] prefix prompt [suffix] suffix [middle]

``extra`` chunks (other files the editor sends) come first, then the PSM markers. When the whole does not
fit the context, the prefix keeps its end, the suffix its start (at most a quarter of the room) and the
extra chunks their end, as llama.cpp does. The model's answer is the middle; it ends at EOS or at any of
the family's other markers (contract/fim.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from specdec.contract.fim import find_fim_tokens
from specdec.decoding.request import GenerationError, check_text
from specdec.decoding.text.codec import TextCodec

REPO_NAME = "myproject"  # llama.cpp's fixed project name
CURRENT_FILE = "filename"  # llama.cpp's name for the file being edited
ENDING_ROLES = ("pad", "end", "repo", "file_sep", "prefix", "suffix", "middle")


def fim_tokens(manifest, codec: TextCodec) -> dict:
    """The bundle's FIM ids: from the manifest, or (a bundle exported before it recorded them) its tokenizer."""
    return dict(manifest.fim_tokens) if getattr(manifest, "fim_tokens", None) else find_fim_tokens(codec.token_id)


def fim_stop_ids(fim: dict) -> tuple:
    return tuple(sorted({fim[role] for role in ENDING_ROLES if role in fim}))


def _extra_chunks(extra) -> list:
    if isinstance(extra, (str, bytes)) or not isinstance(extra, Sequence):
        raise GenerationError.bad("extra", "must be a list of {\"filename\": ..., \"text\": ...} chunks")
    chunks = []
    for i, chunk in enumerate(extra):
        if not isinstance(chunk, Mapping) or not set(chunk) <= {"filename", "text"}:
            raise GenerationError.bad(f"extra[{i}]", "must be a {\"filename\": ..., \"text\": ...} object")
        chunks.append((check_text(chunk.get("filename", "tmp"), f"extra[{i}].filename"),
                       check_text(chunk.get("text", ""), f"extra[{i}].text")))
    return chunks


def infill_prompt(codec: TextCodec, fim: dict, prefix: str, suffix: str, extra=(), prompt: str = "",
                  room: int | None = None) -> list:
    """The token ids of a FIM request; ``room``: how many prompt tokens fit (None: no limit)."""
    if not fim:
        raise GenerationError("this bundle's tokenizer has no fill-in-the-middle tokens (e.g. <|fim_prefix|>): "
                              "infill needs a code model trained for it", "prefix")
    prefix_ids = codec.encode(check_text(prefix, "prefix"), special=False)
    suffix_ids = codec.encode(check_text(suffix, "suffix"), special=False)
    prompt_ids = codec.encode(check_text(prompt, "prompt"), special=False) if prompt else []
    extra_ids = []
    if "repo" in fim:
        extra_ids += [fim["repo"]] + codec.encode(f"{REPO_NAME}\n", special=False)
    for filename, text in _extra_chunks(extra):
        if "file_sep" in fim:
            extra_ids += [fim["file_sep"]] + codec.encode(f"{filename}\n", special=False)
        else:
            extra_ids += codec.encode("\n\n--- snippet ---\n\n", special=False)
        extra_ids += codec.encode(text, special=False)
    if "file_sep" in fim:
        extra_ids += [fim["file_sep"]] + codec.encode(f"{CURRENT_FILE}\n", special=False)
    if room is not None:
        room -= 3 + len(prompt_ids)  # the three markers and the prompt are always kept
        if room < 1:
            raise GenerationError.bad("max_new_tokens", "leaves the context no room for this infill request: lower it "
                                                        "or load with a larger max_context")
        suffix_ids = suffix_ids[: min(len(suffix_ids), room // 4)]
        prefix_ids = prefix_ids[len(prefix_ids) - min(len(prefix_ids), room - len(suffix_ids)):]
        keep = max(0, min(len(extra_ids), room - len(prefix_ids) - len(suffix_ids)))
        extra_ids = extra_ids[len(extra_ids) - keep:]
    return extra_ids + [fim["prefix"]] + prefix_ids + prompt_ids + [fim["suffix"]] + suffix_ids + [fim["middle"]]
