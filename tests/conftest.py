"""Shared fixtures: the tiny ViT's constructor arguments. Markers: slow, gpu (skipped without CUDA), browser, and
cluster, which every test that asks for a `cluster` fixture (a local Ray cluster) gets here.

No torch at import time: the runtime and server tests also run in the `[serve]`-only install (`make
test-serve-only`), where torch is absent; a test that needs it imports it or skips (`pytest.importorskip`).
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import tempfile

import pytest

# One OpenMP thread for PyTorch in the test processes and the training runs they start: three workers on two
# cores, each with its own threads spinning for work, mostly waited on one another (tests/train and
# test_pipeline.py: 203 s and 308 s of CPU this way, 216 s and 338 s with PyTorch's default of a thread per
# core; 2-core VM, 2026-12-03). onnxruntime keeps its own thread pools, which the tests set themselves.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# Gradio and its client keep uploads and fetched results in GRADIO_TEMP_DIR, by default /tmp/gradio, where each run
# of the suite left about 20 folders for good: the test processes use a folder of their own, removed when each
# exits. Set before anything imports Gradio (its client reads it at import); a server that a test starts makes
# its own (`vit-serve`, `vit-train review`).
_GRADIO_TEMP = tempfile.mkdtemp(prefix="vitscope-tests-gradio-")
os.environ.setdefault("GRADIO_TEMP_DIR", _GRADIO_TEMP)
atexit.register(shutil.rmtree, _GRADIO_TEMP, ignore_errors=True)

# No gRPC fork handlers in the test processes: a worker that has used a gRPC client and then starts a child with
# `preexec_fn` (a plain fork, not vfork) had gRPC restart its poller in the child, where `close_fds` then closed
# the poller's epoll descriptor: the child aborted on "epoll_wait error: Bad file descriptor" before its exec (a
# full run's test_jobs.py child, exit -6), or hung. No test uses gRPC in a forked child; a repeat of 200 such
# starts beside gRPC calls failed 2 (grpcio 1.85, grpc/grpc#43055), and none with this set. Set, not defaulted,
# before anything imports grpc, which reads it at import; the servers, training runs and Ray nodes the tests
# start inherit it, and none of them uses gRPC in a forked child either.
os.environ["GRPC_ENABLE_FORK_SUPPORT"] = "false"


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    for item in items:  # `make test` leaves these out and `make test-cluster` runs them (CI runs both)
        if "cluster" in item.fixturenames:
            item.add_marker(pytest.mark.cluster)
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if not gpu_items or _cuda_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in gpu_items:
        item.add_marker(skip_gpu)


@pytest.fixture(scope="module", autouse=True)
def _signal_handlers_put_back():
    """Each test file leaves SIGTERM and SIGINT as it found them, fixtures included. `ray.init` makes SIGTERM exit
    with status 15 and `vit-serve`'s main makes it drain; Lightning installs its own handler only over the default
    one, so a training run stopped by SIGTERM in a later file of the same test worker exited 15, not 143."""
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    yield
    for sig, handler in before.items():
        if handler is not None:  # None: set outside Python, and not ours to put back
            signal.signal(sig, handler)


TINY = dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=5)


@pytest.fixture
def tiny_config() -> dict:
    """Constructor arguments of a tiny ViT: 4 x 4 grid, 2 blocks, 2 heads."""
    return dict(TINY)


@pytest.fixture
def tiny_model():
    """The tiny ViT with seeded random weights, in eval mode."""
    torch = pytest.importorskip("torch")
    from vit import VisionTransformer

    torch.manual_seed(0)
    return VisionTransformer(**TINY).eval()
