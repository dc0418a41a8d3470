"""``specdec bench``: its arguments and the command; the runs and the report are ``specdec.bench``'s."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from specdec.bench.bench import build_modes, check_bench_args, check_writable, load_prompts, markdown, plot, preflight, run_bench
from specdec.cli.args import add_load_args

def add_bench_parser(commands) -> None:
    bench = commands.add_parser("bench", help="speculative vs target-only on a prompt set")
    bench.add_argument("bundle")
    bench.add_argument("--prompts", required=True, help="JSON list of {id, kind, prompt}")
    bench.add_argument("--max-new-tokens", type=int, default=128)
    bench.add_argument("--draft-tokens", default="0,1,2,4,auto", help="comma list of draft lengths and/or auto")
    bench.add_argument("--proposers", default="", help="extra modes: comma list of lookup,hybrid (draft length auto)")
    bench.add_argument("--trees", default="", help="extra modes: semicolon list of tree shapes, e.g. '2,2,1;auto'")
    bench.add_argument("--temperature", type=float, default=0.0)
    bench.add_argument("--repeat", type=int, default=1)
    bench.add_argument("--limit", type=int, default=None, help="use only the first N prompts")
    bench.add_argument("--out", default="bench-out", help="folder for bench.json, bench.md, bench.png")
    bench.add_argument("--peer-transformers", nargs=2, metavar=("TARGET", "DRAFT"),
                       help="also time Hugging Face transformers target-only and assisted generation on this pair "
                            "(local folders or .gguf files; needs torch)")
    bench.add_argument("--peer-genai", metavar="MODEL_DIR",
                       help="also time onnxruntime-genai target-only and n-gram speculation on a folder its model "
                            "builder made from the same target (needs onnxruntime-genai)")
    bench.add_argument("--peers-first", action="store_true",
                       help="load the peers' models before specdec's (on a 2-core CPU the session created first ran "
                            "2-3%% slower, whatever its graph: run both orders to see that effect)")
    add_load_args(bench)


def load_peers(args, encode, say) -> tuple:
    peers = []
    if args.peer_genai:
        from specdec.bench.peers import GenaiPeer

        peers.append(GenaiPeer(args.peer_genai, encode, args.max_new_tokens, say, args.threads))
    if args.peer_transformers:
        from specdec.bench.peers import TransformersPeer

        peers.append(TransformersPeer(*args.peer_transformers, encode, args.max_new_tokens, say))
    return tuple(peers)


def cmd_bench(args) -> int:
    from specdec.decoding.decoder import SpeculativeDecoder

    # everything is checked before the first run: a bad option never costs the runs before it
    check_bench_args(args)
    prompts = load_prompts(args.prompts, args.limit)
    modes = build_modes(args.draft_tokens, args.proposers, args.trees)
    check_writable(Path(args.out))
    started = time.perf_counter()
    say = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    encode = lambda text: decoder.codec.encode(text)  # noqa: E731  (peers encode only once the runs start)
    if args.peers_first:
        from specdec.runners.standard import session_options

        session_options(args.threads)  # the process-wide thread pool first, as when specdec's models load first
        peers = load_peers(args, encode, say)
    decoder = SpeculativeDecoder.load(args.bundle, provider=args.provider, max_context=args.max_context,
                                      threads=args.threads, verify=not args.no_verify)
    preflight(decoder, prompts, modes, args.max_new_tokens, args.temperature)
    if not args.peers_first:
        peers = load_peers(args, encode, say)
    report = run_bench(decoder, prompts, modes, args.max_new_tokens, args.temperature, args.repeat, peers=peers)
    report["command"] = args.command_line  # set by cli.main, its only caller
    if peers:
        report["load_order"] = "peers, then specdec" if args.peers_first else "specdec, then peers"
    report["seconds"] = time.perf_counter() - started
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(report, indent=1))
    table = markdown(report)
    (out / "bench.md").write_text(table)
    plotted = plot(report, out / "bench.png")
    print(table)
    print(f"wrote {out / 'bench.json'}, {out / 'bench.md'}" + (f", {out / 'bench.png'}" if plotted else ""))
    return 0
