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
from dataclasses import dataclass, field
from pathlib import Path

from specdec.decoding.load_options import LoadOptions
from specdec.serving.app import ServerOptions
from specdec.serving.pool import PoolOptions

APP_NAME = "specdec"
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RayOptions:
    """What ``specdec serve --ray`` deploys: each replica's server, pool and load options (the records a local
    ``specdec serve`` builds, carried whole), and the deployment's own settings."""
    bundle: str
    server: ServerOptions
    pool: PoolOptions = field(default_factory=PoolOptions)  # per replica
    load: LoadOptions = field(default_factory=LoadOptions)  # per replica
    host: str = "127.0.0.1"
    port: int = 8000
    replicas: int = 1  # fixed count, or the autoscaling minimum when max_replicas is set
    max_replicas: int | None = None  # autoscale on ongoing requests between replicas and this
    cpus_per_replica: float = 1.0  # Ray CPU reservation per replica
    address: str | None = None  # Ray cluster to join ("auto", "host:6379"); None: start a local instance

    def __post_init__(self):
        if isinstance(self.replicas, bool) or not isinstance(self.replicas, int) or self.replicas < 1:
            raise ValueError(f"replicas must be an integer >= 1, got {self.replicas!r}")
        if self.max_replicas is not None and self.max_replicas < self.replicas:
            raise ValueError(f"max_replicas ({self.max_replicas}) must be >= replicas ({self.replicas})")
        if not self.cpus_per_replica > 0:
            raise ValueError(f"cpus_per_replica must be > 0, got {self.cpus_per_replica}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if self.server.slot_save_path is not None:
            raise ValueError("slot_save_path is for one process's workers: with Ray a request reaches any replica, "
                             "whose slots are not the ones saved")

    def scaling(self) -> dict:
        """Ray Serve deployment settings: a fixed replica count, or autoscaling bounds."""
        if self.max_replicas is None:
            return {"num_replicas": self.replicas}
        return {"autoscaling_config": {"min_replicas": self.replicas, "max_replicas": self.max_replicas,
                                       "target_ongoing_requests": self.pool.workers}}


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
        from specdec.serving.app import build_app

        return build_app(bundle, options.server, options.pool, options.load)

    replica = serve.deployment(
        name="SpecdecReplica",
        ray_actor_options={"num_cpus": options.cpus_per_replica},
        # Ray routes at most this many requests to a replica at once; more wait in Ray's queue
        max_ongoing_requests=options.pool.workers + options.pool.max_queue,
        # Ray waits this long for a stopping replica's requests
        graceful_shutdown_timeout_s=options.server.shutdown_grace,
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
        log.info("serving %s on Ray Serve at http://%s:%d/v1 (%s replicas); Ctrl-C stops", options.server.model_name,
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
