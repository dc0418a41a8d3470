"""Chat: render a bundle's chat template into a prompt, and end a reply at the end-of-turn token.

Scope: the template the exporter copied from the source tokenizer (``tokenizer/chat_template.jinja``,
``tokenizer/chat_templates/*.jinja`` or ``chat_template`` in ``tokenizer_config.json``), rendered
the way transformers' ``apply_chat_template`` renders it: jinja2's ImmutableSandboxedEnvironment
with trim_blocks/lstrip_blocks and loop controls, the ``raise_exception`` / ``strftime_now``
globals, a ``tojson`` that does not HTML-escape, the tokenizer's special tokens (``bos_token``,
``eos_token`` ...) as variables, and the rendered text encoded without adding special tokens
(the template writes them). Boundary: text in, token ids out; generation is the decoder's
(``chat`` / ``stream_chat`` only call ``generate`` / ``stream``). Templates are untrusted code:
only the sandbox runs them, and only a template file the manifest hashes is read.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from pathlib import Path, PurePosixPath

from specdec.contract.bundle import inside

TEMPLATE_FILE = "chat_template.jinja"
TEMPLATES_DIR = "chat_templates"
CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_PROBE = "\u2063specdec-end-of-turn-probe\u2063"  # an assistant reply no template alters


class ChatTemplateError(ValueError):
    """A bundle without a chat template, a template that fails to render, or malformed messages."""


@dataclass(frozen=True)
class ChatTemplate:
    source: str  # the jinja text
    origin: str  # bundle-relative file it came from
    special_tokens: dict  # bos_token, eos_token ... -> text, passed to the template as transformers does


def load_chat_template(bundle_dir, manifest, name: str = "default") -> ChatTemplate | None:
    """The bundle's chat template (``name`` selects one of several), or None when the bundle has none."""
    root = Path(bundle_dir)
    folder = PurePosixPath(manifest.tokenizer_file).parent
    config = _read_config(root, manifest, folder)
    special = _special_tokens(config)
    candidates = [folder / TEMPLATE_FILE] if name == "default" else []
    candidates.append(folder / TEMPLATES_DIR / f"{name}.jinja")
    for relative in map(str, candidates):
        if relative in manifest.files:  # only files the manifest hashes (open_bundle checked them)
            return ChatTemplate(inside(root, relative).read_text(encoding="utf-8"), relative, special)
    embedded = config.get("chat_template")
    if isinstance(embedded, list):  # [{"name": ..., "template": ...}, ...]
        embedded = {entry.get("name"): entry.get("template") for entry in embedded if isinstance(entry, dict)}
    if isinstance(embedded, dict):
        embedded = embedded.get(name)
    if isinstance(embedded, str) and embedded:
        return ChatTemplate(embedded, str(folder / CONFIG_FILE), special)
    return None


def _special_tokens(config: dict) -> dict:
    """bos_token, eos_token ... -> their text, from the bundle's tokenizer config (passed to templates as transformers
    passes them)."""
    return {key: _token_text(config[key]) for key in SPECIAL_TOKEN_NAMES if _token_text(config.get(key))}


def _read_config(root: Path, manifest, folder: PurePosixPath) -> dict:
    relative = str(folder / CONFIG_FILE)
    if relative not in manifest.files:
        return {}
    try:
        config = json.loads(inside(root, relative).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ChatTemplateError(f"{relative} is not readable JSON: {exc}") from None
    return config if isinstance(config, dict) else {}


def _token_text(value) -> str | None:
    if isinstance(value, dict):  # a serialized AddedToken
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _jinja():
    try:
        import jinja2
        import jinja2.ext
        import jinja2.sandbox
    except ImportError:
        raise ChatTemplateError("chat needs jinja2: pip install 'specdec[chat]'") from None
    return jinja2


@lru_cache(maxsize=16)
def _compiled(source: str):
    jinja2 = _jinja()
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # jinja's own tojson HTML-escapes; chat templates expect plain JSON (as transformers renders them)
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.now().strftime(format)

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[jinja2.ext.loopcontrols])
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = strftime_now
    try:
        return environment.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"the chat template does not parse (line {exc.lineno}): {exc.message}") from None


def normalize_messages(messages) -> list[dict]:
    """Plain-JSON copies of ``messages``: each a dict with a string ``role`` and text ``content``.

    OpenAI-style content parts (``[{"type": "text", "text": ...}]``) are joined into one string (chat
    templates of text models read ``message.content`` as a string); keys whose value is None are dropped.
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise ChatTemplateError("messages must be a non-empty list of {\"role\": ..., \"content\": ...} dicts")
    normalized = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ChatTemplateError(f"messages[{index}] must be a dict with role and content, got {type(message).__name__}")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise ChatTemplateError(f"messages[{index}].role must be a non-empty string")
        content = message.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    raise ChatTemplateError(f"messages[{index}].content: only text parts are supported "
                                            "({\"type\": \"text\", \"text\": ...})")
                texts.append(part["text"])
            content = "".join(texts)
        if content is not None and not isinstance(content, str):
            raise ChatTemplateError(f"messages[{index}].content must be a string or a list of text parts")
        clean = {key: value for key, value in message.items() if value is not None and key != "content"}
        if content is not None:
            clean["content"] = content
        check_texts(clean, f"messages[{index}]")
        normalized.append(json.loads(json.dumps(clean)))  # plain JSON only: nothing with methods reaches the sandbox
    return normalized


def check_texts(value, where: str) -> None:
    """Every string inside ``value`` encodable as UTF-8 (valid JSON can carry a lone surrogate, "\\ud800", which no
    tokenizer takes): else a GenerationError naming where it is (``messages[0].content``)."""
    from specdec.decoding.options import check_text

    if isinstance(value, str):
        check_text(value, where)
    elif isinstance(value, dict):
        for key, item in value.items():
            check_texts(key, f"{where} key")
            check_texts(item, f"{where}.{key}")
    elif isinstance(value, (list, tuple)):
        for position, item in enumerate(value):
            check_texts(item, f"{where}[{position}]")


def ends_with_assistant(messages) -> bool:
    """Whether the conversation's last message is the assistant's (a prefill to continue, by default)."""
    last = messages[-1] if isinstance(messages, Sequence) and messages else None
    return isinstance(last, dict) and last.get("role") == "assistant"


def render_chat(template: ChatTemplate | str, messages, add_generation_prompt: bool = True, tools=None,
                continue_final_message: bool = False, **variables) -> str:
    """The prompt text for ``messages``, ending with the assistant header when ``add_generation_prompt``.

    ``continue_final_message``: the last message is the assistant's beginning of its answer (a prefill, as
    transformers' ``apply_chat_template(continue_final_message=True)``, vLLM's and llama-server's): the text
    ends right after its content, so the model continues it. An empty one is no prefill: the conversation
    before it, with the assistant header.

    ``tools``: OpenAI-style function specs, passed to the template as transformers'
    ``apply_chat_template(..., tools=...)`` does; an assistant message's ``tool_calls`` arguments given as
    JSON text are passed as objects (decoding/text/tools.py)."""
    if continue_final_message:
        return _continued(template, messages, tools, variables)
    return _render(template, messages, add_generation_prompt, tools, variables)


def _continued(template, messages, tools, variables) -> str:
    """``messages`` rendered as a finished conversation, cut after the final assistant message's content."""
    normalized = normalize_messages(messages)
    final = normalized[-1]
    where = f"messages[{len(normalized) - 1}]"
    if final["role"] != "assistant":
        raise ChatTemplateError(f"{where}: continuing the final message needs an assistant message last, "
                                f"not {final['role']!r}")
    if final.get("tool_calls"):
        raise ChatTemplateError(f"{where}: an assistant message with tool_calls cannot be continued")
    if len(normalized) > 1 and normalized[-2]["role"] == "assistant":  # llama-server refuses it too
        raise ChatTemplateError(f"messages[{len(normalized) - 2}]: two assistant messages end the conversation; a "
                                "prefill to continue is one final assistant message")
    content = final.get("content") or ""
    if not content.strip():
        return _render(template, normalized[:-1], True, tools, variables)
    text = _render(template, normalized, False, tools, variables)
    for piece in (content, content.strip()):  # some templates (Llama 3's) strip a message's ends
        end = text.rfind(piece)
        if end >= 0:
            return text[:end + len(piece)]
    raise ChatTemplateError(f"{where}: the chat template does not write the final assistant message's text as "
                            "given, so it cannot be continued")


def _render(template: ChatTemplate | str, messages, add_generation_prompt: bool, tools, variables: dict) -> str:
    from specdec.decoding.text.tools import tool_messages
    jinja2 = _jinja()

    if isinstance(template, str):
        template = ChatTemplate(template, "<string>", {})
    check_texts(variables, "template_variables")
    check_texts(tools, "tools")
    try:
        context = {**template.special_tokens, **json.loads(json.dumps(variables))}
        tools = json.loads(json.dumps(tools)) if tools else None
    except (TypeError, ValueError):
        raise ChatTemplateError("template variables and tools must be plain JSON values (str, number, bool, list, "
                                "dict)") from None
    try:
        return _compiled(template.source).render(messages=tool_messages(normalize_messages(messages)), tools=tools,
                                                 documents=None,
                                                 add_generation_prompt=add_generation_prompt, **context)
    except jinja2.exceptions.TemplateError as exc:
        raise ChatTemplateError(f"the chat template refused these messages: {exc}") from None


def end_of_turn_ids(template: ChatTemplate | str, tokenizer) -> tuple:
    """Ids of the special tokens that end an assistant turn: the first token the template writes after an
    assistant message (``<|im_end|>``, ``<|eot_id|>``, ``<end_of_turn>`` ...) and the tokenizer config's eos."""
    if isinstance(template, str):
        template = ChatTemplate(template, "<string>", {})
    # control tokens are added tokens (a GGUF-converted tokenizer may not flag every one of them special)
    special = {token.content: index for index, token in tokenizer.get_added_tokens_decoder().items()}
    found = []
    probe = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _PROBE}]
    try:
        text = render_chat(template, probe, add_generation_prompt=False)
    except ChatTemplateError:
        text = ""
    if _PROBE in text:
        after = text.split(_PROBE, 1)[1]
        for index in tokenizer.encode(after, add_special_tokens=False).ids if after else []:
            if tokenizer.id_to_token(index) in special:  # the first control token after the reply
                found.append(index)
                break
            if tokenizer.decode([index], skip_special_tokens=False).strip():  # text before it: not a turn end
                break
    eos = template.special_tokens.get("eos_token")
    if eos in special:
        found.append(special[eos])
    return tuple(dict.fromkeys(found))


@dataclass(frozen=True)
class ChatPrompt:
    text: str
    ids: list  # the rendered text encoded without added special tokens (the template writes them)
    stop_token_ids: tuple  # end-of-turn ids


def template_from_file(bundle_dir, manifest, path) -> ChatTemplate:
    """A chat template read from ``path`` (llama-server's ``--chat-template-file``), with the bundle's special tokens;
    ChatTemplateError in one line when it is not a readable UTF-8 file that jinja2 parses."""
    file = Path(path)
    try:
        source = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ChatTemplateError(f"chat template file {path}: {exc}") from None
    try:
        _compiled(source)
    except ChatTemplateError as exc:
        raise ChatTemplateError(f"chat template file {path}: {exc}") from None
    config = _read_config(Path(bundle_dir), manifest, PurePosixPath(manifest.tokenizer_file).parent)
    return ChatTemplate(source, str(file), _special_tokens(config))


def chat_template_of(decoder) -> ChatTemplate:
    """The decoder's template: the one it was given (``decoder.chat_template``, e.g. ``--chat-template-file``), else
    its bundle's; ChatTemplateError in one line when there is none."""
    if getattr(decoder, "chat_template", None) is not None:
        return decoder.chat_template
    key = (str(decoder.bundle_dir), tuple(sorted(decoder.manifest.files.items())))
    if key not in _TEMPLATES:  # forks share the bundle: render setup is read once per bundle
        _TEMPLATES[key] = load_chat_template(decoder.bundle_dir, decoder.manifest)
    template = _TEMPLATES[key]
    if template is None:
        raise ChatTemplateError(
            f"bundle {decoder.bundle_dir} has no chat template (the source tokenizer had none): "
            "use generate with a plain prompt"
        )
    return template


_TEMPLATES: dict = {}


def chat_prompt(decoder, messages, add_generation_prompt: bool = True, tools=None,
                continue_final_message: bool | None = None, **variables) -> ChatPrompt:
    """Render ``messages`` (and ``tools``) with the decoder's bundle template and encode it.

    ``continue_final_message``: None (the default) continues a final assistant message (a prefill: the answer
    continues its text, as llama-server and Anthropic's API do) and ends any other conversation with the
    assistant header; True / False say which (``render_chat``)."""
    template = chat_template_of(decoder)
    if continue_final_message is None:
        continue_final_message = ends_with_assistant(messages)
    text = render_chat(template, messages, add_generation_prompt=add_generation_prompt, tools=tools,
                       continue_final_message=continue_final_message, **variables)
    tokenizer = decoder.codec.tokenizer
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    return ChatPrompt(text, ids, end_of_turn_ids(template, tokenizer))


def chat(decoder, messages, options=None, *, template_variables: dict | None = None, tools=None, tool_choice=None,
         stats=None, **changes):
    """``decoder.generate`` on the rendered conversation, stopping at the end of the assistant's turn.

    ``options`` / ``changes``: generate's (a GenerationOptions, or keywords; ``stop_token_ids`` add to the turn's
    end). ``tools`` / ``tool_choice``: OpenAI's (decoding/text/tools.py); "required" or a named function constrains the
    answer to calls; ``specdec.decoding.text.tools.parse_tool_calls`` reads them."""
    prompt, options = chat_request(decoder, messages, options, template_variables, tools, tool_choice, changes)
    stream = decoder.stream(prompt.ids, options, stats=stats)
    from specdec.decoding.request import GenerationResult

    text = "".join(stream)
    return GenerationResult(text=text, token_ids=stream.token_ids, stats=stream.stats,
                            finish_reason=stream.finish_reason, logprobs=stream.logprobs, sources=list(stream.sources),
                            stop_string=stream.stop_string)


def stream_chat(decoder, messages, options=None, *, template_variables: dict | None = None, tools=None,
                tool_choice=None, stats=None, **changes) -> Iterator[str]:
    """``decoder.stream`` on the rendered conversation (text pieces), stopping at the end of the turn."""
    prompt, options = chat_request(decoder, messages, options, template_variables, tools, tool_choice, changes)
    return decoder.stream(prompt.ids, options, stats=stats)


def chat_request(decoder, messages, options=None, template_variables=None, tools=None, tool_choice=None,
                 changes=None) -> tuple:
    """(the rendered ``ChatPrompt``, the GenerationOptions to decode it with: stopping at the turn's end, and
    constrained to tool calls when ``tool_choice`` requires one)."""
    from specdec.decoding.options import GenerationOptions
    from specdec.decoding.text.tools import ToolError, check_tools, chosen_tools, tool_call_constraint, tool_format_of

    options = GenerationOptions.build(options, **(changes or {}))
    try:
        tools = check_tools(tools)
        usable, required = chosen_tools(tools, tool_choice)
    except ToolError as exc:
        raise ChatTemplateError(str(exc)) from None
    prompt = chat_prompt(decoder, messages, tools=tools or None, **(template_variables or {}))
    options = options.replace(stop_token_ids=tuple(prompt.stop_token_ids) + options.stop_token_ids)
    if required:
        form = tool_format_of(chat_template_of(decoder).source)
        if form is None:
            raise ChatTemplateError("tool_choice: this bundle's chat template has no tool-call syntax specdec knows")
        if options.constraint is not None:
            raise ChatTemplateError("tool_choice: a required tool call and a constraint cannot both apply")
        options = options.replace(constraint=tool_call_constraint(usable, form, codec=decoder.codec))
    return prompt, options
