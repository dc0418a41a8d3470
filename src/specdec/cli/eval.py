"""``specdec eval``: perplexity of a bundle's target and draft over a text, as ``llama-perplexity -c 512``
computes it (``specdec.bench.perplexity``); one line per model, or ``--json``."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

from specdec.bench.eval_text import describe, eval_text
from specdec.bench.perplexity import DEFAULT_CONTEXT, check_eval_args, evaluate_bundle


def add_eval_parser(commands) -> None:
    parser = commands.add_parser("eval", help="perplexity of the target and draft over a text (as llama-perplexity)")
    parser.add_argument("bundle", nargs="?", help="the bundle (not needed with --write-text alone)")
    parser.add_argument("--text", default=None, metavar="FILE",
                        help="UTF-8 text file, the same file llama-perplexity -f reads (default: the built-in text, "
                             "docstrings of 20 standard library modules)")
    parser.add_argument("--write-text", default=None, metavar="FILE",
                        help="write the built-in text to FILE (for llama-perplexity -f) and print its sha256; with a "
                             "bundle, also score it")
    parser.add_argument("--chunks", type=int, default=None, help="evaluate at most N chunks (default: all)")
    parser.add_argument("--context", type=int, default=DEFAULT_CONTEXT,
                        help=f"tokens per chunk, llama-perplexity's -c (default {DEFAULT_CONTEXT})")
    parser.add_argument("--role", choices=["target", "draft", "both"], default="both")
    parser.add_argument("--threads", type=int, default=None, help="onnxruntime intra-op threads")
    parser.add_argument("--no-verify", action="store_true", help="skip the sha256 check of the bundle files")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--progress", action="store_true", help="a line per chunk on stderr")


def read_text(path: str) -> str:
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"--text {path} is not a file")
    try:
        return file.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"--text {path} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None


def cmd_eval(args) -> int:
    check_eval_args(args.context, args.chunks)
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")
    if args.text is not None and args.write_text is not None:
        raise ValueError("--text and --write-text: give one (--write-text writes the built-in text)")
    if args.bundle is None and args.write_text is None:
        raise ValueError("specdec eval needs a bundle (or --write-text FILE alone)")
    text = read_text(args.text) if args.text is not None else eval_text()
    if args.write_text is not None:
        target = Path(args.write_text)
        if target.exists():
            raise ValueError(f"--write-text {args.write_text} exists (nothing is overwritten)")
        target.write_bytes(text.encode("utf-8"))
        print(f"wrote {target}: {describe(text)}", file=sys.stderr)
        if args.bundle is None:
            return 0
    if args.progress:
        logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    roles = ("target", "draft") if args.role == "both" else (args.role,)
    results = evaluate_bundle(args.bundle, text, roles=roles, context=args.context, chunks=args.chunks,
                              threads=args.threads, verify=not args.no_verify)
    if args.json:
        print(json.dumps({"command": args.command_line,
                          "text_file": Path(args.text).name if args.text else f"built-in: {describe(text)}",
                          "results": {role: result.to_dict() for role, result in results.items()}}, indent=1))
        return 0
    for role, result in results.items():
        print(f"{role}: PPL = {result.perplexity:.4f} +/- {result.uncertainty:.5f} ({result.chunks} chunks of "
              f"{result.context}, {result.scored_tokens} tokens scored of {result.text_tokens}, "
              f"{result.seconds:.1f} s)")
    return 0
