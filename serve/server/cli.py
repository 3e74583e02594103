"""`vit-serve model.onnx [--host 127.0.0.1] [--port 7860] ...`: the UI and the API in one process.

Every field of `ServeSettings` is an option (``--max-batch-size 16``) and an environment variable
(``VITSCOPE_MAX_BATCH_SIZE=16``); the option wins. The URL is printed once the model is loaded, warmed
up and the socket is listening. SIGTERM (or Ctrl-C) stops taking new connections, lets requests in
flight finish, drains the batcher, then exits.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from pathlib import Path

import uvicorn
from pydantic import ValidationError

from serve.server.settings import ENV_PREFIX, ServeSettings

log = logging.getLogger("vitscope.serve")


def build_parser() -> argparse.ArgumentParser:
    """The options, one per `ServeSettings` field, with the field's description as help."""
    parser = argparse.ArgumentParser(
        prog="vit-serve",
        description="Serve an exported vitscope ONNX model: Gradio UI at /, JSON API at /v1/classify, "
        "KServe v2 at /v2, health at /healthz and /readyz, Prometheus metrics at /metrics. Every option "
        f"can also be set by an environment variable, {ENV_PREFIX}<OPTION> (e.g. {ENV_PREFIX}MAX_BATCH_SIZE).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("model", type=Path, help="the .onnx file written by vit-export")
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
    ray = parser.add_argument_group("Ray Serve (pip install 'vitscope[ray]'; see serve.server.ray_serve)")
    ray.add_argument("--ray", action="store_true", help="serve the API from replicas on a Ray cluster (no UI)")
    ray.add_argument("--replicas", type=int, default=1, help="model replicas to start, and the fewest to keep")
    ray.add_argument("--max-replicas", type=int, help="most model replicas when autoscaling (None: --replicas)")
    ray.add_argument("--replica-cpus", type=float, default=1.0, help="CPUs Ray reserves for each model replica")
    ray.add_argument("--ray-address", help="cluster to join ('auto': the one ray start runs here; None: a new one)")
    return parser


def settings_from(args: argparse.Namespace) -> ServeSettings:
    """The options given on the command line, over the environment, over the defaults."""
    given = {name: getattr(args, name) for name in ServeSettings.model_fields if hasattr(args, name)}
    return ServeSettings(**given)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        settings = settings_from(args)
    except ValidationError as e:
        where = "; ".join(f"{'.'.join(map(str, err['loc'])) or 'settings'}: {err['msg']}" for err in e.errors())
        print(f"vit-serve: {where}", file=sys.stderr)
        return 2

    if args.ray:
        try:
            from serve.server.ray_launch import run
        except ImportError as e:
            print(f"vit-serve: --ray needs Ray Serve ({e}): pip install 'vitscope[ray]'", file=sys.stderr)
            return 2
        try:
            return run(str(args.model), settings, args.replicas, args.max_replicas, args.replica_cpus, args.ray_address)
        except ValueError as e:
            print(f"vit-serve: {e}", file=sys.stderr)
            return 2
    from serve.runtime.classifier import OnnxClassifier
    from serve.server.app import build_app

    try:
        classifier = OnnxClassifier(args.model, threads=settings.threads or None)
    except (FileNotFoundError, ValueError) as e:
        print(f"vit-serve: cannot load {args.model}: {e}", file=sys.stderr)
        return 2
    app = build_app(classifier, settings, with_ui=not args.no_ui)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=settings.graceful_timeout_s,
        access_log=False,
    )
    server = AnnouncingServer(config)
    # uvicorn re-raises SIGTERM after its graceful shutdown; exiting 0 then says the drain completed
    signal.signal(signal.SIGTERM, _exit_after_drain)
    server.run()
    return 0


def _exit_after_drain(signum, frame) -> None:
    raise SystemExit(0)


class AnnouncingServer(uvicorn.Server):
    """A uvicorn server that prints its URL once the model is warm and the socket listens."""

    async def startup(self, sockets=None):
        await super().startup(sockets)  # runs the app's lifespan (load, warm-up) first
        if self.started and not self.should_exit:
            port = self.config.port
            for server in getattr(self, "servers", []):
                for sock in server.sockets:
                    port = sock.getsockname()[1]  # the real port when --port 0
            host = "127.0.0.1" if self.config.host in ("0.0.0.0", "") else self.config.host
            print(f"vitscope is ready: http://{host}:{port}/", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
