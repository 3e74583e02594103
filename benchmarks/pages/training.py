"""The sections of the model and training, and test-suite pages."""

from __future__ import annotations

from benchmarks.pages.outline import Part, Section

SECTIONS = (
    Section(
        "The model against timm (`vit/`)",
        "model",
        """\
Same architecture and weights (`vit.from_timm`), interleaved, fp32 on the CPU. Each row is the median over fresh
processes (the range in brackets); the last column times timm against a second copy of itself, the noise floor. A
CLS-token head lets the last block compute token 0 alone, and inference writes residuals into fresh tensors.""",
        (Part("model_vs_timm"),),
    ),
    Section(
        "Training the sample (`configs/sample.yaml`)",
        "model",
        "The real `vit-train fit --config configs/sample.yaml` in a temporary run directory; the best checkpoint is "
        "chosen on the validation split itself, the last epoch involves no selection.",
        (Part("sample_accuracy"),),
    ),
    Section(
        "Fashion-MNIST from scratch (`configs/small_images.yaml`)",
        "model",
        """\
```bash
sudo apt-get install dataset-fashion-mnist && vit-fashion-mnist --out data/fmnist
vit-train fit --config configs/small_images.yaml --data.root data/fmnist --data.img_size 28 \\
  --trainer.default_root_dir runs/fmnist --trainer.enable_progress_bar false --overwrite true
.venv/bin/python -m benchmarks.fashion_mnist --run-dir runs/fmnist
```

A 64-wide, 4-block ViT with a full-resolution convolutional stem, batches of 64, and a 25-minute `TimeBudget`.""",
        (
            Part("fashion_mnist"),
            Part(
                "small_images_ablation",
                "What each choice buys (`benchmarks/small_images_ablation.py`)",
                "Each row trains the same model in a plain PyTorch loop over the training images held as one tensor, "
                "changing one choice; its command is `.venv/bin/python -m benchmarks.small_images_ablation OPTIONS`.",
            ),
        ),
    ),
    Section(
        "A `vit-train` step against a plain loop",
        "model",
        "Lightning's module, then the whole `vit-train` step (data module, cached images, batch augmentation, EMA, "
        "callbacks), each against a plain PyTorch loop on the same model and batches, in interleaved rounds.",
        (Part("train_overhead"),),
    ),
    Section(
        "Where the rollout points (pointing game)",
        "model",
        "A digit pasted at a random place among clutter; a map hits when its highest patch lies inside the digit's "
        "box. The baselines show what following ink alone scores.",
        (Part("pointing_game"),),
    ),
    Section(
        "The test suite (`make test`)",
        "tests",
        "`.ci/run` on a fresh clone: `make test` (install, lint, docs, the tests on three pytest-xdist workers), then "
        "`make test-serve-only` in a venv with the `[serve]` extra alone.",
        (Part("test_suite"),),
    ),
)
