"""``specdec serve``: argv for the HTTP server (OpenAI's, Anthropic's and llama-server's APIs; local uvicorn, or
replicas on Ray Serve)."""

from __future__ import annotations

import argparse
import sys
import threading
from pathlib import Path

from specdec.decoding.suffix_store import DEFAULT_CACHE_MIB as DEFAULT_SUFFIX_CACHE_MIB


def add_serve_parser(commands, add_load_args) -> None:
    serve = commands.add_parser("serve", help="serve a bundle over HTTP: OpenAI's API (chat, completions, "
                                   "Responses), Anthropic's Messages, llama-server's /infill")
    serve.add_argument("bundle")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--workers", "-np", "--parallel", type=int, default=1,
                       help="concurrent generations per process (each a KV cache; the weights are shared; "
                            "llama-server's slots)")
    serve.add_argument("--max-queue", type=int, default=16, help="requests that may wait; more get 429")
    serve.add_argument("--model-name", "--alias", action="append", default=None, metavar="NAME",
                       help="the model id replies name (default: the bundle folder name); repeat it, or give a comma "
                            "list, for aliases the server also lists")
    serve.add_argument("--strict-model-name", action="store_true",
                       help="answer 404 to a request naming a model the server does not list (OpenAI's behaviour); "
                            "by default any name is the served model, as llama-server does")
    serve.add_argument("--no-webui", "--no-ui", action="store_true",
                       help="no chat page at / (by default the server opens one: chat, streamed, tokens coloured by "
                            "the proposer they came from)")
    serve.add_argument("--shutdown-grace", type=float, default=10.0,
                       help="seconds in-flight requests may take to finish at shutdown before they are cancelled")
    serve.add_argument("--cache-ram", type=float, default=0, metavar="MiB",
                       help="a prompt cache of this many MiB of host RAM, shared by the workers: KV snapshots of "
                            "recent prompts that a later request sharing a prefix restores instead of "
                            "recomputing (llama-server's --cache-ram; default 0: off)")
    serve.add_argument("--suffix-cache", type=float, default=DEFAULT_SUFFIX_CACHE_MIB, metavar="MiB",
                       help="recent requests' outputs kept for suffix proposals, shared by the workers (4 bytes a "
                            f"token, oldest dropped first; default {DEFAULT_SUFFIX_CACHE_MIB}; 0: off)")
    serve.add_argument("--slot-save-path", default=None, metavar="DIR",
                       help="the folder llama-server's POST /slots/{id}?action=save|restore reads and writes (a "
                            "worker's KV caches of both models, keyed by the bundle; default: slot actions are off)")
    serve.add_argument("--api-key", action="append", default=None, metavar="KEY",
                       help="require this key (\"Authorization: Bearer KEY\" or \"x-api-key: KEY\") on every route but "
                            "/health and the chat page's files, else 401, as llama-server's --api-key; repeat it or "
                            "give a comma list for several")
    serve.add_argument("--api-key-file", default=None, metavar="FILE",
                       help="a file of keys, one a line (llama-server's --api-key-file)")
    serve.add_argument("--chat-template-file", default=None, metavar="FILE",
                       help="a Jinja chat template to use instead of the bundle's (llama-server's flag)")
    serve.add_argument("--verbose", action="store_true",
                       help="chat answers carry __verbose, the prompt as rendered (llama-server's flag)")
    serve.add_argument("--cors-origins", default="localhost", metavar="ORIGINS",
                       help="web pages whose scripts may read answers: localhost (default: pages of this machine), "
                            "* (any page, llama-server's default), a comma list of origins, or '' (none)")
    serve.add_argument("--seed", "-s", type=int, default=None, metavar="N",
                       help="the seed of a sampled request that gives none (llama-server's --seed; default: fresh "
                            "randomness per request)")
    serve.add_argument("--slots", action=argparse.BooleanOptionalAction, default=True,
                       help="answer GET /slots (llama-server's --slots / --no-slots; default: on)")
    serve.add_argument("--ctx-size", "-c", type=int, default=None, metavar="N",
                       help="llama-server's -c: N tokens of context split between the workers (each --max-context "
                            "N / --workers)")
    add_load_args(serve)
    ray = serve.add_argument_group("Ray Serve (the [ray] extra)")
    ray.add_argument("--ray", action="store_true", help="serve replicas on a Ray cluster instead of this process")
    ray.add_argument("--address", default=None,
                     help="Ray cluster to join (e.g. 10.0.0.5:6379, or auto); default: start a local Ray instance")
    ray.add_argument("--replicas", type=int, default=1, help="replicas, each with its own decoder pool")
    ray.add_argument("--max-replicas", type=int, default=None,
                     help="autoscale between --replicas and this many replicas on ongoing requests")
    ray.add_argument("--cpus-per-replica", type=float, default=1.0)


def model_names(args) -> tuple:
    """(the served id, aliases...) from --model-name (repeated or comma lists), else the bundle folder's name."""
    given = [name.strip() for value in args.model_name or () for name in value.split(",") if name.strip()]
    return tuple(dict.fromkeys(given)) or (Path(args.bundle).resolve().name,)


def api_keys(args) -> tuple:
    """The keys --api-key (repeated or comma lists) and --api-key-file name; a file that cannot be read is a one-line
    error."""
    keys = [key.strip() for value in args.api_key or () for key in value.split(",") if key.strip()]
    if args.api_key_file is not None:
        try:
            text = Path(args.api_key_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"--api-key-file {args.api_key_file}: {exc}") from None
        keys += [line.strip() for line in text.splitlines() if line.strip()]
    if (args.api_key is not None or args.api_key_file is not None) and not keys:
        raise ValueError("--api-key / --api-key-file named no key")
    return tuple(dict.fromkeys(keys))


def model_name(args) -> str:
    return model_names(args)[0]


def _show_logs() -> None:
    """The server library logs (logging); the command shows its INFO lines on stderr."""
    import logging

    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="specdec: %(message)s")
    logging.getLogger("specdec").setLevel(logging.INFO)


def worker_context(args) -> int | None:
    """Each worker's context: --max-context, or llama-server's -c split between the workers (one, not both)."""
    if args.ctx_size is None:
        return args.max_context
    if args.max_context is not None:
        raise ValueError("--ctx-size / -c and --max-context both size the context: give one")
    if args.ctx_size < 2 * args.workers:
        raise ValueError(f"--ctx-size {args.ctx_size} leaves fewer than 2 tokens to each of {args.workers} workers")
    return args.ctx_size // args.workers


# an option record's field -> the flag that sets it (its ValueError names the field first)
FLAGS = {"chat_template_file": "--chat-template-file", "cache_ram_mib": "--cache-ram",
         "suffix_cache_mib": "--suffix-cache", "slot_save_path": "--slot-save-path", "seed": "--seed",
         "replicas": "--replicas", "max_replicas": "--max-replicas", "cpus_per_replica": "--cpus-per-replica"}


def flag_named(exc: ValueError) -> ValueError:
    """An option record's one-line error, naming the flag instead of the field."""
    message = str(exc)
    field = message.split(" ", 1)[0].split("(", 1)[0]
    return ValueError(message.replace(field, FLAGS[field], 1) if field in FLAGS else message)


def cmd_serve(args) -> int:
    _show_logs()
    from specdec.decoding.load_options import BackgroundLoad, LoadOptions

    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in 0..65535, got {args.port}")
    names = model_names(args)
    hosts = host_list(args.host)
    try:
        load_options = LoadOptions(provider=args.provider, max_context=worker_context(args), threads=args.threads,
                                   verify=not args.no_verify, cache_ram_mib=args.cache_ram,
                                   suffix_cache_mib=args.suffix_cache, exact_rows=args.exact_rows,
                                   weight_form=args.weight_form)
    except ValueError as exc:
        raise flag_named(exc) from None
    # the weights are packed on a thread while the web stack is imported and the other flags are checked (each
    # Ray replica loads its own)
    loading = None if args.ray else BackgroundLoad(args.bundle, load_options, args.workers)
    if loading is not None:
        loading.let_it_start()
    try:
        import uvicorn

        from specdec.serving.app import LOCAL_HOSTS, ServerOptions, attach_loaded, create_app, server_template
        from specdec.serving.pool import PoolOptions
    except ImportError as exc:
        raise ValueError(f"specdec serve needs the [serve] extra (pip install 'specdec[serve]'): {exc}") from None
    try:
        server_options = ServerOptions(model_name=names[0], aliases=names[1:], strict_model=args.strict_model_name,
                                       shutdown_grace=args.shutdown_grace, slot_save_path=args.slot_save_path,
                                       webui=not args.no_webui, api_keys=api_keys(args),
                                       cors_origins=args.cors_origins, seed=args.seed, slots_endpoint=args.slots,
                                       chat_template_file=args.chat_template_file, verbose=args.verbose)
        pool_options = PoolOptions(workers=args.workers, max_queue=args.max_queue)
    except ValueError as exc:
        raise flag_named(exc) from None
    if args.ray:
        from specdec.serving.ray_serve import RayOptions, serve_on_ray

        try:
            options = RayOptions(bundle=str(args.bundle), server=server_options, pool=pool_options,
                                 load=load_options, host=args.host, port=args.port, replicas=args.replicas,
                                 max_replicas=args.max_replicas, cpus_per_replica=args.cpus_per_replica,
                                 address=args.address)
        except ValueError as exc:
            raise flag_named(exc) from None
        return serve_on_ray(options)
    exposed = [host for host in hosts if host not in LOCAL_HOSTS]
    if exposed and not server_options.api_keys:
        print(f"specdec: serving on {', '.join(exposed)} without --api-key: anyone who reaches that address can use "
              "the API", file=sys.stderr)
    template = server_template(args.bundle, server_options)  # a template that does not parse: before the port opens
    # as llama-server: the port answers at once (503 "Loading model") and the routes once the bundle is loaded
    app = create_app(None, server_options)
    if server_options.webui:
        import logging

        shown = f"[{hosts[0]}]" if ":" in hosts[0] else hosts[0]
        logging.getLogger("specdec.serve").info("chat page: http://%s:%d/ (--no-webui: none)", shown, args.port)
    settings = dict(timeout_graceful_shutdown=args.shutdown_grace, log_level="info", http=HTTP_PROTOCOL)
    sockets = None
    if len(hosts) == 1:
        server = uvicorn.Server(uvicorn.Config(app, host=hosts[0], port=args.port, **settings))
    else:  # llama-server's --host "127.0.0.1,::1": one server listening on every address
        sockets = listening_sockets(hosts, args.port)
        server = uvicorn.Server(uvicorn.Config(app, **settings))
    failed = []

    def ready() -> None:
        try:
            attach_loaded(app, args.bundle, server_options, pool_options, load_options, loading, template)
        except BaseException as exc:  # the server stops; the error is this command's (one line, exit 2)
            failed.append(exc)
            server.should_exit = True

    threading.Thread(target=ready, name="specdec-ready", daemon=True).start()
    server.run(sockets=sockets)
    if failed:
        raise failed[0]
    return 0


# uvicorn's h11 protocol writes header names as the app gives them (its httptools one lower-cases them): the CORS
# headers then read as llama-server's do, for clients that look names up case-sensitively. A request's parsing costs
# microseconds more, nothing beside a token's milliseconds.
HTTP_PROTOCOL = "h11"


def host_list(value: str) -> list:
    """The addresses of --host (a comma list, as llama-server's); an empty one is a one-line error."""
    hosts = [host.strip() for host in value.split(",")]
    if not all(hosts):
        raise ValueError(f"--host {value!r}: an empty address in the list")
    return list(dict.fromkeys(hosts))


def listening_sockets(hosts: list, port: int) -> list:
    """A listening TCP socket on each distinct address ``hosts`` name (names that resolve to one address, such as
    127.0.0.1 and localhost, share one) at ``port``; a one-line error when one cannot be bound."""
    import socket

    addresses = {}
    for host in hosts:
        try:
            family, *_, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        except OSError as exc:
            raise ValueError(f"--host {host}: {exc}") from None
        addresses.setdefault((family, address[0]), host)
    return [bound_socket(host, port, family) for (family, _), host in addresses.items()]


def bound_socket(host: str, port: int, family):
    """A listening TCP socket on ``host`` and ``port``; a one-line error when it cannot bind."""
    import socket

    try:
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as exc:
        raise ValueError(f"--host {host} --port {port}: cannot listen there: {exc}") from None
    sock.set_inheritable(True)
    return sock
