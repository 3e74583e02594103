"""`vit-serve MODEL --ray` and `vit-serve DIR --ray`: deploy on a Ray cluster and hold the deployment up.

Joins the cluster (or starts a single-node Ray), starts Ray Serve's HTTP proxy on the head node at
`--host`/`--port` unless Serve runs there already, deploys, waits until every model replica runs, prints
the URL, and on SIGTERM or Ctrl-C deletes the applications again; Serve itself is shut down only when it
was started here, so a shared cluster is left as it was found.

A model file is one application (`serve.server.ray.deployment`). A model repository folder is one
application per model and an ingress (`serve.server.ray.repository`), kept in step with the folder every
`--repository-poll-s` seconds by rolling updates (`serve.server.ray.rollout`).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from pathlib import Path

from ray import serve

from serve.runtime.interrupts import EXIT_INTERRUPTED  # the shell's status for Ctrl-C, as vit-predict exits
from serve.runtime.ports import check_port, check_reachable
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


class OneModel:
    """One .onnx file as one application (`serve.server.ray.deployment`); arguments as for `deployment`."""

    def __init__(self, model: str, settings: ServeSettings, replicas: int, max_replicas: int | None, cpus: float):
        from serve.runtime.classifier import OnnxClassifier
        from serve.server.engine import Engine
        from serve.server.repository.version import LoadFailure, load_ready

        try:  # the file's checks, as `vit-serve FILE` makes them: each replica would fail in a traceback of its own
            classifier = OnnxClassifier(model, threads=1)
            check = settings.model_copy(update={"preferred_batch_size": 1})  # a check, not a measurement
            load_ready(classifier, Engine(classifier, check), "model", "1").engine.stop()  # its answers are finite
        except (FileNotFoundError, ValueError, LoadFailure) as e:
            raise ValueError(f"cannot load {model}: {str(e).removeprefix(f'{model}: ')}") from None
        self.app = deployment(model, settings, replicas, max_replicas, cpus)  # checks the counts before Ray starts
        self.replicas, self.cpus = replicas, cpus
        self.placing = threading.Event()  # never set: a file is deployed once, before `run`'s `deployed`
        self.stopping = threading.Event()  # set by Ctrl-C or SIGTERM (`run`)

    def deploy(self) -> None:
        serve.run(self.app, name=APP_NAME, route_prefix="/")
        wait_for_replicas(self.replicas)

    def describe(self) -> str:
        return f"{self.replicas} model replicas"

    def cpus_needed(self) -> float:
        return self.replicas * self.cpus

    def sync(self) -> None:
        """A file is deployed once: nothing to follow."""

    def delete(self) -> None:
        serve.delete(APP_NAME)


def run(
    model: str,
    settings: ServeSettings,
    replicas: int,
    max_replicas: int | None,
    cpus: float,
    address: str | None,
    models: list[str] | None = None,
) -> int:
    """`vit-serve --ray`: deploy on a Ray cluster, print the URL once every replica is ready, follow a
    repository folder every `settings.repository_poll_s` seconds, and on SIGTERM or Ctrl-C take the
    applications down again (and Serve, when it was started here).

    `model` (a file or a repository folder), `settings`, `replicas`, `max_replicas` and `cpus` are as for
    `deployment` and `RepositoryRollout`.

    Args:
        address: the cluster to join ("auto": the one `ray start` runs on this machine); None starts
            a single-node Ray for this process, stopped on exit.
        models: with a repository folder, the models to serve (None: all of them).

    Returns:
        The exit code: 0 once the applications are deleted.
    """
    import ray

    if settings.port == 0:
        raise ValueError("--ray needs a fixed --port: it is the port of Ray Serve's HTTP proxy")
    if settings.grpc_port:  # each replica's app would bind the same port
        raise ValueError("--grpc-port is served without --ray only: run gRPC from a plain vit-serve")
    target = target_of(model, settings, replicas, max_replicas, cpus, models)  # checked before Ray starts
    check_reachable(address)
    if address is None and not os.environ.get("RAY_ADDRESS"):  # a Ray of its own: Serve's proxy binds here
        check_port(settings.host, settings.port)
    join_ray(address)
    stop, deployed = target.stopping, threading.Event()

    def on_signal(*_) -> None:
        stop.set()
        # the first deploy, or a later rollout's serve.run, may be waiting for replicas the cluster has no room for
        if not deployed.is_set() or target.placing.is_set():
            raise KeyboardInterrupt

    controller = serve_controller()
    for sig in (signal.SIGTERM, signal.SIGINT):  # after ray.init, which installs handlers of its own
        signal.signal(sig, on_signal)
    try:
        check_room(target.cpus_needed(), address)
        deploy_and_follow(target, settings, stop, deployed)
        log.info("stopping: deleting the applications")
    except KeyboardInterrupt:
        log.warning("stopped before every replica %s up", "of a rollout was" if deployed.is_set() else "was")
        return EXIT_INTERRUPTED
    finally:
        if controller is None:  # Serve was started here: leave the cluster as it was found
            serve.shutdown()
        else:  # a cluster whose Serve runs other applications too: ours go, whatever happened
            target.delete()
        ray.shutdown()
    return 0


def join_ray(address: str | None) -> None:
    """`ray.init` the cluster at `address` (None: a single-node Ray for this process, without its dashboard)."""
    import ray

    host = address.rsplit(":", 1)[0] if address and ":" in address else ""
    # a cluster on loopback addresses (one machine): this driver joins it there too, not on the network
    on_loopback = {"_node_ip_address": host} if host.startswith("127.") else {}
    dashboard = False if address is None else None
    ray.init(address=address, logging_level=logging.WARNING, include_dashboard=dashboard, **on_loopback)


def deploy_and_follow(target, settings: ServeSettings, stop: threading.Event, deployed: threading.Event) -> None:
    """Start Ray Serve's proxy, deploy `target` (then set `deployed`), print the URL, and follow the folder until
    `stop` is set.

    Raises:
        ValueError: Ray Serve runs on this cluster at another port.
    """
    import ray

    # one proxy, on the head node, at the URL printed below (a load balancer over every node's proxy
    # is the multi-machine alternative: proxy_location="EveryNode")
    # the proxy closes an idle connection as vit-serve does (Ray Serve's default keeps one for 90 s)
    http = {"host": settings.host, "port": settings.port, "keep_alive_timeout_s": settings.keep_alive_s}
    serve.start(proxy_location="HeadOnly", http_options=http)
    port = ray.get(serve_controller().get_http_config.remote()).port
    if port != settings.port:
        raise ValueError(f"Ray Serve on this cluster listens on port {port} already: pass --port {port}")
    target.deploy()
    deployed.set()
    host = "127.0.0.1" if settings.host in ("0.0.0.0", "") else settings.host
    print(f"vitscope is ready: http://{host}:{port}/ (Ray Serve, {target.describe()})", flush=True)
    follow(target, stop, settings.repository_poll_s)


def check_room(cpus: float, address: str | None) -> None:
    """Refuse replicas that do not fit the CPUs of a cluster started here (Ray would wait for them for ever);
    on a cluster joined, which may add nodes, only warn.

    Raises:
        ValueError: they do not fit, and `address` is None.
    """
    import ray

    have = ray.cluster_resources().get("CPU", 0.0)
    if cpus <= have:
        return
    why = f"the model replicas reserve {cpus:g} CPUs (--replicas x --replica-cpus, each model) and Ray has {have:g}"
    if address is None:
        raise ValueError(f"{why}: lower --replicas or --replica-cpus")
    log.warning("%s: waiting for it to add nodes (Ctrl-C stops)", why)


def target_of(model: str, settings: ServeSettings, replicas: int, max_replicas: int | None, cpus: float, models):
    """What `run` deploys: a `RepositoryRollout` for a folder, else `OneModel`."""
    if Path(model).is_dir():
        from serve.server.ray.rollout import RepositoryRollout

        return RepositoryRollout(Path(model), settings, models, replicas, max_replicas, cpus)
    if models:
        raise ValueError("--models picks models of a repository folder; a .onnx file is one model")
    return OneModel(model, settings, replicas, max_replicas, cpus)


def follow(target, stop: threading.Event, poll_s: float) -> None:
    """Until `stop` is set, `target.sync()` every `poll_s` seconds (0: never); a failed poll is logged, and the
    next one tries again."""
    while not stop.wait(poll_s or None):
        try:
            target.sync()
        except Exception:
            log.exception("the repository poll failed; what was deployed keeps serving")


def serve_controller():
    """The cluster's Ray Serve controller actor, or None when Serve is not running there."""
    import ray
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    try:
        return ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    except ValueError:
        return None
