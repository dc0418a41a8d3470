"""Tokenizer access for the runtime (the ``tokenizers`` library only; no transformers).

The runtime itself works on token ids; text enters and leaves here.
"""

from __future__ import annotations

import threading
from pathlib import Path


class TextCodec:
    def __init__(self, tokenizer_json: Path):
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(str(tokenizer_json))
        self._literal = None  # a copy that reads special tokens' text as plain text (made on first use)
        self._lock = threading.Lock()

    def encode(self, text: str, special: bool = True, parse_special: bool = True) -> list[int]:
        """``special=False``: the text's own tokens, no BOS or other template tokens added. ``parse_special=False``:
        a special token's text written in ``text`` (``<|endoftext|>``) is tokenized as plain text, not as that token."""
        tokenizer = self.tokenizer if parse_special else self._literal_tokenizer()
        return tokenizer.encode(text, add_special_tokens=special).ids

    def encode_mixed(self, content, add_special: bool = False, parse_special: bool = True) -> list[int]:
        """llama-server's prompt forms: text, or a list of token ids and texts joined in order (the BOS, with
        ``add_special``, only before a first part that is text). Ids are kept as given (the caller checks them)."""
        if isinstance(content, str):
            return self.encode(content, add_special, parse_special)
        ids: list = []
        for index, part in enumerate(content):
            if isinstance(part, str):
                ids += self.encode(part, add_special and index == 0, parse_special)
            else:
                ids.append(int(part))
        return ids

    def _literal_tokenizer(self):
        with self._lock:  # one copy: the shared tokenizer's flag is never flipped under another thread
            if self._literal is None:
                from tokenizers import Tokenizer

                literal = Tokenizer.from_str(self.tokenizer.to_str())
                literal.encode_special_tokens = True
                self._literal = literal
            return self._literal

    def token_id(self, text: str) -> int | None:
        """The id of a token given by its text (a special token such as ``<|fim_prefix|>``), or None."""
        return self.tokenizer.token_to_id(text)

    def decode(self, ids, skip_special: bool = True) -> str:
        """The text of ``ids``; ``skip_special=False`` keeps special tokens' text (``<|endoftext|>``)."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special)

    def piece_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (a byte-level BPE token may hold part of a character; an added
        token, its text), as OpenAI's logprobs ``bytes`` carry them."""
        table = getattr(self, "_byte_table", None)
        if table is None:
            table = self._byte_table = {ch: index for index, ch in enumerate(_byte_level_alphabet())}
            self._added = {token.content for token in self.tokenizer.get_added_tokens_decoder().values()}
        token = self.tokenizer.id_to_token(int(token_id))
        if token is None:
            return b""
        if token in self._added:
            return token.encode("utf-8")
        if not all(ch in table for ch in token):  # not a byte-level vocabulary: the token's text
            return self.tokenizer.decode([int(token_id)], skip_special_tokens=False).encode("utf-8")
        return bytes(table[ch] for ch in token)


def _byte_level_alphabet() -> list:
    """GPT-2's byte-level alphabet: character i stands for byte i (the tokenizers ByteLevel mapping)."""
    printable = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAC + 1)) | set(range(0xAE, 0xFF + 1))
    chars, extra = [], 0
    for byte in range(256):
        if byte in printable:
            chars.append(chr(byte))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


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


class StopStrings:
    """Committed token ids -> text pieces, cut at the first stop string; the one text path of
    ``generate`` and ``stream`` (``generate``'s text is the concatenation of the pieces).

    A piece never contains text a stop string could still claim: the longest tail of the text that
    is a prefix of some stop string is held back until the next token decides it, so a stream
    never shows the first characters of a stop string that then completes.
    """

    def __init__(self, codec: TextCodec, stops: tuple):
        self.detok = IncrementalDecoder(codec)
        self.stops = stops
        self.longest = max((len(s) for s in stops), default=0)
        self.text = ""  # decoded so far (complete characters only), cut at a stop string once found
        self.emitted = 0  # characters of ``text`` already handed out
        self.stopped = False
        self.matched = None  # the stop string the text was cut at (the first of those starting earliest)

    def push(self, token_id: int) -> bool:
        """Add one committed token; True when it completed a stop string (the text now ends before it)."""
        self.text += self.detok.push([token_id])
        return self._find_stop()

    def _find_stop(self) -> bool:
        if not self.stops or self.stopped:
            return self.stopped
        # an occurrence can only start in text not yet handed out (what was handed out is no stop's prefix)
        start = self.emitted
        found = [(index, order) for order, index in enumerate(self.text.find(stop, start) for stop in self.stops)
                 if index >= 0]
        if found:
            index, order = min(found)
            self.text, self.matched = self.text[:index], self.stops[order]
            self.stopped = True
        return self.stopped

    def _held(self) -> int:
        """Length of the longest tail of the unsent text that begins some stop string."""
        tail = self.text[max(self.emitted, len(self.text) - self.longest + 1):]
        for size in range(len(tail), 0, -1):
            piece = tail[-size:]
            if any(stop.startswith(piece) for stop in self.stops):
                return size
        return 0

    def take(self) -> str:
        """The text that is final now."""
        end = len(self.text) if self.stopped else len(self.text) - self._held()
        piece = self.text[self.emitted : end]
        self.emitted = end
        return piece

    def finish(self) -> str:
        """Everything still held back (an incomplete character, a stop string's prefix that never completed)."""
        if not self.stopped:
            self.text += self.detok.flush()
            self._find_stop()
        piece = self.text[self.emitted :]
        self.emitted = len(self.text)
        return piece
