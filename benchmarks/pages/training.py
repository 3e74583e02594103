"""The sections of the model and training, export and install, and test-suite pages."""

from __future__ import annotations

from benchmarks.pages.outline import Part, Section

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
        "The test suite (`make test`)",
        "tests",
        """\
Target: `make test` from a fresh clone, install included, in under 10 minutes on a 2-core VM.

Three pytest-xdist workers on the two cores, each taking whole files (so that a file's server or model is built
once), overlap the waits on child processes (`vit-train`, servers, a Ray cluster, DDP ranks, Chromium) that each
spend seconds importing torch, Lightning or gradio; the tiny trained model most serving tests use is built once per
run and shared by the workers. pip installs without compiling (`--no-compile`: compiling the venv's 21,000
modules one by one was half of the install), and the tests write bytecode even where `PYTHONDONTWRITEBYTECODE` is
set, so that each module the suite imports is compiled once for all of its processes. `.ci/run` is what CI runs:
`make test` (install, lint, docs, the tests), then `make test-serve-only` (the runtime and server tests again in a
venv with the `[serve]` extra alone).""",
        (Part("test_suite"),),
    ),
)
