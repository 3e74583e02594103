"""What the tests share: tiny real images, the tiny trained model, a raw-socket HTTP reader, and (from
`serve.server.testing`, which the benchmarks use too) the server process, PNG encoder, metrics reader and
the poll under a deadline. Nothing here imports torch at import time, so the `[serve]`-only install runs it.

    .venv/bin/python -m tests.helpers --tiny-onnx build/tiny.onnx --tiny-repo build/models  # for the [serve]-only venv
"""

from __future__ import annotations

import argparse
import io
import json
import re
import socket
import struct
import threading
import zlib
from pathlib import Path

import numpy as np
from PIL import Image

from serve.runtime.images import Preprocess
from serve.server.testing import (
    LocalRayCluster,
    ServerProcess,
    cpu_seconds,
    free_port,
    json_lines,
    noise_png,
    png_bytes,
    read_metric,
    rss_mib,
    tiny_gif,
    wait_until,
)

__all__ = [
    "CLASS_NAMES",
    "CONFIGS",
    "LocalRayCluster",
    "REPO",
    "ServerProcess",
    "TINY_NET",
    "cpu_seconds",
    "bright_square",
    "encoded",
    "free_port",
    "huge_png_header",
    "json_lines",
    "mixed_images",
    "noise_png",
    "png_bytes",
    "quadrant_images",
    "read_metric",
    "peak_mib",
    "read_response",
    "reset_peak",
    "rss_mib",
    "server_has_read",
    "shape_image",
    "thread_name",
    "tiny_gif",
    "wait_until",
    "write_shapes",
    "write_tiny_run",
]

REPO = Path(__file__).resolve().parents[1]
CONFIGS = sorted((REPO / "configs").glob("*.yaml"))

# The tiny serving model: which quadrant of a 32 x 32 image holds a bright square.
CLASS_NAMES = ["top_left", "top_right", "bottom_left", "bottom_right"]
TINY_NET = dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=len(CLASS_NAMES))


def thread_name(task: Path) -> str:
    """A thread's name from its /proc/PID/task/TID folder, or "" for one that ended since the folder was listed."""
    try:
        return (task / "comm").read_text().strip()
    except FileNotFoundError:
        return ""


def quadrant_images(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """n (32, 32, 3) uint8 images, each with a bright 12-pixel square in one quadrant, and their labels."""
    rng = np.random.default_rng(seed)
    labels = np.arange(n) % len(CLASS_NAMES)
    images = rng.integers(0, 80, (n, 32, 32, 3), dtype=np.uint8)
    for img, label in zip(images, labels, strict=True):
        r, c = divmod(int(label), 2)
        y, x = 16 * r + rng.integers(0, 5), 16 * c + rng.integers(0, 5)
        img[y : y + 12, x : x + 12] = rng.integers(180, 256, 3, dtype=np.uint8)
    return images, labels


def encoded(image: Image.Image | np.ndarray, fmt: str, **options) -> bytes:
    """`image` saved in format `fmt` ("JPEG", "TIFF", ...) with Pillow's save `options`."""
    buf = io.BytesIO()
    (image if isinstance(image, Image.Image) else Image.fromarray(image)).save(buf, format=fmt, **options)
    return buf.getvalue()


def huge_png_header(width: int = 100_000, height: int = 100_000) -> bytes:
    """A valid PNG whose header claims a huge size: a decompression bomb must be refused from the header."""
    raw = png_bytes(np.zeros((1, 1, 3), np.uint8))
    chunk = b"IHDR" + struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return raw[:8] + struct.pack(">I", 13) + chunk + struct.pack(">I", zlib.crc32(chunk)) + raw[33:]


def bright_square(quadrant: int) -> np.ndarray:
    """A (32, 32, 3) image with a bright square in one quadrant, without noise (the tiny model's classes)."""
    img = np.full((32, 32, 3), 30, np.uint8)
    r, c = divmod(quadrant, 2)
    img[16 * r + 2 : 16 * r + 14, 16 * c + 2 : 16 * c + 14] = 230
    return img


def mixed_images(seed: int = 0) -> list[Image.Image]:
    """Five random images of the sizes and modes uploads come in: RGB, odd sizes, L, RGBA, a 16-colour palette."""
    rng = np.random.default_rng(seed)
    images = []
    for H, W, mode in [(32, 32, "RGB"), (45, 70, "RGB"), (100, 33, "L"), (64, 64, "RGBA"), (17, 29, "P")]:
        img = Image.fromarray(rng.integers(0, 256, (H, W, 4), dtype=np.uint8), "RGBA")
        images.append(img.convert(mode) if mode != "P" else img.convert("RGB").quantize(16))
    return images


CALIB_IMAGES = 120  # the tiny run's calibration split: sets up to coverage 120/121


def _write_pngs(folder: Path, images: np.ndarray, labels: np.ndarray) -> list[dict]:
    """images as folder/<class>/<i>.png; their split.json entries."""
    entries = []
    for i, (img, label) in enumerate(zip(images, labels, strict=True)):
        path = folder / CLASS_NAMES[label] / f"{i:03d}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(img).save(path)
        entries.append({"path": str(path), "label": int(label)})
    return entries


def write_tiny_run(root: Path, steps: int = 600, **net_args) -> Path:
    """Train the tiny network (`TINY_NET` with `net_args`) for `steps` plain-torch steps (a few seconds) and write a
    run folder into `root`: checkpoints/best.ckpt (the contract format), split.json and its validation and
    calibration PNGs (the split `vit-export` calibrates the file on). Returns `root`."""
    import torch

    from vit import VisionTransformer

    preprocess = Preprocess(img_size=(32, 32), crop_pct=1.0, interpolation="bicubic")
    torch.manual_seed(0)
    net = VisionTransformer(**TINY_NET, **net_args)
    images, labels = quadrant_images(256)
    x, y = torch.from_numpy(preprocess.normalize(images)), torch.from_numpy(labels)
    opt = torch.optim.AdamW(net.parameters(), lr=3e-3)
    net.train()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: one thread is several times faster on a busy 2-core machine
    for step in range(steps):  # 300 left it at 21 of 24 on some CPUs: float kernels differ by processor
        idx = torch.randint(0, len(x), (32,), generator=torch.Generator().manual_seed(step))
        loss = torch.nn.functional.cross_entropy(net(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    torch.set_num_threads(threads)
    net.eval()

    val = _write_pngs(root / "data", *quadrant_images(24, seed=1))
    calib = _write_pngs(root / "calib", *quadrant_images(CALIB_IMAGES, seed=2))
    (root / "split.json").write_text(json.dumps({"train": [], "val": val, "calib": calib}))
    meta = {
        "model_config": net.config,
        "class_names": CLASS_NAMES,
        "preprocess": preprocess.to_dict(),
        "weights_prefix": "net.",
        "variant": "tiny_test",
        "versions": {"torch": str(torch.__version__)},
    }
    (root / "checkpoints").mkdir(parents=True, exist_ok=True)
    state = {"net." + k: v for k, v in net.state_dict().items()}
    torch.save({"state_dict": state, "vitscope": meta}, root / "checkpoints" / "best.ckpt")
    return root


def shape_image(kind: int, rng: np.random.Generator, size: int = 32) -> Image.Image:
    """A dark shape on white paper: 0 horizontal bar, 1 vertical bar, 2 square outline; position jittered."""
    a = np.full((size, size), 255, np.uint8)
    c = size // 2 + int(rng.integers(-4, 5))
    d = size // 2 + int(rng.integers(-4, 5))
    if kind == 0:
        a[c - 2 : c + 2, 4:-4] = 0
    elif kind == 1:
        a[4:-4, d - 2 : d + 2] = 0
    else:
        a[c - 8 : c + 8, d - 8 : d + 8] = 0
        a[c - 6 : c + 6, d - 6 : d + 6] = 255
    noise = rng.integers(0, 40, a.shape)
    return Image.fromarray(np.clip(a.astype(int) + noise - 20, 0, 255).astype(np.uint8), "L").convert("RGB")


def write_shapes(
    root: Path, per_class: int = 30, classes: tuple[str, ...] = ("bar", "column", "square"), seed: int = 0
) -> Path:
    """root/<class>/NNN.png: `per_class` 32 x 32 shape images per class (`shape_image`); returns `root`."""
    rng = np.random.default_rng(seed)
    for kind, name in enumerate(classes):
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            shape_image(kind % 3, rng).save(root / name / f"{i:03d}.png")
    return root


class ClientLoop:
    """`clients` threads, each running `run(i)` (a loop until `stopping` is set), started on entering the block
    and joined on leaving it; what they record goes into `answers`."""

    join_s = 60.0

    def __init__(self, clients: int):
        self.answers: list[tuple] = []
        self.stopping = threading.Event()
        self.threads = [threading.Thread(target=self.run, args=(i,), daemon=True) for i in range(clients)]

    def run(self, i: int) -> None:
        raise NotImplementedError

    def sent_after(self, t: float) -> list[tuple]:
        """The answers to requests sent after `t` (`time.monotonic()`), for loops whose answers end with the time
        their request was sent: answers are kept in the order they come back, not the order they were sent."""
        return [a for a in self.answers if a[-1] > t]

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stopping.set()
        for t in self.threads:
            t.join(self.join_s)


def read_response(s: socket.socket) -> bytes:
    """One whole HTTP response with a Content-Length from a raw socket: its head and body may arrive in
    separate segments, so one `recv` is not enough."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        assert chunk, f"the connection closed before a whole response: {data!r}"
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    length = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))
    while len(body) < length and (chunk := s.recv(65536)):
        body += chunk
    assert len(body) == length, f"the body is not Content-Length ({length}) bytes: {body!r}"
    return head + b"\r\n\r\n" + body


def _tcp_connections() -> list[tuple[int, int, int, int]]:
    """(local port, remote port, bytes not yet acknowledged, bytes not yet read) of each established IPv4 TCP
    connection on this machine, from Linux's /proc/net/tcp."""
    rows = []
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        _, local, remote, state, queues, *_ = line.split()
        if state == "01":  # ESTABLISHED
            unacked, unread = (int(q, 16) for q in queues.split(":"))
            rows.append((int(local.rsplit(":", 1)[1], 16), int(remote.rsplit(":", 1)[1], 16), unacked, unread))
    return rows


def peak_mib(pid: int) -> float:
    """The process's peak resident memory (VmHWM) since it started or since `reset_peak`."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024


def reset_peak(pid: int) -> None:
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")  # the kernel's reset of VmHWM


def server_has_read(port: int, connections: int = 1) -> bool:
    """True once `connections` or more clients are connected to the server on `port` and it has read every byte
    they sent: a request sent in part is then in the server's hands, not in a socket buffer."""
    rows = _tcp_connections()
    served = [unread for local, _, _, unread in rows if local == port]
    sent = [unacked for _, remote, unacked, _ in rows if remote == port]
    return len(served) >= connections and not any(served) and not any(sent)


def server_holds(port: int, client_port: int) -> bool:
    """Whether the server on `port` still holds the connection from the client socket on `client_port` (once the
    server has let go, the kernel may still be sending it what was written: the client's side looks open)."""
    return any((local, remote) == (port, client_port) for local, remote, _, _ in _tcp_connections())


def main() -> None:
    p = argparse.ArgumentParser(description="Build test fixtures that need torch, for a venv without it.")
    p.add_argument("--tiny-onnx", type=Path, required=True, help="where to write the tiny model's .onnx file")
    p.add_argument("--tiny-repo", type=Path, help="where to write a model repository holding it as `alpha`, version 1")
    args = p.parse_args()
    from serve.export.cli import export_onnx
    from serve.export.cli import main as export_main

    run = write_tiny_run(args.tiny_onnx.parent / "tiny_run")
    export_onnx(run / "checkpoints" / "best.ckpt", args.tiny_onnx)
    if args.tiny_repo:
        out = args.tiny_repo.parent / "alpha.onnx"
        argv = [str(run / "checkpoints" / "best.ckpt"), "-o", str(out), "--triton-repo", str(args.tiny_repo)]
        if export_main([*argv, "--no-gradients"]) != 0:
            raise SystemExit("vit-export --triton-repo failed for the tiny model")


if __name__ == "__main__":
    main()
