"""``specdec bench``: its arguments and the command; the runs and the report are ``specdec.bench``'s."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from specdec.bench.bench import (build_modes, check_bench_args, check_writable, load_prompts, markdown, plot, preflight,
                                 provenance, run_bench)
from specdec.bench.llama_server import MODES as LLAMA_MODES
from specdec.bench.openvino_peer import MODES as OPENVINO_MODES, OpenvinoPeer
from specdec.bench.session import SPECDEC_MODES
from specdec.cli.args import add_load_args
from specdec.decoding.proposers import proposer_names

def add_bench_parser(commands) -> None:
    bench = commands.add_parser("bench", help="speculative vs target-only on a prompt set")
    bench.add_argument("bundle")
    bench.add_argument("--prompts", default=None, help="JSON list of {id, kind, prompt} (or --session)")
    bench.add_argument("--max-new-tokens", type=int, default=128)
    bench.add_argument("--draft-tokens", default="0,1,2,4,auto", help="comma list of draft lengths and/or auto")
    bench.add_argument("--proposers", default="",
                       help=f"extra modes, each proposer alone with auto lengths: a comma list of "
                            f"{','.join(proposer_names())}")
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
    llama = bench.add_argument_group("llama.cpp peer")
    llama.add_argument("--peer-llama-server", metavar="BIN",
                       help="also time llama.cpp's llama-server (this binary) on the bundle's source GGUF: one server "
                            "per mode on 127.0.0.1, timed by its /completion timings")
    llama.add_argument("--peer-gguf", nargs="+", metavar="GGUF",
                       help="TARGET [DRAFT] GGUF files for --peer-llama-server (default: the manifest's, if recorded)")
    llama.add_argument("--llama-modes", default=",".join(LLAMA_MODES),
                       help="comma list of llama.cpp modes (default: all; llama:draft needs the draft GGUF)")
    llama.add_argument("--llama-draft-max", type=int, default=4, help="--spec-draft-n-max of llama:draft (default 4)")
    llama.add_argument("--llama-context", type=int, default=None,
                       help="llama-server -c (default: --max-context, else 4096)")
    llama.add_argument("--llama-args", default="",
                       help="extra llama-server arguments for every server, one string (e.g. --llama-args=--no-repack "
                            "where ggml's AMX kernels crash)")
    openvino = bench.add_argument_group("OpenVINO GenAI peer")
    openvino.add_argument("--peer-openvino", action="store_true",
                          help="also time OpenVINO GenAI on the same GGUFs (--peer-gguf or the manifest's): target-only, "
                               "its speculative decoding with the draft, its prompt lookup; a worker process per mode")
    openvino.add_argument("--openvino-python", default=None, metavar="PYTHON",
                          help="the interpreter that has openvino-genai (default: this one)")
    openvino.add_argument("--openvino-draft", default=None, metavar="GGUF",
                          help="the draft GGUF for ov:draft when OpenVINO cannot read --peer-gguf's (its GGUF reader "
                               "takes no Q5_0: a Q8_0 copy by llama-quantize --allow-requantize)")
    openvino.add_argument("--openvino-modes", default=",".join(OPENVINO_MODES),
                          help="comma list of OpenVINO GenAI modes (default: all; ov:draft needs the draft GGUF)")
    openvino.add_argument("--openvino-draft-tokens", type=int, default=4,
                          help="num_assistant_tokens of ov:draft and ov:lookup (default 4)")
    openvino.add_argument("--openvino-config", default=None, metavar="JSON",
                          help="OpenVINO properties for every pipeline, a JSON object (e.g. "
                               "'{\"INFERENCE_PRECISION_HINT\": \"f32\"}')")
    session = bench.add_argument_group("session benchmark (instead of --prompts)")
    session.add_argument("--session", nargs="+", metavar="TRACE",
                         help="replay these traces (tools/inputs/make_traces.py) through `specdec serve BUNDLE` over HTTP "
                              "(and llama-server with --peer-llama-server)")
    session.add_argument("--server-url", default=None,
                         help="a running specdec server to replay against instead of starting one")
    session.add_argument("--max-tokens-cap", type=int, default=None,
                         help="cap every request's max_tokens / n_predict (short smoke runs)")
    session.add_argument("--specdec-modes", default="default",
                         help=f"comma list of specdec modes, a server each: {', '.join(SPECDEC_MODES)} (target: no "
                              "speculation; default: default)")
    add_load_args(bench)


def check_llama(args) -> tuple | None:
    """(binary, target GGUF, draft GGUF or None, modes, extra server args) of --peer-llama-server, checked before
    anything runs."""
    from specdec.bench.llama_server import check_binary, resolve_ggufs

    if not args.peer_llama_server:
        if args.peer_gguf and not getattr(args, "peer_openvino", False):
            raise ValueError("--peer-gguf applies to --peer-llama-server and --peer-openvino")
        return None
    binary = check_binary(args.peer_llama_server)
    target, draft = resolve_ggufs(args.bundle, args.peer_gguf)
    modes = [m.strip() for m in args.llama_modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in LLAMA_MODES]
    if unknown or not modes:
        raise ValueError(f"--llama-modes takes a comma list of {', '.join(LLAMA_MODES)}, got {args.llama_modes!r}")
    if args.llama_draft_max < 1:
        raise ValueError(f"--llama-draft-max must be >= 1, got {args.llama_draft_max}")
    import shlex

    return binary, target, draft, modes, tuple(shlex.split(args.llama_args))


def check_openvino(args) -> tuple | None:
    """(python, target GGUF, draft GGUF or None, modes, properties) of --peer-openvino, checked before anything
    runs (the interpreter is asked to import openvino_genai)."""
    from specdec.bench.llama_server import check_gguf, resolve_ggufs
    from specdec.bench.openvino_peer import check_python, parse_modes, parse_properties

    if not args.peer_openvino:
        return None
    modes = parse_modes(args.openvino_modes)
    if args.openvino_draft_tokens < 1:
        raise ValueError(f"--openvino-draft-tokens must be >= 1, got {args.openvino_draft_tokens}")
    properties = parse_properties(args.openvino_config)
    target, draft = resolve_ggufs(args.bundle, args.peer_gguf, flag="--peer-openvino")
    if args.openvino_draft:
        draft = check_gguf(args.openvino_draft, "draft")
    return check_python(args.openvino_python or sys.executable), target, draft, modes, properties


def weights_per_token(decoder, peer: tuple | None) -> dict:
    """The target form's bytes a one-token pass reads, and the peers' target GGUF's (``peer``: check_llama's or
    check_openvino's tuple, its second item the target GGUF)."""
    from specdec.bench.weights_read import gguf_bytes, target_bytes

    weights = {"target": target_bytes(decoder.bundle_dir, decoder.manifest, decoder.weight_form)}
    if peer is not None:
        weights["gguf"] = {"file": Path(peer[1]).name, "bytes": gguf_bytes(peer[1])}
    return weights


def machine_bandwidth(threads: int | None) -> dict:
    """This machine's read bandwidth from as many processes as decoding uses threads (``weights_read``)."""
    from specdec.bench.weights_read import read_bandwidth

    processes = max(1, min(threads or os.cpu_count() or 2, 8))
    return {"gbs": read_bandwidth(processes, gib=min(0.5, 2.0 / processes)), "processes": processes}  # <= 2 GiB


def llama_context(args) -> int:
    from specdec.bench.llama_server import DEFAULT_CONTEXT

    return args.llama_context or args.max_context or DEFAULT_CONTEXT


def load_peers(args, encode, say, llama=None, openvino=None) -> tuple:
    peers = []
    try:
        if openvino:
            python, target, draft, modes, properties = openvino
            peers.append(OpenvinoPeer(python, target, draft, encode, args.max_new_tokens, say, args.threads, modes,
                                      args.openvino_draft_tokens, properties, log_dir=args.out))
        if llama:
            from specdec.bench.llama_server import LlamaServerPeer

            binary, target, draft, modes, extra = llama
            peers.append(LlamaServerPeer(binary, target, draft, encode, args.max_new_tokens, say, args.threads,
                                         llama_context(args), modes, args.llama_draft_max, log_dir=args.out,
                                         extra=extra))
        if args.peer_genai:
            from specdec.bench.peers import GenaiPeer

            peers.append(GenaiPeer(args.peer_genai, encode, args.max_new_tokens, say, args.threads))
        if args.peer_transformers:
            from specdec.bench.peers import TransformersPeer

            peers.append(TransformersPeer(*args.peer_transformers, encode, args.max_new_tokens, say))
    except BaseException:  # a later peer failed: stop the servers of the earlier ones
        for peer in peers:
            if hasattr(peer, "close"):
                peer.close()
        raise
    return tuple(peers)


def cmd_bench(args) -> int:
    from specdec.decoding.decoder import SpeculativeDecoder

    # everything is checked before the first run: a bad option never costs the runs before it
    if bool(args.prompts) == bool(args.session):
        raise ValueError("give --prompts FILE (per-prompt bench) or --session TRACE... (session replay), not both")
    check_bench_args(args)
    if args.session:
        return cmd_session(args)
    llama = check_llama(args)
    openvino = check_openvino(args)
    prompts = load_prompts(args.prompts, args.limit)
    modes = build_modes(args.draft_tokens, args.proposers, args.trees)
    check_writable(Path(args.out))
    started = time.perf_counter()
    say = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    bandwidth = machine_bandwidth(args.threads)  # before any model takes memory or a core
    encode = lambda text: decoder.codec.encode(text)  # noqa: E731  (peers encode only once the runs start)
    peers = ()
    try:  # llama-server processes are stopped whatever happens after they start
        if args.peers_first:
            from specdec.runners.standard import session_options

            session_options(args.threads)  # the process-wide thread pool first, as when specdec's models load first
            peers = load_peers(args, encode, say, llama, openvino)
        decoder = SpeculativeDecoder.load(args.bundle, provider=args.provider, max_context=args.max_context,
                                          threads=args.threads, verify=not args.no_verify, exact_rows=args.exact_rows,
                                          weight_form=args.weight_form)
        preflight(decoder, prompts, modes, args.max_new_tokens, args.temperature)
        if not args.peers_first:
            peers = load_peers(args, encode, say, llama, openvino)
        report = run_bench(decoder, prompts, modes, args.max_new_tokens, args.temperature, args.repeat, peers=peers)
        for peer in peers:
            if isinstance(peer, OpenvinoPeer):
                report["openvino"] = peer.describe()
            elif hasattr(peer, "describe"):
                report["llama_server"] = peer.describe() | {"context": llama_context(args)}
    finally:
        for peer in peers:
            if hasattr(peer, "close"):
                peer.close()
    report["weights_per_token"] = weights_per_token(decoder, llama or openvino) | {"read_bandwidth": bandwidth}
    report["command"] = args.command_line  # set by cli.main, its only caller
    report["provenance"] = provenance(args.bundle, args.threads)
    if peers:
        report["load_order"] = "peers, then specdec" if args.peers_first else "specdec, then peers"
    report["seconds"] = time.perf_counter() - started
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(report, indent=1))
    table = markdown(report)
    (out / "bench.md").write_text(table)
    try:
        plotted = plot(report, out / "bench.png")
    except ImportError as exc:
        plotted = False
        print(f"specdec bench: no bench.png: {exc}", file=sys.stderr)
    print(table)
    print(f"wrote {out / 'bench.json'}, {out / 'bench.md'}" + (f", {out / 'bench.png'}" if plotted else ""))
    return 0


def cmd_session(args) -> int:
    """Replay traces through `specdec serve` (started here unless --server-url) and optionally llama-server."""
    from specdec.bench.llama_server import LlamaServer
    from specdec.bench.session import SPECDEC_MODES, SessionServer, run_session, session_markdown, start_specdec_server
    from specdec.bench.traces import load_trace

    traces = [load_trace(path) for path in args.session]
    if args.max_tokens_cap is not None and args.max_tokens_cap < 0:
        raise ValueError(f"--max-tokens-cap must be >= 0, got {args.max_tokens_cap}")
    llama = check_llama(args)
    specdec_modes = [m.strip() for m in args.specdec_modes.split(",") if m.strip()]
    if not specdec_modes or any(m not in SPECDEC_MODES for m in specdec_modes):
        raise ValueError(f"--specdec-modes takes a comma list of {', '.join(SPECDEC_MODES)}, got {args.specdec_modes!r}")
    argvs: dict = {}
    out = Path(args.out)
    check_writable(out)
    say = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    started = time.perf_counter()
    servers = []
    try:
        if args.server_url:
            servers.append(SessionServer("specdec", args.server_url, "specdec"))
        else:
            for mode in specdec_modes:
                say(f"session: starting specdec serve {args.bundle} ({mode})")
                servers.append(start_specdec_server(args.bundle, args.threads, args.max_context,
                                                    str(out / f"specdec-serve-{mode}.log"), args.no_verify, mode,
                                                    args.provider, args.exact_rows, args.weight_form))
        if llama:
            binary, target, draft, modes, extra = llama
            for mode in modes:  # a server per mode, each with its own cache
                say(f"session: starting llama-server ({mode})")
                process = LlamaServer(binary, target, mode, draft, args.threads, llama_context(args),
                                      args.llama_draft_max, log_path=str(out / f"llama-server-{mode[6:]}.log"),
                                      extra=extra).start()
                name = "llama.cpp" if mode == "llama:target" else f"llama.cpp:{mode[6:]}"
                servers.append(SessionServer(name, process.url, "llama", process))
                argvs[name] = [Path(a).name if "/" in a else a for a in process.argv]
        report = run_session(traces, servers, args.max_tokens_cap, say)
    finally:
        for server in servers:
            server.stop()
    report["command"] = args.command_line
    report["provenance"] = provenance(args.bundle, args.threads)
    if llama:
        report["llama_server"] = {"modes": llama[3], "argv": argvs, "context": llama_context(args)}
    report["seconds"] = time.perf_counter() - started
    (out / "session.json").write_text(json.dumps(report, indent=1))
    table = session_markdown(report)
    (out / "session.md").write_text(table)
    print(table)
    print(f"wrote {out / 'session.json'}, {out / 'session.md'}")
    return 0
