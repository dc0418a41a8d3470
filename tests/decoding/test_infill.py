"""Fill-in-the-middle: prompt layout (llama.cpp's), truncation, stop ids, and refusals in one line."""

from __future__ import annotations

import pytest

from specdec.contract.fim import find_fim_tokens
from specdec.decoding.text.infill import fim_stop_ids, infill_prompt
from specdec.decoding.request import GenerationError

SPECIAL = {"<|fim_prefix|>": 1000, "<|fim_suffix|>": 1001, "<|fim_middle|>": 1002, "<|repo_name|>": 1003,
           "<|file_sep|>": 1004, "<|fim_pad|>": 1005, "<|endoftext|>": 1006}


class CharCodec:
    """One token per character (its code point); the FIM markers as special ids."""

    def encode(self, text, special=True):
        return [ord(c) for c in text]

    def token_id(self, text):
        return SPECIAL.get(text)


FIM = find_fim_tokens(CharCodec().token_id)


def test_the_family_is_found_by_token_text():
    assert FIM == {"prefix": 1000, "suffix": 1001, "middle": 1002, "repo": 1003, "file_sep": 1004, "pad": 1005,
                   "end": 1006}
    assert find_fim_tokens(lambda text: None) == {}
    assert set(fim_stop_ids(FIM)) == set(SPECIAL.values())


def test_layout_is_llama_cpp_s_repo_level_pattern():
    ids = infill_prompt(CharCodec(), FIM, "ab", "yz", extra=[{"filename": "f.py", "text": "T"}], prompt="c")
    text = lambda s: [ord(c) for c in s]  # noqa: E731
    assert ids == ([1003] + text("myproject\n") + [1004] + text("f.py\n") + text("T") + [1004] + text("filename\n")
                   + [1000] + text("abc") + [1001] + text("yz") + [1002])


def test_truncation_keeps_the_prefix_end_the_suffix_start_and_the_markers():
    ids = infill_prompt(CharCodec(), FIM, "p" * 50 + "END", "START" + "s" * 50, room=43)
    assert len(ids) == 43 and ids[-1] == 1002
    prefix = ids[ids.index(1000) + 1 : ids.index(1001)]
    suffix = ids[ids.index(1001) + 1 : -1]
    assert bytes(prefix).endswith(b"END") and bytes(suffix).startswith(b"START")
    assert len(suffix) == (43 - 3) // 4


@pytest.mark.parametrize("bad, field", [
    (dict(prefix="\ud800"), "prefix"), (dict(suffix=3), "suffix"), (dict(extra="x"), "extra"),
    (dict(extra=[{"file": "a"}]), "extra[0]"), (dict(extra=[{"text": "\udfff"}]), "extra[0].text"),
])
def test_bad_input_is_one_line_naming_the_field(bad, field):
    args = dict(prefix="a", suffix="b", extra=()) | bad
    with pytest.raises(GenerationError, match=field.replace("[", r"\[").replace("]", r"\]")):
        infill_prompt(CharCodec(), FIM, args["prefix"], args["suffix"], args["extra"])


def test_a_tokenizer_without_fim_tokens_is_refused_in_one_line():
    with pytest.raises(GenerationError, match="no fill-in-the-middle tokens"):
        infill_prompt(CharCodec(), {}, "a", "b")


def test_infill_on_an_exported_bundle_without_fim_tokens(tiny_decoder):
    with pytest.raises(GenerationError, match="no fill-in-the-middle tokens"):
        tiny_decoder.infill("def f():\n", "\n")


def test_a_prompt_with_a_lone_surrogate_is_a_generation_error():
    """Valid JSON can carry "\\ud800": the tokenizer would raise a TypeError; the API says one line instead."""
    from scripted import scripted_decoder

    with pytest.raises(GenerationError, match="prompt is not valid text"):
        scripted_decoder().generate("ab\ud800c", max_new_tokens=3)
