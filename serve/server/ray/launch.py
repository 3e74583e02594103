"""`vit-serve MODEL --ray`: deploy `serve.server.ray.deployment`'s application on a Ray cluster and hold it up.

Joins the cluster (or starts a single-node Ray), starts Ray Serve's HTTP proxy on the head node at
`--host`/`--port` unless Serve runs there already, deploys, waits until every model replica runs, prints
the URL, and on SIGTERM or Ctrl-C deletes the application again; Serve itself is shut down only when it
was started here, so a shared cluster is left as it was found.
"""

from __future__ import annotations

import logging
import signal
import threading
import time

from ray import serve

from serve.server.ray.deployment import APP_NAME, deployment
from serve.server.settings import ServeSettings

log = logging.getLogger(__name__)


def wait_for_replicas(count: int, timeout_s: float = 300.0) -> None:
    """Block until `count` model replicas run (`serve.run` returns once the application is deployed)."""
    deadline = time.monotonic() + timeout_s
    while True:
        deployments = serve.status().applications[APP_NAME].deployments
        running = deployments["ModelReplica"].replica_states.get("RUNNING", 0)
        if running >= count:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {running} of {count} model replicas run after {timeout_s} s: too few CPUs?")
        time.sleep(0.5)


def run(
    model: str,
    settings: ServeSettings,
    replicas: int,
    max_replicas: int | None,
    cpus: float,
    address: str | None,
) -> int:
    """`vit-serve --ray`: deploy on a Ray cluster, print the URL once every replica is ready, and on
    SIGTERM or Ctrl-C take the application down again (and Serve, when it was started here).

    `model`, `settings`, `replicas`, `max_replicas` and `cpus` are as for `deployment`.

    Args:
        address: the cluster to join ("auto": the one `ray start` runs on this machine); None starts
            a single-node Ray for this process, stopped on exit.

    Returns:
        The exit code: 0 once the application is deleted.
    """
    import ray

    if settings.port == 0:
        raise ValueError("--ray needs a fixed --port: it is the port of Ray Serve's HTTP proxy")
    app = deployment(model, settings, replicas, max_replicas, cpus)  # checks the counts before Ray starts
    host = address.rsplit(":", 1)[0] if address and ":" in address else ""
    # a cluster on loopback addresses (one machine): this driver joins it there too, not on the network
    on_loopback = {"_node_ip_address": host} if host.startswith("127.") else {}
    dashboard = False if address is None else None
    ray.init(address=address, logging_level=logging.WARNING, include_dashboard=dashboard, **on_loopback)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):  # after ray.init, which installs handlers of its own
        signal.signal(sig, lambda *_: stop.set())
    controller = serve_controller()
    try:
        # one proxy, on the head node, at the URL printed below (a load balancer over every node's proxy
        # is the multi-machine alternative: proxy_location="EveryNode")
        serve.start(proxy_location="HeadOnly", http_options={"host": settings.host, "port": settings.port})
        port = ray.get(serve_controller().get_http_config.remote()).port
        if port != settings.port:
            raise ValueError(f"Ray Serve on this cluster listens on port {port} already: pass --port {port}")
        serve.run(app, name=APP_NAME, route_prefix="/")
        wait_for_replicas(replicas)
        host = "127.0.0.1" if settings.host in ("0.0.0.0", "") else settings.host
        print(f"vitscope is ready: http://{host}:{port}/ (Ray Serve, {replicas} model replicas)", flush=True)
        stop.wait()
        log.info("stopping: deleting the %s application", APP_NAME)
        serve.delete(APP_NAME)
    finally:
        if controller is None:  # Serve was started here: leave the cluster as it was found
            serve.shutdown()
        elif not stop.is_set():  # failed on a cluster whose Serve runs other applications too
            serve.delete(APP_NAME)
        ray.shutdown()
    return 0


def serve_controller():
    """The cluster's Ray Serve controller actor, or None when Serve is not running there."""
    import ray
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    try:
        return ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    except ValueError:
        return None
