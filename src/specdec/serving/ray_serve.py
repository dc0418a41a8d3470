"""Scale-out on Ray Serve (the ``[ray]`` extra): replicas of the OpenAI server, each with its own decoder pool.

Every replica builds, on its node, the same app ``specdec serve`` runs locally (``app.build_app``: a
DecoderPool of ``workers`` forked decoders over the bundle), behind Ray Serve's HTTP proxy on
``host:port``. The bundle is opened by path on each node: put it where every node sees it at the same
path (a shared or synced folder), with specdec installed in each node's Python.

A cluster: ``ray start --head --node-ip-address=<head ip>`` on one machine, ``ray start
--address=<head ip>:6379`` on the others, then ``specdec serve BUNDLE --ray --address auto --replicas N``
on any of them. Without ``--address`` a local Ray instance is started on 127.0.0.1 (dashboard off).
Boundary: deployment wiring only; HTTP behaviour is app.py's and the dialects'.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

APP_NAME = "specdec"
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RayOptions:
    bundle: str
    model_name: str
    aliases: tuple = ()  # other model names replies answer to (ServerOptions)
    strict_model: bool = False  # 404 for a model name not served (ServerOptions)
    shutdown_grace: float = 10.0  # seconds a replica's running requests may take to finish when it stops
    webui: bool = True  # the chat page at / (ServerOptions)
    api_keys: tuple = ()  # keys a request must carry, else 401 (ServerOptions)
    cors_origins: str = "localhost"  # pages whose scripts may read answers (ServerOptions)
    host: str = "127.0.0.1"
    port: int = 8000
    workers: int = 1  # decoders per replica (forks sharing the replica's sessions)
    max_queue: int = 16  # per replica, as ``specdec serve --max-queue``
    replicas: int = 1  # fixed count, or the autoscaling minimum when max_replicas is set
    max_replicas: int | None = None  # autoscale on ongoing requests between replicas and this
    cpus_per_replica: float = 1.0  # Ray CPU reservation per replica
    address: str | None = None  # Ray cluster to join ("auto", "host:6379"); None: start a local instance
    provider: str = "cpu"
    max_context: int | None = None
    threads: int | None = None
    verify: bool = True
    cache_ram_mib: float = 0  # per replica: a prompt cache shared by its workers (0: none)
    suffix_cache_mib: float | None = None  # per replica: recent outputs for suffix proposals (None: the default)
    exact_rows: bool | None = None  # one-token target passes as two rows (None: where the CPU needs it)
    weight_form: str | None = None  # the target's weight form to run (None: the one measured faster here)

    def __post_init__(self):
        for name in ("workers", "replicas"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {self.max_queue}")
        if self.max_replicas is not None and self.max_replicas < self.replicas:
            raise ValueError(f"max_replicas ({self.max_replicas}) must be >= replicas ({self.replicas})")
        if isinstance(self.cache_ram_mib, bool) or not isinstance(self.cache_ram_mib, (int, float)) or not (
                self.cache_ram_mib >= 0):
            raise ValueError(f"cache_ram_mib must be a number >= 0, got {self.cache_ram_mib!r}")
        if self.suffix_cache_mib is not None and (isinstance(self.suffix_cache_mib, bool) or not isinstance(
                self.suffix_cache_mib, (int, float)) or not self.suffix_cache_mib >= 0):
            raise ValueError(f"suffix_cache_mib must be a number >= 0, got {self.suffix_cache_mib!r}")
        if not self.cpus_per_replica > 0:
            raise ValueError(f"cpus_per_replica must be > 0, got {self.cpus_per_replica}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")

    def scaling(self) -> dict:
        """Ray Serve deployment settings: a fixed replica count, or autoscaling bounds."""
        if self.max_replicas is None:
            return {"num_replicas": self.replicas}
        return {"autoscaling_config": {"min_replicas": self.replicas, "max_replicas": self.max_replicas,
                                       "target_ongoing_requests": self.workers}}


def build_application(options: RayOptions):
    """The bound Ray Serve application (``serve.run`` it, or reference it from a Serve config file)."""
    try:
        from ray import serve
    except ImportError as exc:
        raise ValueError(f"--ray needs the [ray] extra (pip install 'specdec[ray]'): {exc}") from None
    bundle = str(Path(options.bundle).resolve())
    if not Path(bundle).is_dir():
        raise ValueError(f"bundle folder {options.bundle} does not exist (every node must see it at this path)")

    def replica_app():  # runs in each replica, on its node
        from specdec.serving.app import LoadOptions, ServerOptions, build_app
        from specdec.serving.pool import PoolOptions

        return build_app(bundle, ServerOptions(model_name=options.model_name, aliases=options.aliases,
                                               strict_model=options.strict_model,
                                               shutdown_grace=options.shutdown_grace, webui=options.webui,
                                               api_keys=options.api_keys, cors_origins=options.cors_origins),
                         PoolOptions(workers=options.workers, max_queue=options.max_queue),
                         LoadOptions(provider=options.provider, max_context=options.max_context,
                                     threads=options.threads, verify=options.verify,
                                     cache_ram_mib=options.cache_ram_mib,
                                     suffix_cache_mib=options.suffix_cache_mib,
                                     exact_rows=options.exact_rows, weight_form=options.weight_form))

    replica = serve.deployment(
        name="SpecdecReplica",
        ray_actor_options={"num_cpus": options.cpus_per_replica},
        # Ray routes at most this many requests to a replica at once; more wait in Ray's queue
        max_ongoing_requests=options.workers + options.max_queue,
        graceful_shutdown_timeout_s=options.shutdown_grace,  # Ray waits this long for a stopping replica's requests
        **options.scaling(),
    )(serve.ingress(replica_app)())
    return replica.bind()


def _local_environment(address: str | None) -> None:
    """Before Ray is imported: no usage statistics; a local instance stays on the loopback address
    (Ray reads RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 as "single machine": its node address is then 127.0.0.1)."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if not address:
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")


def connect(address: str | None, **local) -> None:
    """Join the Ray cluster at ``address``, or start a local instance on 127.0.0.1 (dashboard off)."""
    _local_environment(address)
    import ray

    if ray.is_initialized():
        return
    if address:
        ray.init(address=address)
    else:
        ray.init(include_dashboard=False, _node_ip_address="127.0.0.1", **local)


def start(options: RayOptions, **local):
    """Connect, start Serve's HTTP proxy on host:port and deploy; returns the ingress handle."""
    _local_environment(options.address)
    from ray import serve

    application = build_application(options)
    connect(options.address, **local)
    serve.start(http_options={"host": options.host, "port": options.port})
    return serve.run(application, name=APP_NAME, route_prefix="/")


def serve_on_ray(options: RayOptions) -> int:
    """``specdec serve --ray``: deploy, then block until Ctrl-C, then remove the application. Ctrl-C while it
    deploys (``serve.run`` waits until every replica is up, which can be after they answer) stops it alike."""
    import signal
    import time

    # SIGINT stops the server even when it was started in the background, whose shells leave SIGINT ignored (a
    # child inherits that, and Python then never raises KeyboardInterrupt: the loop below would sleep on forever)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    _local_environment(options.address)  # before Ray is imported
    import ray
    from ray import serve
    from ray.serve.exceptions import RayServeException

    try:
        start(options)
        log.info("serving %s on Ray Serve at http://%s:%d/v1 (%s replicas); Ctrl-C stops", options.model_name,
                 options.host, options.port,
                 f"{options.replicas}{'..' + str(options.max_replicas) if options.max_replicas else ''}")
        while True:
            time.sleep(1.0)
    except KeyboardInterrupt:
        pass
    finally:
        if ray.is_initialized():  # connected: remove the application, deployed or half-deployed
            try:
                serve.delete(APP_NAME)
            except RayServeException:  # Serve had not started yet: nothing to remove
                pass
    return 0
