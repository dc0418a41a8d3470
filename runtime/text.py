"""Tokenizer access for the runtime (the ``tokenizers`` library only; no transformers).

The runtime itself works on token ids; text enters and leaves here.
"""

from __future__ import annotations

from pathlib import Path


class TextCodec:
    def __init__(self, tokenizer_json: Path):
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(str(tokenizer_json))

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=True).ids

    def decode(self, ids) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)


class IncrementalDecoder:
    """Text deltas for a growing list of ids, never splitting a multi-byte character.

    Keeps a short window (as text-generation-inference does): decoding is O(window) per
    step, not O(output), so long streams stay cheap.
    """

    def __init__(self, codec: TextCodec):
        self.codec = codec
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def push(self, new_ids) -> str:
        self.ids.extend(int(i) for i in new_ids)
        prefix = self.codec.decode(self.ids[self.prefix_offset : self.read_offset])
        full = self.codec.decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return full[len(prefix) :]
        return ""

    def flush(self) -> str:
        """Whatever is still held back at the end (e.g. an incomplete character)."""
        prefix = self.codec.decode(self.ids[self.prefix_offset : self.read_offset])
        full = self.codec.decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[len(prefix) :]
