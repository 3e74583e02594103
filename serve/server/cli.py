"""`vit-serve model.onnx|REPOSITORY [--host 127.0.0.1] [--port 7860] ...`: the UI and the API in one process.

Every field of `ServeSettings` is an option (``--max-batch-size 16``) and an environment variable
(``VITSCOPE_MAX_BATCH_SIZE=16``); the option wins. The URL is printed once the model is loaded, warmed
up and the socket is listening. SIGTERM (or Ctrl-C) stops taking new connections, lets requests in
flight finish, drains the batcher, then exits: 0 when everything drained in time, 1 when
`graceful_timeout_s` ran out first.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import signal
import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import uvicorn
from pydantic import ValidationError
from uvicorn.config import STARTUP_FAILURE

from serve.runtime.jobs import usable_cores
from serve.runtime.ports import check_port
from serve.runtime.temp_dirs import OwnedTempDir
from serve.server.access_log import ACCESS_LOG, logging_off_the_loop
from serve.server.http.guard import LOOPBACK_HOSTS
from serve.server.http.probes import ProbeServer
from serve.server.http.protocol import LimitedHttpToolsProtocol
from serve.server.settings import ENV_PREFIX, ServeSettings

if TYPE_CHECKING:  # the repository (and onnxruntime with it) is imported once the arguments are read
    from serve.server.repository.repository import ModelRepository

log = logging.getLogger("vitscope.serve")
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)


def build_parser() -> argparse.ArgumentParser:
    """The options, one per `ServeSettings` field, with the field's description as help."""
    parser = argparse.ArgumentParser(
        prog="vit-serve",
        description="Serve an exported vitscope ONNX model: Gradio UI at /, JSON API at /v1/classify, "
        "KServe v2 at /v2, health at /healthz and /readyz, Prometheus metrics at /metrics. Every option "
        f"can also be set by an environment variable, {ENV_PREFIX}<OPTION> (e.g. {ENV_PREFIX}MAX_BATCH_SIZE).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "model",
        type=Path,
        help="the .onnx file written by vit-export, or a model repository folder (<name>/<version>/model.onnx, "
        "as vit-export --triton-repo writes it)",
    )
    for name, field in ServeSettings.model_fields.items():
        flag = f"--{name.replace('_', '-')}"
        text = (field.description or "").replace("%", "%%")  # argparse formats help with %
        # SUPPRESS: an option not given stays out of the namespace, so the environment can set it
        if field.annotation is bool:  # --opentelemetry / --no-opentelemetry
            action = argparse.BooleanOptionalAction
            parser.add_argument(
                flag, action=action, default=argparse.SUPPRESS, help=f"{text} (default: {field.default})"
            )
        else:
            kind = field.annotation if field.annotation in (int, float) else str
            parser.add_argument(flag, type=kind, default=argparse.SUPPRESS, help=f"{text} (default: {field.default})")
    parser.add_argument("--no-ui", action="store_true", help="serve the API only, without the Gradio UI")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    ray = parser.add_argument_group("Ray Serve (pip install 'vitscope[ray]'; see serve.server.ray.deployment)")
    ray.add_argument("--ray", action="store_true", help="serve the API from replicas on a Ray cluster (no UI)")
    ray.add_argument(
        "--replicas", type=int, default=1, help="model replicas to start (of each model of a folder), the fewest kept"
    )
    ray.add_argument("--max-replicas", type=int, help="most model replicas when autoscaling (None: --replicas)")
    ray.add_argument("--replica-cpus", type=float, default=1.0, help="CPUs Ray reserves for each model replica")
    ray.add_argument("--ray-address", help="cluster to join ('auto': the one ray start runs here; None: a new one)")
    ray.add_argument("--models", help="with a repository folder: the models to deploy, comma-separated (None: all)")
    return parser


def settings_from(args: argparse.Namespace) -> ServeSettings:
    """The options given on the command line, over the environment, over the defaults."""
    given = {name: getattr(args, name) for name in ServeSettings.model_fields if hasattr(args, name)}
    return ServeSettings(**given)


def _check_payload_log(path: str) -> None:
    """Refuse a payload log this server cannot create: its folder is the operator's to make, as for nginx's logs (a
    missing one failed the start with a traceback). Not on a Ray cluster joined: the ingress writes it, on its node."""
    if path and os.path.isdir(path):
        raise ValueError(
            f"--payload-log {path} is a folder: give a file in it, such as {os.path.join(path, 'payloads.jsonl')}"
        )
    folder = os.path.dirname(os.path.abspath(path)) if path else ""
    if folder and not os.path.isdir(folder):
        raise ValueError(
            f"--payload-log: the folder {folder} does not exist: create it (mkdir -p {folder}) or log elsewhere"
        )


def _run_on_ray(args, settings: ServeSettings) -> int:
    """`vit-serve --ray`: the file or repository on Ray Serve (`serve.server.ray.launch`)."""
    try:
        from serve.server.ray.launch import run
    except ImportError as e:
        print(f"vit-serve: --ray needs Ray Serve ({e}): pip install 'vitscope[ray]'", file=sys.stderr)
        return 2
    try:
        if args.ray_address is None and not os.environ.get("RAY_ADDRESS"):  # a Ray started here: the log is here
            _check_payload_log(settings.payload_log)
        models = [m for m in args.models.split(",") if m] if args.models else None
        return run(
            str(args.model), settings, args.replicas, args.max_replicas, args.replica_cpus, args.ray_address, models
        )
    except ValueError as e:
        print(f"vit-serve: {e}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        settings = settings_from(args)
    except ValidationError as e:
        print(f"vit-serve: {_settings_error(e)}", file=sys.stderr)
        return 2

    if args.ray:  # the replicas' threads run on the cluster's nodes, not here
        return _run_on_ray(args, settings)
    try:
        _check_payload_log(settings.payload_log)
        if not args.no_ui:
            settings.check_ui_budget()
        models = _loaded(args.model, settings)
    except ValueError as e:
        print(f"vit-serve: {e}", file=sys.stderr)
        return 2
    try:
        _check_ports(settings)
    except ValueError as e:
        print(f"vit-serve: did not start: {e}", file=sys.stderr)
        return STARTUP_FAILURE
    from serve.server.app import build_app

    _warn_if_exposed(settings)
    _return_freed_memory()
    # Gradio's uploads and results go to a folder of this server's own, deleted when it exits (and by the next
    # server, if this one is killed). Gradio reads GRADIO_TEMP_DIR when it is imported, so it is set before
    # build_app imports it.
    temp_dir, probes = OwnedTempDir("vitscope-ui-"), None
    os.environ["GRADIO_TEMP_DIR"] = str(temp_dir.path)
    try:
        app = build_app(models, settings, with_ui=not args.no_ui)
        server = AnnouncingServer(uvicorn_config(app, settings, args.log_level), app.state.repository)
        server.note = " (no UI: POST /v1/classify, the API's pages at /docs)" if args.no_ui else ""
        if settings.probe_port:
            ready, loop = (lambda: app.state.repository.ready), (lambda: getattr(app.state, "loop", None))
            probes = ProbeServer(
                settings.host, settings.probe_port, ready, loop, max_connections=settings.probe_max_connections
            ).start()
        # uvicorn re-raises SIGTERM after its graceful shutdown: exit 0 if everything drained, else 1
        signal.signal(signal.SIGTERM, lambda signum, frame: _exit_after_drain(server, app))
        logging.getLogger("uvicorn.error").addFilter(startup := StartupReason())
        try:
            with logging_off_the_loop():  # a stalled stderr must not block the event loop
                server.run()
        except SystemExit:  # uvicorn's when the start-up fails: a model with --exit-on-error, a port in use
            if server.started:
                raise
        if not server.started:
            why = getattr(app.state, "startup_error", None) or startup.reason or "see the log above"
            print(f"vit-serve: did not start: {why}", file=sys.stderr)
            return STARTUP_FAILURE
    finally:
        if probes is not None:
            probes.stop()
        temp_dir.remove()
    return 0


def _settings_error(e: ValidationError) -> str:
    """The settings' errors in one line, each after the setting it is about."""
    return "; ".join(
        f"{'.'.join(map(str, err['loc'])) or 'settings'}: {err['msg'].removeprefix('Value error, ')}"
        for err in e.errors()
    )


def _check_ports(settings: ServeSettings) -> None:
    """Refuse a port the server would listen on that another program holds (`check_port`), before the models warm
    up (minutes for a large repository): uvicorn binds only after, and gRPC after it (on "[::]", IPv4 too)."""
    for flag, port in (
        ("--port", settings.port),
        ("--grpc-port", settings.grpc_port),
        ("--probe-port", settings.probe_port),
    ):
        if port:
            check_port(settings.host, port, flag, dual_stack=flag == "--grpc-port")


def _loaded(model: Path, settings: ServeSettings):
    """What `main` serves: the model file loaded, or the repository folder with its layout checked.

    Raises:
        ValueError: more onnxruntime threads than cores (they would only queue for them, each a thread), or a
            model that cannot load (the message says which).
    """
    from serve.runtime.classifier import OnnxClassifier
    from serve.server.repository.layout import model_order

    if settings.threads > (cores := usable_cores()):
        limit = f"0 (by model size) to {cores} (this machine's cores)"
        raise ValueError(f"threads: must be {limit}, got {settings.threads}")
    try:
        if model.is_dir():
            model_order(model, settings.default_model)  # the layout, checked before anything loads
            return model
        return OnnxClassifier(model, threads=settings.threads or None)
    except (FileNotFoundError, ValueError) as e:
        raise ValueError(f"cannot load {model}: {e}") from None


class StartupReason(logging.Filter):
    """On uvicorn's log: `reason` is the first error it logged (a traceback's last line), which `main` repeats as
    the last line of a server that did not start, whatever stopped it (a model with --exit-on-error, a port in use).
    When a model failed to load (the user's file, not a fault of the server), its traceback is logged as that
    reason alone: it says what to fix."""

    def __init__(self):
        super().__init__()
        self.reason: str | None = None

    def filter(self, record: logging.LogRecord) -> bool:
        from serve.server.repository.version import LoadFailure  # the server's modules load once the cli has parsed

        if record.levelno < logging.ERROR:
            return True
        text = record.getMessage()
        last = text.rstrip().rsplit("\n", 1)[-1]
        if text.startswith("Traceback") and last.startswith(f"{LoadFailure.__module__}.LoadFailure: "):
            last = last.split(": ", 1)[1]
            record.msg, record.args = last, ()
        self.reason = self.reason or last
        return True


def uvicorn_config(app, settings: ServeSettings, log_level: str) -> uvicorn.Config:
    """uvicorn with our connection limits (`LimitedHttpToolsProtocol`), and no Server header."""
    from serve.server.app import connection_shares  # imported once the app is, as in `main`

    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=log_level,
        http=LimitedHttpToolsProtocol,
        timeout_keep_alive=settings.keep_alive_s,
        timeout_graceful_shutdown=settings.graceful_timeout_s,
        access_log=False,  # RequestRecord writes one line per request, with its ID
        server_header=False,
    )
    http_share, _ = connection_shares(settings)  # gRPC's connections come out of the same budget
    config.limits = replace(settings.connection_limits(), max_connections=http_share)  # read by the protocol
    return config


def _return_freed_memory() -> None:
    """Have glibc give large freed blocks back to the system at once (Linux only).

    Decoding a large image allocates hundreds of MB in the decoding thread's malloc arena. glibc raises
    its mmap threshold after such blocks are freed and keeps later ones in per-thread arenas, so with
    many threads the process grew by several times the decode budget and stayed there, where a fixed 1 MiB
    threshold keeps it near the budget.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return  # not glibc: nothing to tune
    libc.mallopt(M_MMAP_THRESHOLD, 1 << 20)


def _warn_if_exposed(settings: ServeSettings) -> None:
    if settings.host not in LOOPBACK_HOSTS and not settings.api_key.get_secret_value():
        log.warning(
            "listening on %s without an API key: anyone who can reach this port can use the server. Set "
            "%sAPI_KEY, or keep it on 127.0.0.1 behind a reverse proxy (README, Deploying safely)",
            settings.host,
            ENV_PREFIX,
        )
    if settings.host in ("0.0.0.0", "::") and not settings.allowed_hosts:
        log.warning(
            "listening on every interface, but only the Host names localhost and 127.0.0.1 are answered: "
            "pass --allowed-hosts with the name clients use"
        )


def _exit_after_drain(server: AnnouncingServer, app) -> None:
    drained = server.drained and getattr(app.state, "drained", True)
    if not drained:
        log.error("the drain did not finish within graceful_timeout_s; requests in flight were cut off")
    raise SystemExit(0 if drained else 1)


class AnnouncingServer(uvicorn.Server):
    """A uvicorn server that prints its URL once the model is warm and the socket listens, marks `repository` as
    stopping (not ready) as soon as SIGTERM or Ctrl-C arrives, and knows whether its shutdown drained every
    connection in time (`drained`)."""

    drained = False
    note = ""  # after the URL: what it serves when that is not the UI

    def __init__(self, config: uvicorn.Config, repository: ModelRepository | None = None):
        super().__init__(config)
        self.repository = repository

    def handle_exit(self, sig, frame) -> None:
        # not ready from the signal on (probes, load balancers, gRPC's ServerReady), not once the drain is done
        if self.repository is not None:
            self.repository.stopping = True
        super().handle_exit(sig, frame)

    async def _wait_tasks_to_complete(self) -> None:
        # uvicorn cancels this wait when graceful_timeout_s runs out: reaching the end means drained
        await super()._wait_tasks_to_complete()
        self.drained = True

    async def startup(self, sockets=None):
        await super().startup(sockets)  # runs the app's lifespan (load, warm-up) first
        if self.started and not self.should_exit:
            port = self.config.port
            for server in getattr(self, "servers", []):
                for sock in server.sockets:
                    port = sock.getsockname()[1]  # the real port when --port 0
            host = "127.0.0.1" if self.config.host in ("0.0.0.0", "") else self.config.host
            ACCESS_LOG.drain(timeout=2.0)  # the start-up's log lines first (`logging_off_the_loop` queues them)
            print(f"vitscope is ready: http://{host}:{port}/{self.note}", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
