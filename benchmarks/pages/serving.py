"""The sections of the serving, peers, model server, batch scoring, browser and calibration pages."""

from __future__ import annotations

from benchmarks.pages.outline import Part, Section

SECTIONS = (
    Section(
        "The server against an older one, and against the model in-process",
        "serving",
        """\
```bash
mkdir -p /tmp/vitscope-9382f68 && git archive 9382f68 | tar -x -C /tmp/vitscope-9382f68
```

Two source trees, each running its own `vit-serve` on the same model, in alternating rounds of the harness's
HTTP load generator at concurrency 16; the same tree twice gives the noise. The in-process row is `OnnxClassifier`
decoding the same PNG and classifying batches of 8 in this process, on the same cores, in the same rounds.""",
        (
            Part("serve_ab", "The digits sample"),
            Part("serve_ab_vit_tiny_patch16_224", "ViT-Ti/16 with random weights"),
        ),
    ),
    Section(
        "Peers: vit-serve, LitServe, Ray Serve",
        "peers",
        """\
The same ONNX file (the sample's architecture, random weights) behind each server, 16 keep-alive clients, batches
of up to 8. vit-serve is paired with each peer in turn, the two up at once and rounds alternating; "beyond model" is
the server's CPU per request less what the model (and decoding, for uploads) costs in-process. LitServe and Ray
Serve install with `pip install 'vitscope[bench]'`.""",
        (
            Part("serve_peers", "The load generators beside the servers, on both cores"),
            Part(
                "serve_peers_pinned",
                "Pinned: the servers on one core, the load generators on the other (`--pin`)",
                "Neither server pays for its clients' CPU here, so throughput follows the server's own CPU per "
                "request.",
            ),
        ),
    ),
    Section(
        "gRPC against HTTP v2 binary tensors",
        "peers",
        "The `HTTP v2 binary tensor` and `gRPC raw tensor` rows of the peers tables: the same pixels, the same "
        "server, alternating rounds. The gRPC client is `grpc.aio`, whose own CPU comes out of the shared cores, so "
        "the pinned table, where the clients have a core of their own, is the one that compares the protocols.",
    ),
    Section(
        "Polled rollouts under load (soak)",
        "model-server",
        "`vit-serve DIR --repository-poll-s` under 16 keep-alive clients while new versions are copied in one after "
        "another, each awaited until it answers. Memory and threads must come back to where they were: every rollout "
        "retires a session.",
        (Part("rollout_soak"),),
    ),
    Section(
        "/healthz under 1,000 busy clients",
        "model-server",
        "A probe is a new connection with a 1 s timeout every 50 ms, as Kubernetes' default is, on the API port and on "
        "`--probe-port`, while the crowd classifies from a process of its own.",
        (Part("probes"),),
    ),
    Section(
        "Batch scoring (`vit-predict --out`)",
        "batch",
        "Random weights (speed does not depend on training) and generated 64 x 64 PNGs.",
        (
            Part(
                "batch_bench",
                "vit-predict --out against in-process OnnxClassifier, ViT-Ti/16",
                "The `vit-predict` time includes starting Python, loading the model, committing the parts and merging "
                "them.",
            ),
            Part(
                "batch_bench_resume",
                "Killed halfway and resumed",
                "`vit-predict DIR --out preds.parquet` killed with SIGKILL halfway, then run again with `--resume`: "
                "every image must be in the output exactly once.",
            ),
        ),
    ),
    Section(
        "In the browser (`vit-export --web`)",
        "web",
        """\
The page `vit-export --web` writes, in headless Chromium, against onnxruntime in Python on the same file and
threads. Page load runs from navigation to `window.vitscope.ready` in a fresh context; per image, both do the
decode, resize, graph and rollout; parity is on noise images of random sizes.""",
        (Part("web"),),
    ),
    Section(
        "Calibration, prediction sets and unknown inputs (`vit-export`'s calibration)",
        "trust",
        """\
On images the calibration never saw (Fashion-MNIST's test set, the sample's validation split); each run holds back
10 % of its training images as the calibration split. The models:

```bash
vit-fashion-mnist --out data/fmnist
vit-train fit --config configs/small_images.yaml --data.root data/fmnist --data.img_size 28 \\
  --trainer.default_root_dir runs/fmnist --trainer.enable_progress_bar false --overwrite true
# open set: data/fmnist8/{train,val}/<class> are links to 8 of the 10 class folders (all but ankle_boot and bag),
# and a 12-minute budget (a config holding trainer.callbacks: [TimeBudget(minutes: 12.0)])
vit-train fit --config configs/small_images.yaml --config runs/openset_budget.yaml --data.root data/fmnist8 \\
  --data.img_size 28 --trainer.default_root_dir runs/fmnist8 --trainer.enable_progress_bar false --overwrite true
vit-sample-data --out data/digits
vit-train fit --config configs/sample.yaml --trainer.default_root_dir runs/sample \
  --trainer.enable_progress_bar false --overwrite true
.venv/bin/python -m benchmarks.trust --fmnist runs/fmnist --openset runs/fmnist8 --sample runs/sample
```

The "re-split" rows re-draw the calibration set 100 times, since coverage is guaranteed on average over calibration
sets. Unknown inputs: the AUROC of each score between the test images and 600 each of digits, noise and photo
crops (and, for the 8-class model, its 2 held-out classes).""",
        (Part("trust"),),
    ),
)
