"""Fill-in-the-middle tokens: one row per tokenizer family, found by their text in the vocabulary.

The exporter records the ids it finds in the manifest (``Manifest.fim_tokens``); a bundle written
before that field is read the same way from its tokenizer at load. Roles:

  prefix, suffix, middle   the PSM markers: [prefix]PRE[suffix]SUF[middle] -> the model writes the middle
  repo, file_sep           repository-level context (Qwen2.5-Coder, StarCoder2): [repo]name, [file_sep]path\\ntext
  pad, end                 tokens that end a middle (with the model's EOS): padding, end of text
"""

from __future__ import annotations

FIM_ROLES = ("prefix", "suffix", "middle", "repo", "file_sep", "pad", "end")
REQUIRED = ("prefix", "suffix", "middle")

# role -> token text, per family (first match wins)
FIM_FAMILIES = (
    # Qwen2.5-Coder (and CodeGemma's PSM markers)
    {"prefix": "<|fim_prefix|>", "suffix": "<|fim_suffix|>", "middle": "<|fim_middle|>", "repo": "<|repo_name|>",
     "file_sep": "<|file_sep|>", "pad": "<|fim_pad|>", "end": "<|endoftext|>"},
    # StarCoder / StarCoder2 / SantaCoder
    {"prefix": "<fim_prefix>", "suffix": "<fim_suffix>", "middle": "<fim_middle>", "repo": "<reponame>",
     "file_sep": "<file_sep>", "pad": "<fim_pad>", "end": "<|endoftext|>"},
    # DeepSeek-Coder
    {"prefix": "<｜fim▁begin｜>", "suffix": "<｜fim▁hole｜>", "middle": "<｜fim▁end｜>", "end": "<｜end▁of▁sentence｜>"},
    # CodeLlama
    {"prefix": "▁<PRE>", "suffix": "▁<SUF>", "middle": "▁<MID>", "end": "▁<EOT>"},
)


def find_fim_tokens(token_to_id) -> dict:
    """{role: id} of the first family whose PSM markers are all in the vocabulary (``token_to_id(text) -> id | None``);
    {} when none is."""
    for family in FIM_FAMILIES:
        ids = {role: token_to_id(text) for role, text in family.items()}
        if all(ids[role] is not None for role in REQUIRED):
            return {role: int(i) for role, i in ids.items() if i is not None}
    return {}
