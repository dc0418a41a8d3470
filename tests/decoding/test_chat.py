"""Chat templates: copied by the exporter, rendered like transformers, replies end at the end-of-turn token."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import TINY_CHAT_TEMPLATE, TINY_END_OF_TURN
from test_runtime_without_torch import BLOCK_TORCH  # noqa: E402

pytest.importorskip("jinja2")

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "def add(a, b):"}]


@pytest.fixture(scope="module")
def chat_decoder(chat_bundle):
    from specdec import SpeculativeDecoder

    return SpeculativeDecoder.load(chat_bundle)


def test_bundle_carries_the_template(chat_bundle):
    """The source tokenizer's chat template lands in the bundle (the exporter's save_tokenizer), hashed."""
    manifest = json.loads((chat_bundle / "manifest.json").read_text())
    assert "tokenizer/chat_template.jinja" in manifest["files"]
    assert (chat_bundle / "tokenizer" / "chat_template.jinja").read_text() == TINY_CHAT_TEMPLATE


@pytest.mark.integration
def test_save_tokenizer_writes_the_template_or_reports_none(tmp_path):
    """save_tokenizer (export_bundle's tokenizer step) writes the template file, even when the tokenizer's own
    writer does not, and reports a source without one."""
    from specdec.export.bundle import save_tokenizer
    from tiny_models import tiny_tokenizer

    plain = tiny_tokenizer()
    assert save_tokenizer(plain, tmp_path / "plain") is False
    assert not (tmp_path / "plain" / "chat_template.jinja").exists()
    templated = tiny_tokenizer()
    templated.chat_template = TINY_CHAT_TEMPLATE
    original = templated.save_pretrained

    def old_writer(folder, **kwargs):  # a writer that drops the template (as some versions did)
        original(folder, **kwargs)
        (tmp_path / "old" / "chat_template.jinja").unlink(missing_ok=True)

    templated.save_pretrained = old_writer
    assert save_tokenizer(templated, tmp_path / "old") is True
    assert (tmp_path / "old" / "chat_template.jinja").read_text() == TINY_CHAT_TEMPLATE


def test_unhashed_template_is_not_read(tiny_bundle, tmp_path):
    """A template file planted after export (not in the manifest) is ignored: the bundle has no template."""
    import shutil

    from specdec.decoding.text.chat import load_chat_template
    from specdec.contract.manifest import Manifest

    copy = shutil.copytree(tiny_bundle, tmp_path / "b")
    (copy / "tokenizer" / "chat_template.jinja").write_text(TINY_CHAT_TEMPLATE)
    assert load_chat_template(copy, Manifest.read(copy)) is None


def test_render_matches_transformers(chat_bundle):
    """render_chat gives exactly the text transformers' apply_chat_template gives, with and without the header."""
    from transformers import AutoTokenizer

    from specdec.decoding.text.chat import load_chat_template, render_chat
    from specdec.contract.manifest import Manifest

    template = load_chat_template(chat_bundle, Manifest.read(chat_bundle))
    reference = AutoTokenizer.from_pretrained(chat_bundle / "tokenizer")
    for generation_prompt in (True, False):
        expected = reference.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=generation_prompt)
        assert render_chat(template, MESSAGES, add_generation_prompt=generation_prompt) == expected
    prefilled = MESSAGES + [{"role": "assistant", "content": "def add(a, b):\n    return"}]
    expected = reference.apply_chat_template(prefilled, tokenize=False, continue_final_message=True)
    assert render_chat(template, prefilled, continue_final_message=True) == expected
    assert expected.endswith("return")


LLAMA3_LIKE = ("{% for m in messages %}<|start|>{{ m.role }}\n\n{{ m.content | trim }}<|eot|>{% endfor %}"
               "{% if add_generation_prompt %}<|start|>assistant\n\n{% endif %}")


@pytest.mark.parametrize("prefill, ending", [
    (" Whill", "<|start|>assistant\n\nWhill"),  # the template trims it: the cut follows the trimmed text
    ("Whill ", "<|start|>assistant\n\nWhill"),
    ("", "<|start|>assistant\n\n"),  # an empty prefill: a new turn
    ("   ", "<|start|>assistant\n\n"),
])
def test_a_final_assistant_message_is_continued(prefill, ending):
    from specdec.decoding.text.chat import render_chat

    messages = [{"role": "user", "content": "What is the best book"}, {"role": "assistant", "content": prefill}]
    text = render_chat(LLAMA3_LIKE, messages, continue_final_message=True)
    assert text.endswith("What is the best book<|eot|>" + ending) and text.count("assistant") == 1


@pytest.mark.parametrize("messages, message", [
    ([{"role": "user", "content": "x"}], r"messages\[0\]: continuing the final message needs an assistant"),
    ([{"role": "user", "content": "x"}, {"role": "assistant", "content": "a", "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}], "with tool_calls"),
    ([{"role": "user", "content": "x"}, {"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}],
     r"messages\[1\]: two assistant messages end the conversation"),
])
def test_what_cannot_be_continued_is_named(messages, message):
    from specdec.decoding.text.chat import ChatTemplateError, render_chat

    with pytest.raises(ChatTemplateError, match=message):
        render_chat(LLAMA3_LIKE, messages, continue_final_message=True)
    dropping = "{% for m in messages %}{% if m.role != 'assistant' %}{{ m.content }}{% endif %}{% endfor %}"
    with pytest.raises(ChatTemplateError, match="does not write the final assistant message"):
        render_chat(dropping, [{"role": "user", "content": "x"}, {"role": "assistant", "content": "abc"}],
                    continue_final_message=True)


def test_render_helpers_like_transformers():
    """raise_exception, tojson (no HTML escaping), strftime_now, special-token variables, trim/lstrip blocks."""
    from specdec.decoding.text.chat import ChatTemplate, ChatTemplateError, render_chat

    template = ChatTemplate(
        "{{ bos_token }}\n  {% for m in messages %}\n{{ m | tojson }}{% endfor %}{{ strftime_now('%Y')[:2] }}",
        "t", {"bos_token": "<s>"})
    assert render_chat(template, [{"role": "user", "content": "<a & b>"}]) == \
        '<s>\n{"role": "user", "content": "<a & b>"}20'
    refusing = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}ok"
    with pytest.raises(ChatTemplateError, match="user first"):
        render_chat(refusing, [{"role": "assistant", "content": "x"}])


def test_sandbox_blocks_attribute_escapes():
    """A template reaching for Python internals fails in the sandbox instead of running."""
    from specdec.decoding.text.chat import ChatTemplateError, render_chat

    with pytest.raises(ChatTemplateError):
        render_chat("{{ messages.__class__.__mro__[1].__subclasses__() }}", [{"role": "user", "content": "x"}])


@pytest.mark.parametrize("messages, message", [
    ([], "non-empty list"),
    ("hello", "non-empty list"),
    ([{"content": "x"}], r"messages\[0\].role"),
    ([{"role": "user", "content": 3}], r"messages\[0\].content"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}], "only text parts"),
])
def test_bad_messages_named(messages, message):
    """Malformed messages raise ChatTemplateError (a ValueError) naming the bad part."""
    from specdec.decoding.text.chat import ChatTemplateError, render_chat

    with pytest.raises(ChatTemplateError, match=message):
        render_chat(TINY_CHAT_TEMPLATE, messages)


def test_text_parts_are_joined():
    """OpenAI content parts render like the same text as a plain string."""
    from specdec.decoding.text.chat import render_chat

    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert render_chat(TINY_CHAT_TEMPLATE, parts) == render_chat(TINY_CHAT_TEMPLATE, [{"role": "user", "content": "ab"}])


def test_end_of_turn_found_from_the_template(chat_decoder):
    """The token the template writes after an assistant message is the stop id."""
    from specdec.decoding.text.chat import chat_template_of, end_of_turn_ids

    tokenizer = chat_decoder.codec.tokenizer
    ids = end_of_turn_ids(chat_template_of(chat_decoder), tokenizer)
    assert tokenizer.token_to_id(TINY_END_OF_TURN) in ids


def test_chat_equals_generate_on_the_rendered_prompt(chat_decoder):
    """chat() is generate() on the rendered, special-token-aware encoding with the end-of-turn stop id."""
    from specdec.decoding.text.chat import chat, chat_prompt, stream_chat

    prompt = chat_prompt(chat_decoder, MESSAGES)
    assert prompt.text.endswith("<extra_121>assistant\n")
    assert prompt.ids[0] == chat_decoder.codec.tokenizer.token_to_id("<extra_121>")  # one special id, not characters
    expected = chat_decoder.generate(prompt.ids, max_new_tokens=24, stop_token_ids=prompt.stop_token_ids)
    result = chat(chat_decoder, MESSAGES, max_new_tokens=24)
    assert (result.token_ids, result.text, result.finish_reason) == (expected.token_ids, expected.text,
                                                                      expected.finish_reason)
    assert "".join(stream_chat(chat_decoder, MESSAGES, max_new_tokens=24)) == result.text


def test_chat_continues_a_final_assistant_message(chat_decoder):
    """By default a conversation ending with the assistant's message is a prefill: generate() on the prompt cut
    after its text (no end of turn, no new header); continue_final_message=False starts a new turn instead."""
    from specdec.decoding.text.chat import chat, chat_prompt

    prefilled = MESSAGES + [{"role": "assistant", "content": "def add(a, b):"}]
    prompt = chat_prompt(chat_decoder, prefilled)
    assert prompt.text.endswith("<extra_121>assistant\ndef add(a, b):")
    expected = chat_decoder.generate(prompt.ids, max_new_tokens=16, stop_token_ids=prompt.stop_token_ids)
    result = chat(chat_decoder, prefilled, max_new_tokens=16)
    assert result.token_ids == expected.token_ids
    assert chat_prompt(chat_decoder, prefilled, continue_final_message=False).text.endswith("assistant\n")


def test_end_of_turn_token_ends_the_reply(chat_decoder):
    """When the end-of-turn id is planted as a stop id, the reply ends right after it with finish "stop"."""
    from specdec.decoding.text.chat import chat, chat_prompt

    prompt = chat_prompt(chat_decoder, MESSAGES)
    free = chat_decoder.generate(prompt.ids, max_new_tokens=24, num_draft_tokens=0)
    assert len(free.token_ids) > 3
    planted = free.token_ids[3]
    result = chat(chat_decoder, MESSAGES, max_new_tokens=24, num_draft_tokens=0, stop_token_ids=[planted])
    first = free.token_ids.index(planted)
    assert result.token_ids == free.token_ids[: first + 1] and result.finish_reason in ("stop", "eos")


def test_bundle_without_template_says_so(tiny_decoder):
    """A bundle exported from a tokenizer without a template refuses chat in one line."""
    from specdec.decoding.text.chat import ChatTemplateError, chat

    with pytest.raises(ChatTemplateError, match="has no chat template"):
        chat(tiny_decoder, MESSAGES)


def _cli(*args, stdin=""):
    return subprocess.run([sys.executable, "-m", "specdec.cli.main", *args], input=stdin, capture_output=True,
                          text=True, timeout=120)


def test_cli_generate_chat_and_interactive_chat(chat_bundle, chat_decoder):
    """`generate --chat` prints chat()'s reply; `chat` streams the same reply per turn and ends at EOF."""
    from specdec.decoding.text.chat import chat

    expected = chat(chat_decoder, [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
                    max_new_tokens=12).text
    done = _cli("generate", str(chat_bundle), "hi", "--chat", "--system", "be brief", "--max-new-tokens", "12")
    assert done.returncode == 0, done.stderr
    assert done.stdout == expected + "\n"
    session = _cli("chat", str(chat_bundle), "--system", "be brief", "--max-new-tokens", "12", stdin="hi\n")
    assert session.returncode == 0, session.stderr
    assert expected in session.stdout


def test_cli_chat_without_template_one_line(tiny_bundle):
    """The CLI reports a bundle without a template in one stderr line, exit 2."""
    done = _cli("generate", str(tiny_bundle), "hi", "--chat")
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0 and "no chat template" in done.stderr


CHAT_WITHOUT_TORCH = BLOCK_TORCH + """
from specdec import SpeculativeDecoder
from specdec.decoding.text.chat import chat
import specdec.serving.app
dec = SpeculativeDecoder.load(sys.argv[1])
res = chat(dec, [{"role": "user", "content": "hi"}], max_new_tokens=4)
assert len(res.token_ids) >= 1
print('ok')
"""


def test_chat_and_server_need_no_torch(chat_bundle):
    """Chat rendering and the server import and run with torch and transformers unimportable."""
    proc = subprocess.run([sys.executable, "-c", CHAT_WITHOUT_TORCH, str(chat_bundle)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"
