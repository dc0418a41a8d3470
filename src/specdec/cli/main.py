"""``specdec``: a thin argv front (generate, chat, serve, bench, demo, eval); every command is a library call."""

from __future__ import annotations

import argparse
import shlex
import sys

from specdec.cli.args import add_generation_args, add_load_args, generation_options


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdec", description="Speculative decoding with a specdec bundle.")
    commands = parser.add_subparsers(dest="command", required=True)

    generate = commands.add_parser("generate", help="generate text from a prompt")
    generate.add_argument("bundle")
    generate.add_argument("prompt")
    add_generation_args(generate)
    add_load_args(generate)
    generate.add_argument("--stream", action="store_true", help="print text as it is generated")
    generate.add_argument("--chat", action="store_true",
                          help="the prompt is a user message: render the bundle's chat template around it")
    generate.add_argument("--system", default=None, help="system message (with --chat)")
    generate.add_argument("--json-schema", default=None, metavar="FILE",
                          help="constrain the output to JSON valid against this schema file (needs llguidance)")
    generate.add_argument("--grammar", default=None, metavar="FILE",
                          help="constrain the output to this grammar: GBNF (llama.cpp's), or Lark if the file ends "
                               "in .lark (needs llguidance)")

    chat = commands.add_parser("chat", help="interactive chat in the terminal (streams; /reset, /exit)")
    chat.add_argument("bundle")
    chat.add_argument("--system", default=None, help="system message")
    add_generation_args(chat)
    add_load_args(chat)

    infill = commands.add_parser("infill", help="fill in the middle between a prefix and a suffix (code models)")
    infill.add_argument("bundle")
    infill.add_argument("--prefix", default=None, help="the text before the cursor")
    infill.add_argument("--suffix", default="", help="the text after the cursor")
    infill.add_argument("--file", default=None, help="a file to complete inside (with --line; the prefix and suffix "
                                                     "are its text before and after that line)")
    infill.add_argument("--line", type=int, default=None, help="with --file: the 1-based line the middle starts at")
    infill.add_argument("--extra", nargs="*", default=(), metavar="FILE", help="other files as repository context")
    add_generation_args(infill)
    add_load_args(infill)

    from specdec.cli.serve import add_serve_parser

    add_serve_parser(commands, add_load_args)

    from specdec.cli.bench import add_bench_parser

    add_bench_parser(commands)
    from specdec.cli.demo import add_demo_parser

    add_demo_parser(commands)
    from specdec.cli.eval import add_eval_parser

    add_eval_parser(commands)
    from specdec.cli.info import add_info_parser

    add_info_parser(commands)
    return parser


def _load(args):
    from specdec.decoding.decoder import SpeculativeDecoder

    return SpeculativeDecoder.load(args.bundle, provider=args.provider, max_context=args.max_context,
                                   threads=args.threads, verify=not args.no_verify, exact_rows=args.exact_rows,
                                   weight_form=args.weight_form)


def _conversation(system, user=None) -> list:
    return ([{"role": "system", "content": system}] if system is not None else []) + (
        [{"role": "user", "content": user}] if user is not None else [])


def _constraint(args):
    from pathlib import Path

    from specdec.decoding.constraint import Constraint

    if args.json_schema and args.grammar:
        raise ValueError("give one of --json-schema and --grammar")
    if args.json_schema:
        return Constraint.json_schema(Path(args.json_schema).read_text(encoding="utf-8"))
    if args.grammar:
        text = Path(args.grammar).read_text(encoding="utf-8")
        return Constraint.lark(text) if args.grammar.endswith(".lark") else Constraint.gbnf(text)
    return None


def cmd_generate(args) -> int:
    from specdec.decoding.text.chat import chat, chat_template_of, stream_chat
    from specdec.decoding.decoder import GenerationStats

    options = generation_options(args, constraint=_constraint(args))
    decoder = _load(args)
    if args.chat:
        chat_template_of(decoder)  # a bundle without a template: one line, before any generation
    elif args.system is not None:
        raise ValueError("--system applies to --chat")
    if args.stream:
        stats = GenerationStats()
        pieces = (stream_chat(decoder, _conversation(args.system, args.prompt), options, stats=stats) if args.chat
                  else decoder.stream(args.prompt, options, stats=stats))
        for piece in pieces:
            print(piece, end="", flush=True)
        print()
    else:
        result = (chat(decoder, _conversation(args.system, args.prompt), options) if args.chat
                  else decoder.generate(args.prompt, options))
        print(result.text)
        stats = result.stats
    print(f"[specdec] {stats.summary()}", file=sys.stderr)
    return 0


def _infill_texts(args) -> tuple:
    """(prefix, suffix, extra chunks) from --prefix/--suffix or --file/--line, and --extra files."""
    from pathlib import Path

    if args.file is not None:
        if args.prefix is not None or args.suffix:
            raise ValueError("--file takes the prefix and suffix from the file: drop --prefix/--suffix")
        lines = Path(args.file).read_text().splitlines(keepends=True)
        if args.line is None or not 1 <= args.line <= len(lines) + 1:
            raise ValueError(f"--line must be in 1..{len(lines) + 1} for {args.file}")
        prefix, suffix = "".join(lines[: args.line - 1]), "".join(lines[args.line - 1:])
    elif args.prefix is None:
        raise ValueError("give --prefix (and --suffix), or --file with --line")
    else:
        prefix, suffix = args.prefix, args.suffix
    extra = [{"filename": Path(name).name, "text": Path(name).read_text()} for name in args.extra]
    return prefix, suffix, extra


def cmd_infill(args) -> int:
    prefix, suffix, extra = _infill_texts(args)
    options = generation_options(args)
    decoder = _load(args)
    result = decoder.infill(prefix, suffix, options, extra=extra)
    print(result.text)
    print(f"[specdec] {result.stats.summary()}", file=sys.stderr)
    return 0


def cmd_chat(args) -> int:
    """Read user turns from stdin, stream each reply; the conversation accumulates until /reset or EOF."""
    from specdec.decoding.text.chat import chat_template_of, stream_chat

    options = generation_options(args)
    decoder = _load(args)
    chat_template_of(decoder)
    interactive = sys.stdin.isatty()
    messages = _conversation(args.system)
    while True:
        if interactive:
            print("> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line or line.strip() == "/exit":
            return 0
        if line.strip() == "/reset":
            messages = _conversation(args.system)
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line.rstrip("\n")})
        reply = []
        try:
            for piece in stream_chat(decoder, messages, options):
                reply.append(piece)
                print(piece, end="", flush=True)
        except ValueError as exc:  # e.g. the conversation outgrew the context: say so, keep the session
            print(f"specdec: error: {exc}", file=sys.stderr)
            messages.pop()
            continue
        print(flush=True)
        messages.append({"role": "assistant", "content": "".join(reply)})


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    # what a report records as its command: the program's name, never this machine's path to it
    args.command_line = shlex.join(["specdec", *argv])
    from specdec.cli.bench import cmd_bench
    from specdec.cli.demo import cmd_demo
    from specdec.cli.eval import cmd_eval
    from specdec.cli.info import cmd_info
    from specdec.cli.serve import cmd_serve

    handlers = {"generate": cmd_generate, "infill": cmd_infill, "chat": cmd_chat, "serve": cmd_serve, "bench": cmd_bench, "demo": cmd_demo,
                "eval": cmd_eval, "info": cmd_info}
    try:
        return handlers[args.command](args)
    except ImportError as exc:  # an optional dependency this command needs: name the extra that installs it
        print(f"specdec: error: {missing_extra(exc)}", file=sys.stderr)
        return 2
    except (ValueError, OSError, RuntimeError) as exc:
        print(f"specdec: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


# a module an optional command imports -> the pyproject extra that installs it
EXTRAS = {"ray": "ray", "torch": "export", "transformers": "export", "onnx": "export", "gguf": "export",
          "fastapi": "serve", "starlette": "serve", "uvicorn": "serve", "pydantic": "serve", "jinja2": "chat",
          "llguidance": "constrain", "onnxruntime_genai": "peers", "onnx_ir": "peers", "matplotlib": "bench",
          "openai": "examples", "cuda": "gpu", "tensorrt": "gpu"}


def missing_extra(exc: ImportError) -> str:
    """One line for a missing optional module: which module, and the extra (or package) that brings it."""
    module = (exc.name or str(exc)).split(".")[0]
    extra = EXTRAS.get(module)
    how = f'pip install -e ".[{extra}]"' if extra else f"pip install {module}"
    return f"this command needs the {module!r} module, which is not installed: {how}"


if __name__ == "__main__":
    sys.exit(main())
