"""What the benchmark pages say around the figures: one section per question, the results it shows, and the
text a rerun does not change (the target, what is measured, how to set up). `benchmarks.report` renders these
with `benchmarks/results/*.json` into BENCHMARKS.md and the docs site's pages. Figures do not belong here: they
are in the results, with the notes each run wrote about them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Part:
    """One result in a section, under a heading of its own when `title` is given."""

    result: str
    title: str = ""
    text: str = ""


@dataclass(frozen=True)
class Section:
    """One question: a heading (README and the docs link to its anchor), its docs page, text, and its results."""

    title: str
    page: str
    text: str = ""
    parts: tuple[Part, ...] = ()


# The docs pages (docs/benchmarks/PAGE.md): name -> title, in the order of the site's navigation.
PAGES = {
    "model": "Model and training",
    "export": "Export and install",
    "serving": "Serving",
    "peers": "Peers, gRPC and payload logs",
    "model-server": "Model server",
    "batch": "Batch scoring",
    "web": "In the browser",
    "trust": "Calibration, prediction sets, unknown inputs",
    "tests": "The test suite",
}

INTRO = """\
Each section holds the current figure for one question, with the machine, the date and the command that measured
it. The reference machine is a shared 2-core x86-64 VM with no GPU (each figure names the CPU it ran on). Speeds
are ratios taken side by side in one run, in interleaved rounds, because such a machine is noisy: absolute numbers
will differ on yours, and a rerun here moves a ratio by several percent.

Every figure comes from a script under `benchmarks/`, run from the repository root as
`.venv/bin/python -m benchmarks.NAME` (the command under each table; `make bench` runs the main ones one after
another). Each writes `benchmarks/results/NAME.json`, and `make report` renders those files, with the text in
`benchmarks/pages.py`, into BENCHMARKS.md and the docs site's benchmark pages. Neither page is edited by hand
(a test compares them with what the results render), and earlier figures live in git's history of the results."""

SECTIONS = (
    Section(
        "The model against timm (`vit/`)",
        "model",
        """\
Target: ours/timm >= 1.0 in every row.

Same architecture, same weights (`vit.from_timm`), interleaved; fp32 on the CPU (bf16 on CUDA when present). The
last column times a second copy of timm's own model: the noise floor that ours/timm is read against. Each row is
the median over fresh processes, each the best of 5 interleaved rounds, with the range over the processes in
brackets: identical code timed in one process can read several percent apart for that process's whole life
(where its weights and buffers land in memory), so one process proves little.

Two things make the difference, and both give the same logits as timm (within float rounding; the timm parity
tests hold them to 1e-4):

- A CLS-token head reads token 0 only, so the last block computes token 0 alone: its keys and values still come
  from every token, but its attention rows, projection and MLP run for 1 token instead of all of them, in
  inference and in training, and in the exported ONNX graph too.
- Without autograd (inference), each block writes its residual sums and the MLP's GELU into tensors it has just
  made, never into its input: no extra (B, N, 4D) buffer per block to allocate and fill. That helps most at
  batch 32, where those buffers are largest.""",
        (Part("model_vs_timm"),),
    ),
    Section(
        "Training the sample (`configs/sample.yaml`)",
        "model",
        """\
Target: >= 98.5 % on held-out digits in <= 3 minutes of training on 2 CPU cores (aim: 99 %+).

The real command (`vit-train fit --config configs/sample.yaml`) in a temporary run directory. The best-checkpoint
figure is chosen on the validation split itself; the last-epoch figure involves no selection.""",
        (Part("sample_accuracy"),),
    ),
    Section(
        "Fashion-MNIST from scratch (`configs/small_images.yaml`)",
        "model",
        """\
Target: >= 91.0 % on the official test set within 30 minutes of training on 2 CPU cores (stretch: HOG + SVM's
92.6 %).

```bash
sudo apt-get install dataset-fashion-mnist && vit-fashion-mnist --out data/fmnist
vit-train fit --config configs/small_images.yaml --data.root data/fmnist --data.img_size 28 \\
  --trainer.default_root_dir runs/fmnist --trainer.enable_progress_bar false --overwrite true
.venv/bin/python -m benchmarks.fashion_mnist --run-dir runs/fmnist
```

The recipe: a 64-wide, 4-block ViT whose convolutional stem starts with a full-resolution 3 x 3 convolution
(`stem_widths: [16, 32, 64]`: 16 channels at 28 x 28, then two stride-2 layers), batches of 64, and a 25-minute
`TimeBudget` that ends training while the cosine schedule anneals. The ablation below measured each choice.""",
        (
            Part("fashion_mnist"),
            Part(
                "small_images_ablation",
                "What each choice buys (`benchmarks/small_images_ablation.py`)",
                """\
Each row trains the same 64-wide, 4-block ViT (`vit_micro_patch4_32` at 28 px, one grey channel) in a plain
PyTorch loop over the 60,000 training images held as one tensor, so that only the choice under test changes:
AdamW (weight decay 0.05), half an epoch of warmup then a cosine to zero, a flip and a 2-px shift per batch, label
smoothing 0.1, one thread; test accuracy on the official 10,000 after each epoch. The first rows compare the patch
embedding over 3 epochs (batches of 256, lr 2e-3); the others change one thing at a time from the full-resolution
stem over one epoch (a whole cosine schedule in one epoch). Each row's command is
`.venv/bin/python -m benchmarks.small_images_ablation OPTIONS`.""",
            ),
        ),
    ),
    Section(
        "Scanning a million files (`train/folder_scan.py`)",
        "model",
        """\
Target: a 1,000,000-file folder of small images scanned in under 2 minutes on the 2-core machine.

The scan lists each class folder with one `os.walk`, checks every file's first 16 bytes for an image signature in
a process pool, and makes the stratified split; a planted non-image is reported. Files broken further in are found
when decoded (the cache fill, or a training worker) and listed then. Under DDP only rank 0 scans; the others read
its `scan.json` from the run directory. The benchmark writes the files, scans them, and deletes them.""",
        (Part("scan_bench"),),
    ),
    Section(
        "The input pipeline (`train/datamodule.py`, `train/dataset.py`, `train/transforms.py`)",
        "model",
        """\
Goal: the loader is never the bottleneck on this machine.

Workers are picked from the cores (`num_workers: null`): none for cached small images on 2 cores (the batch
transform costs the trainer less than feeding a worker), otherwise one per core but one, up to 8. Fashion-MNIST's
decoded images live in one uint8 array, filled in parallel before training (setup includes the scan). The JPEG
case decodes with Pillow's `draft` (1024 x 768 -> 256 x 192 for a 224-px model) in one worker. A `vit-train` step
against a plain loop on the same model, batch and data is measured in the next section.""",
        (Part("data_pipeline"),),
    ),
    Section(
        "Lightning's overhead, and a `vit-train` step against a plain loop",
        "model",
        """\
Targets: a training step through the module at most 5 % slower than a plain PyTorch loop (same model, same
batches); a step through `vit-train` (the data module on an image folder, cached images, batch augmentation, EMA,
the run-directory callbacks) at most 10 % slower than a plain loop on the same model, batch and images, held in
memory already normalised and batched. Both loops clip gradients and update the EMA; the last table compares
`vit-train` with a plain loop that also augments its batches with vit-train's own `BatchTransform`.""",
        (Part("train_overhead"),),
    ),
    Section(
        "Crash-safe checkpoint saves",
        "model",
        """\
What writing `last.ckpt` atomically costs (`train.checkpoint_io.AtomicCheckpointIO`: a temporary file beside the
target, fsync, rename, fsync of the folder) against Lightning's own save (in memory, a temporary file in $TMPDIR,
then a move, which is a copy when the run directory is on another filesystem). The checkpoints are shaped like
vit-train's (weights, EMA and two AdamW moments); each cell is the median of interleaved saves.""",
        (Part("checkpoint_save"),),
    ),
    Section(
        "Training on a GPU",
        "model",
        """\
ViT-B/16 in bf16, ours against timm's: images/s and model FLOP utilisation, on synthetic tensors and through the
real training path on an image folder. Without CUDA the script says so and exits; `--dry-run` checks it on the CPU.

```bash
.venv/bin/python -m benchmarks.gpu_train
```""",
        (Part("gpu_train"),),
    ),
    Section(
        "Where the rollout points (pointing game)",
        "model",
        """\
Aim: the rollout map's maximum falls inside the digit's box on >= 80 % of cluttered canvases.

Each digit is shrunk and pasted at a random place on a canvas among random strokes and dots; a map hits when the
centre of its highest patch lies inside the digit's box. On these canvases the digit is the darkest, densest ink,
and a map that follows ink alone scores well too (an untrained model also points at the digit most of the time):
the baselines are printed so the number can be judged, not taken on faith.""",
        (Part("pointing_game"),),
    ),
    Section(
        "Export and onnxruntime (`vit-export`, `serve.runtime.classifier`)",
        "export",
        """\
Targets at batch 1: ORT fp32 >= 1.3x torch eager; ORT int8 >= 2.5x torch eager with <= 0.5 points of accuracy
lost on held-out digits; ViT-S/16 fp32 reaching >= 80 % of the fp32 MatMul peak measured in the same run.

"ORT fp32" is the exported file: the logits path, its attention blocks and GELUs fused into onnxruntime's
`Attention` and `BiasGelu` kernels (`serve/export/fusion.py`), behind the `If` switch that also holds the attention
and gradient graphs. The last block of a CLS-token model computes the CLS token alone, so it is not `Attention`'s
pattern and stays plain ops. "ORT plain" is the same fused network exported without the switch; "ORT unfused" is
the network as the exporter writes it (the fusion also gives int8 its `QAttention`); "timm ORT" is timm's model
exported the plain way. The MatMul peak is a best-of-samples 1024^3 matmul, itself a sample, so a ratio over 100 %
means the model's matmuls ran a little faster than that sample. `OnnxClassifier` uses one intra-op thread for small
models, which leaves the other core to the server's event loop, and every core for larger ones
(`serve.runtime.classifier.default_threads`).""",
        (Part("export_bench"),),
    ),
    Section(
        "Export targets (`vit-export --target`)",
        "export",
        """\
What the portable target costs against the default onnxruntime target, at batch 1 on one thread. The portable
file always computes the attention maps and has no fused kernels; Triton gets the logits-only graph either way
(`--triton-repo`).""",
        (Part("targets_bench"),),
    ),
    Section(
        "Install size",
        "export",
        """\
Target: a `[serve]`-only venv under 600 MB.

Each row is a fresh venv built from this checkout with pip (its cache warm), measured with `du -sb`, then deleted.
`tests/serve/test_layering.py` builds the `[serve]` venv too, shows that `import torch` fails there, and serves and
predicts with an exported file from it.""",
        (Part("install_size"),),
    ),
    Section(
        "Serving (`vit-serve`)",
        "serving",
        """\
Targets: throughput at concurrency 16 >= 0.8x the in-process ORT throughput at its best batch size; p99 latency at
concurrency 1 <= 1.2x in-process single-image latency + 5 ms; a 5-minute soak at concurrency 8 with 0 errors and
resident memory growth <= 5 %.

Server and in-process rounds alternate (best of each), because this machine's speed drifts by tens of percent
over minutes. The load generator runs on the same 2 cores, so it is a bare asyncio protocol on uvloop and prints
its own CPU per request. A version of the server against another is measured side by side by `serve_ab` (the
model server page).""",
        (
            Part("serve_bench", "The sample model"),
            Part(
                "serve_bench_vit_tiny_patch16_224",
                "ViT-Ti/16 at 224 px",
                "The same server on a production-size model (random weights: serving cost does not depend on "
                "training), with onnxruntime on both cores and uploads decoded on the model's thread.",
            ),
        ),
    ),
    Section(
        "The layers of a request on the event loop",
        "serving",
        """\
What each layer of a `/v1/classify` request costs the event loop, in-process and side by side (no sockets, no
model), in CPU time per call over interleaved rounds: the routing (a plain Starlette route checking its parameters
by hand, a FastAPI route that validates `ClassifyParams` itself, as `/v1/classify` does, and one that declares them
as its query parameters) and the multipart body (Starlette's form parser against
`serve.server.http.uploads.parse_multipart`).""",
        (Part("serve_overhead"),),
    ),
    Section(
        "Serving on Ray (`vit-serve --ray`)",
        "serving",
        """\
What Ray Serve costs and buys on one machine: plain `vit-serve` against `vit-serve --ray` with 1 and 2 model
replicas, side by side in one run (a throwaway two-node Ray cluster, one CPU per node, on the same machine), with
serve_bench's load generator at concurrency 16 posting one PNG to `/v1/classify`. Plain `vit-serve` is measured
first and again last, so the machine's drift over the run shows. Each request through Ray crosses its HTTP proxy,
the ingress replica and a model replica, three processes with a Ray call between each: `vit-serve --ray` is for
spreading a model over several machines and for replicas that survive crashes (`tests/serve/test_ray_serve.py`),
not for more speed on one machine.""",
        (Part("ray_bench"),),
    ),
    Section(
        "Hostile clients (`vit-serve` under attack)",
        "serving",
        """\
Goals: at most +1 GB peak resident memory over the idle server, and `/healthz` p99 under 100 ms, during each
attack of the security audit. Each run starts one `vit-serve` (with its UI) on 127.0.0.1 and, while the attack
goes on, probes `GET /healthz` every 50 ms and an ordinary `POST /v1/classify` every 100 ms. The model is the
tests' tiny one (4 classes, 32 x 32 input: `.venv/bin/python -m tests.helpers --tiny-onnx tiny.onnx`), since the
attacks are on decoding and HTTP, not on the model.

Large images decode at reduced size and within a pixel budget (`--decode-pixel-budget`), glibc hands large freed
blocks back at once (`serve.server.cli._return_freed_memory`), and request heads stop at 64 KiB (431) and must
arrive within 10 s (408).""",
        (Part("hostile_bench"),),
    ),
    Section(
        "The connection cap against uvicorn's `limit_concurrency`",
        "serving",
        """\
Why `serve/server/http/protocol.py` keeps its own cap: uvicorn's `limit_concurrency` answers 503 only once a
request head arrives, so connections that send nothing keep their descriptors until a timeout, while the cap
refuses the connection itself. The same tiny app under each, with idle connections beyond a cap.""",
        (Part("connection_cap"),),
    ),
    Section(
        "Peers: vit-serve, LitServe, Ray Serve",
        "peers",
        """\
The same ONNX file (the sample's architecture, `vit_micro_patch4_32`, random weights) behind each server, all up
at once, rounds alternating, 16 keep-alive clients, batches of up to 8 on every server. **Server CPU per request**
(every process of the server, from /proc) is the figure that holds whatever else runs on the machine; "beyond
model" is that CPU less what the model and decoding cost in-process (the gRPC and v2 tensor rows send pixels, so
only the model is subtracted there). Ray Serve's CPU counts every process of its local cluster (GCS, raylet,
dashboard agent, proxy and replica). LitServe and Ray Serve install with `pip install 'vitscope[bench]'`.""",
        (Part("serve_peers"),),
    ),
    Section(
        "gRPC against HTTP v2 binary tensors",
        "peers",
        """\
Target: gRPC at least as fast as HTTP v2. The `vit-serve HTTP v2 binary tensor` and `vit-serve gRPC raw tensor`
rows of the peers table above: the same pixels of the same image (batch 1), the same server, alternating rounds.
The gRPC load generator (grpc.aio, one channel) costs its process more CPU per call than the raw-socket HTTP one,
and it shares the two cores with the server.""",
    ),
    Section(
        "Payload logs",
        "peers",
        """\
Three `vit-serve` processes up at once, alternating rounds of 16 clients uploading a PNG to `/v1/classify`: no
payload log, a JSON-lines file, and a CloudEvents sink that accepts connections and never answers (a queue of 64,
so it is full within the first round). A request must never wait for the log: the stalled sink's records are
dropped and counted.""",
        (Part("payload_log_bench"),),
    ),
    Section(
        "A version swapped 10 times under load",
        "model-server",
        """\
A model repository served with `--repository-poll-s`, keep-alive clients classifying back to back, and a new
version dropped in again and again (copied beside the repository, then renamed into it, as a deployment writes
one). The time to the first answer covers the poll, loading, the batch-size measurement and the warm-up checks.
The model is the test suite's tiny exported file (`.venv/bin/python -m tests.helpers --tiny-onnx
/tmp/repo_bench/tiny.onnx`).""",
        (Part("rollout"),),
    ),
    Section(
        "/healthz under 1,000 busy clients",
        "model-server",
        """\
Each probe is a new connection with a 1 s timeout, as Kubernetes' default probe is, every 50 ms, on the API port
and on `--probe-port` (answered by a process of its own, `serve.server.http.probes`), while the crowd classifies
from a process of its own.""",
        (Part("probes"),),
    ),
    Section(
        "The repository server against the server of main at 480eaec",
        "model-server",
        """\
```bash
git archive 480eaec | tar -x -C /tmp/vitscope-480eaec
```

Two source trees, each running its own `vit-serve`, in alternating rounds of serve_bench's load generator; the
server's CPU time per request moves less with a busy machine than its throughput. Target: at least 0.95x the
requests per second of the older server.""",
        (
            Part("serve_ab", "The digits sample"),
            Part("serve_ab_vit_tiny_patch16_224", "ViT-Ti/16 with random weights"),
        ),
    ),
    Section(
        "Batch scoring (`vit-predict --out`, `vit-predict --ray`)",
        "batch",
        "Random weights: speed does not depend on training. Generated 64 x 64 PNGs; compare the ratios, which are "
        "taken side by side in one run.",
        (
            Part(
                "batch_bench",
                "vit-predict --out against in-process OnnxClassifier, ViT-Ti/16",
                "Target: `vit-predict --out` within 15 % of the model alone. Its time includes starting Python, "
                "loading the model, committing the parts and merging them.",
            ),
            Part(
                "batch_bench_resume",
                "100,000 images, killed halfway and resumed",
                "`vit-predict DIR --out preds.parquet` killed with SIGKILL once half of its parts were committed, "
                "then the same command plus `--resume`: every image must be in the output exactly once.",
            ),
            Part("ray_batch", "vit-predict --ray: one actor, two actors, and what Ray costs"),
        ),
    ),
    Section(
        "In the browser (`vit-export --web`)",
        "web",
        """\
The page `vit-export --web` writes, in Debian's Chromium (headless, through Playwright), served by
`python -m http.server` on 127.0.0.1, plain and with the cross-origin isolation headers that turn on WASM threads,
against onnxruntime in Python doing the same work on the same number of threads; random weights (speed does not
depend on training, and parity does not either).

- **Page load** is a fresh browser context (no cache) from the navigation until `window.vitscope.ready`: fetching
  onnxruntime-web's WASM and the model, compiling the WASM, creating the session.
- **Per image**, the browser does everything the page does (decode, Pillow-exact resize and crop, the graph with
  its attention maps, rollout) and Python does the same work (`prepare`, then `rollout`).
- **Parity**: on noise images of random sizes (so the page and Pillow both resize and crop); the test asks for
  logits within 1e-4 and a rollout correlation of at least 0.999, and `tests/serve/test_web.py` checks the same on
  the test model in every `make test`.""",
        (Part("web"),),
    ),
    Section(
        "Calibration, prediction sets and unknown inputs (`vit-export`'s calibration)",
        "trust",
        """\
What the exported file's calibrated scores, prediction sets and unknown verdicts are worth, on images the
calibration never saw: Fashion-MNIST's official test set, the sample's validation split. Each run holds back 10 % of
its training images as the calibration split. The models:

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

"ECE, temperature alone" is softmax(logits / T); "ECE after" adds the confidence map, as the file answers (a file
calibrated on fewer than 1,000 images has the temperature alone). The "re-split" rows pool calibration and test
images and re-draw a calibration set of the same size 100 times: the coverage guarantee is an average over
calibration sets, and these rows measure it. LAC gives the smallest sets, so it is the export's default
(`--conformal aps` for adaptive sets). Unknown inputs: AUROC of each score (higher: better separated) between a
model's test images and 600 images of each kind (scikit-learn's digits scaled to 28 px, uniform noise, random
48-200 px crops of scikit-learn's two sample photos), and for the 8-class model the test images of its 2 held-out
classes; Mahalanobis is the file's own score (its `features` output, class means and shrunk shared covariance).
"Called unknown by the file" is the share its threshold (95 % of calibration images accepted, cross-fitted) flags.
Class-conditional sets need at least 1/(1 - coverage) - 1 images per class; the file refuses them otherwise.""",
        (Part("trust"),),
    ),
    Section(
        "The test suite (`make test`)",
        "tests",
        """\
Target (#12): the tests in `make test` take under 10 minutes on the reference machine; the whole `make test` from a
fresh clone stays under 15.

Two pytest-xdist workers, each taking whole files (so that a file's server or model is built once), overlap the
waits on child processes (`vit-train`, servers, a Ray cluster, DDP ranks, Chromium) that each spend seconds
importing torch, Lightning or gradio. `.ci/run` is what CI runs: `make test` (install, lint, docs, the tests), then
`make test-serve-only` (the runtime and server tests again in a venv with the `[serve]` extra alone).""",
        (Part("test_suite"),),
    ),
)
