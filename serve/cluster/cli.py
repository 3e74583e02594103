"""`vit-predict`'s entry point: the local job (`serve.runtime.predict`), or with --ray the same job on Ray."""

from __future__ import annotations

import math
import sys

from serve.cluster.output import OutputFolder
from serve.runtime.interrupts import exit_code, sigterm_as_interrupt
from serve.runtime.jobs import collect_sources
from serve.runtime.ports import check_reachable
from serve.runtime.predict import build_parser, check_args, run_args


def main(argv: list[str] | None = None) -> int:
    """Command line entry point (`vit-predict`)."""
    p = build_parser()
    ray = p.add_argument_group("on a Ray cluster (--ray; needs pip install 'vitscope[ray]')")
    ray.add_argument("--ray", action="store_true", help="run the job with Ray Data; --out names a Parquet directory")
    ray.add_argument("--ray-address", default=None, help="a cluster to join ('auto': this machine's); default: local")
    ray.add_argument("--workers", type=int, default=1, help="actors, each with one onnxruntime session (default 1)")
    ray.add_argument("--cpus-per-worker", type=float, default=1, help="CPUs (and threads) per actor (default 1)")
    args = p.parse_args(argv)
    if not args.ray:
        return run_args(p, args)
    _check_ray_args(p, args)
    try:
        import ray.data  # noqa: F401 (the job imports it once the model has loaded: said before)

        from serve.cluster.ray_job import run_ray
    except ImportError as e:
        print(f"vit-predict: --ray needs Ray Data: pip install 'vitscope[ray]' ({e})", file=sys.stderr)
        return 2
    try:
        with sigterm_as_interrupt():  # SIGTERM stops the job as Ctrl-C does (`run_ray` sets it again over Ray's)
            sources, missing = collect_sources(args.paths, sys.stderr, args.from_list)
            done, failed = run_ray(
                args.model,
                sources,
                args.out,
                args.top_k,
                args.batch_size,
                args.workers,
                args.cpus_per_worker,
                args.ray_address,
                coverage=args.coverage,
            )
    except (ValueError, OSError) as e:  # OSError: the model or --out's folder cannot be read or written
        print(f"vit-predict: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM (`Terminated`)
        said = str(e) or "interrupted"
        print(f"vit-predict: {said}: {args.out} was not written (--ray runs the whole job again)", file=sys.stderr)
        return exit_code(e)
    failed += missing
    if failed:
        print(f"vit-predict: classified {done} images; {failed} input(s) could not be read", file=sys.stderr)
    return 1 if failed or not done else 0


def _check_ray_args(p, args) -> None:
    """The usage errors of a --ray run (exit 2), before Ray starts: the local run's, then --ray's own."""
    if args.out is not None:  # a folder here, not the local run's table: refused as --ray says, before its checks
        try:
            OutputFolder(args.out)
        except (ValueError, OSError) as e:  # OSError: a folder it cannot look into
            p.error(str(e))
    check_args(p, args)  # the local run's usage errors, before Ray starts
    if args.out is None or args.resume:
        p.error("--ray needs --out DIR.parquet (and runs the whole job: no --resume)")
    if args.workers < 1:
        p.error("--workers must be at least 1")
    if not (math.isfinite(args.cpus_per_worker) and args.cpus_per_worker > 0):
        p.error(f"--cpus-per-worker must be a finite number above 0, got {args.cpus_per_worker:g}")
    if args.threads is not None or args.decode_threads is not None:  # each actor's threads are its CPUs
        p.error("--threads and --decode-threads are for runs on one machine: with --ray, give --cpus-per-worker")
    try:
        check_reachable(args.ray_address)
    except ValueError as e:
        p.error(str(e))


if __name__ == "__main__":
    sys.exit(main())
