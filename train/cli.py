"""`vit-train`: LightningCLI over `ViTClassifier` and `ImageFolderDataModule`.

    vit-train fit --config configs/sample.yaml --trainer.default_root_dir runs/sample
    vit-train fit --config configs/sample.yaml --trainer.default_root_dir runs/sample --ckpt_path last

A run directory holds `checkpoints/best.ckpt` (the best epoch by `--checkpoint.monitor`, balanced accuracy by
default) and `checkpoints/last.ckpt` (no version folders, so `--ckpt_path last` resumes in place), `config.yaml`,
TensorBoard and CSV logs, `split.json`, `bad_files.csv`, `reports/` (the best epoch's confusion matrix and
per-class precision and recall) and `summary.json`.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import Callback, EarlyStopping, ModelCheckpoint, ProgressBar, RichProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.plugins import CheckpointIO
from lightning.pytorch.utilities.exceptions import MisconfigurationException, SIGTERMException

from serve.runtime.interrupts import EXIT_INTERRUPTED, EXIT_TERMINATED
from train.callbacks import ClearReplacedRun, KeepBestScore, RunDirConfig
from train.checkpoint_io import AtomicCheckpointIO, load_error, remove_partial_saves
from train.datamodule import ImageFolderDataModule
from train.errors import SetupError, TrainingError, first_line
from train.fit_report import report_fit
from train.held_split import evaluated_split, run_split, warn_if_validated_on_its_training
from train.label_issues import LabelIssuesReport
from train.module import ViTClassifier
from train.options import check_data_settings, check_monitor, check_trainer_settings, warn_on_doubtful_settings
from train.recipe import auto_recipe_args
from train.review import REVIEW_HELP, review_parser
from train.review import main as review_main
from train.run_dir import (
    CKPT_DIR,
    check_run_dir,
    hold_run_dir,
    is_remote,
    resolve_ckpt_path,
    scored_ckpt_path,
)
from train.shards import PREPARE_HELP, prepare_parser
from train.shards import main as prepare_main
from train.splits import no_validation

log = logging.getLogger(__name__)
FIT_RUN: list[tuple[Path, float]] = []  # the fit under way, once its checks begin: its run directory, and the time
# from which a last.ckpt there is its own (`stopped` looks there)


class LastCheckpoint(ModelCheckpoint):
    """`last.ckpt` after every epoch, whatever its score: what `--ckpt_path last` resumes from.

    (Lightning's own `save_last` only refreshes it when a top-k checkpoint is written.) It is written into
    the run directory's `checkpoints/`, where `--ckpt_path last` looks for it.

    Args:
        every_n_train_steps: also write last.ckpt every this many optimizer steps, so that a stopped run loses at
            most that many: resumed, it continues mid-epoch. A prepared LitData dataset goes on from the next
            sample of the epoch; an image folder's loader keeps no position, so the rest of that epoch's steps
            are drawn from a fresh shuffle. None: at the end of each epoch only.
    """

    def __init__(self, every_n_train_steps: int | None = None):
        if every_n_train_steps is not None and every_n_train_steps < 1:
            raise ValueError(f"--last.every_n_train_steps must be at least 1, got {every_n_train_steps}")
        # steps are counted here: Lightning's own step trigger would replace the epoch one (it takes one or the other)
        # at each epoch's end, after its validation if it has one: every epoch, whatever check_val_every_n_epoch
        super().__init__(
            filename="last", monitor=None, save_top_k=1, enable_version_counter=False, save_on_train_epoch_end=True
        )
        self.every_steps = every_n_train_steps
        self._saved_step = -1

    def on_train_batch_end(self, trainer: Trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        step = trainer.global_step
        due = bool(self.every_steps) and step % self.every_steps == 0 and step != self._saved_step
        epoch_end = batch_idx + 1 >= trainer.num_training_batches  # the epoch's own save follows, after validation
        if due and not epoch_end and not trainer.sanity_checking:
            trainer.save_checkpoint(self.format_checkpoint_name({}), weights_only=False)  # whole: it is resumed
            self._saved_step = step


class StopEarly(EarlyStopping):
    """Stop when the selection metric (`--checkpoint.monitor`) has not improved for `patience` validations.

    Lightning's `EarlyStopping`, off unless a patience is given (`--early_stopping.patience 10`); it watches what
    chooses `best.ckpt`, so the run stops when that checkpoint has stopped changing.

    Args:
        patience: validations without improvement before stopping; None: never stop early.
        min_delta: the least change that counts as an improvement.
        monitor: the metric watched (linked from `--checkpoint.monitor`).
        mode: "max" or "min" (linked from `--checkpoint.mode`).
    """

    def __init__(
        self, patience: int | None = None, min_delta: float = 0.0, monitor: str = "val/balanced_acc", mode: str = "max"
    ):
        if patience is not None and patience < 1:
            raise ValueError(f"--early_stopping.patience must be at least 1 (or null: do not stop), got {patience}")
        super().__init__(monitor=monitor, min_delta=min_delta, patience=patience or 1, mode=mode)
        self.enabled = patience is not None


class VitCLI(LightningCLI):
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_argument(
            "--num_threads",
            type=int | None,
            default=None,
            help="CPU threads for PyTorch ops (torch.set_num_threads); None keeps PyTorch's default",
        )
        parser.add_argument(
            "--overwrite",
            type=bool,
            default=False,
            help="fit into a run directory that already holds checkpoints, replacing them (without it, "
            "fit refuses: resume with --ckpt_path last, or choose another --trainer.default_root_dir)",
        )
        parser.add_argument(
            "--recipe", type=dict | None, default=None, help="why the automatic recipe chose what it did (train.recipe)"
        )
        parser.add_lightning_class_args(ModelCheckpoint, "checkpoint")
        parser.add_lightning_class_args(LastCheckpoint, "last")
        parser.add_lightning_class_args(StopEarly, "early_stopping")
        parser.set_defaults(
            {
                "checkpoint.filename": "best",
                "checkpoint.monitor": "val/balanced_acc",  # mean per-class recall: a long tail counts, class by class
                "checkpoint.mode": "max",
                "checkpoint.save_top_k": 1,
                "checkpoint.save_last": False,  # LastCheckpoint writes last.ckpt every epoch
                "checkpoint.enable_version_counter": False,
            }
        )
        parser.link_arguments("data.img_size", "model.img_size")
        parser.link_arguments("data.num_classes", "model.num_classes", apply_on="instantiate")
        parser.link_arguments("checkpoint.monitor", "early_stopping.monitor")
        parser.link_arguments("checkpoint.mode", "early_stopping.mode")
        # what the data module's `--data.balance` decided, for the loss (the sampler is the data module's own)
        parser.link_arguments("data.class_counts", "model.class_counts", apply_on="instantiate")
        parser.link_arguments("data.balance_method", "model.balance", apply_on="instantiate")

    def _add_subcommands(self, parser: LightningArgumentParser, **kwargs: Any) -> None:
        """The Trainer's subcommands, and `prepare` and `review` beside them so that `vit-train --help` lists them.

        `main` runs `prepare` and `review` before LightningCLI is built: it needs no model, trainer or data module.
        """
        super()._add_subcommands(parser, **kwargs)
        parser._subcommands_action.add_subcommand("prepare", prepare_parser(), help=PREPARE_HELP)
        parser._subcommands_action.add_subcommand("review", review_parser(), help=REVIEW_HELP)

    def before_instantiate_classes(self) -> None:
        config = self.config.get(str(self.subcommand), self.config)
        warn_on_doubtful_settings(config)
        check_data_settings(config)
        if config.get("num_threads"):
            torch.set_num_threads(config["num_threads"])
        run_dir = Path(config.get("trainer.default_root_dir") or os.getcwd())  # another run or fit there: refused
        if self.subcommand == "fit":  # before the folder is scanned (minutes for a large one)
            check_run_dir(run_dir, config.get("data.root"), create=False)  # writable, and not in the image folder
            if run_dir.is_dir():
                self._hold_run_dir(run_dir, config)
        if self.subcommand == "fit" and config.get("ckpt_path") and not config.get("overwrite"):  # a resumed run
            config["data.split"] = config.get("data.split") or run_split(config.get("trainer.default_root_dir"))
        if self.subcommand in ("validate", "test", "predict") and not config.get("data.split"):
            config["data.split"] = evaluated_split(str(run_dir), config.get("data.root"), config.get("ckpt_path"))
        if config.get("ckpt_path") and config.get("model.pretrained"):
            # the checkpoint holds every weight: resuming must not need the hub or the original file again
            config["model.pretrained"] = None

    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        """Parse, then check --ckpt_path before Lightning reads the model's hyperparameters from it: a missing,
        damaged or code-carrying checkpoint is one line, not a traceback."""
        super().parse_arguments(parser, args)
        config = self.config.get(str(self.config.get("subcommand")), None)
        ckpt_path = config.get("ckpt_path") if config is not None else None
        if not ckpt_path:
            return
        path = resolve_ckpt_path(ckpt_path, Path(config.get("trainer.default_root_dir") or os.getcwd()))
        if not is_remote(path):
            try:  # memory-mapped: reads the pickle, not the tensors
                torch.load(path, weights_only=True, mmap=True, map_location="cpu")
            except Exception as e:  # noqa: BLE001 (any failure to load is the same message)
                raise load_error(path, e) from None

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        """Lightning's trainer, set up for one run directory: loggers, checkpoints (best and last, saved
        atomically) and the resolved config all live there, so `--ckpt_path last` resumes in place."""
        init = self.config_init.get(str(self.subcommand), self.config_init)
        config = init.get("trainer") or {}
        run_dir = Path(config.get("default_root_dir") or os.getcwd())
        check_run_dir(run_dir, getattr(self.datamodule, "root", None))
        if self.subcommand == "fit" and getattr(self, "_run_lock", None) is None:  # a run directory made just now
            self._hold_run_dir(run_dir, self.config.get("fit", self.config))
        remove_partial_saves(run_dir / CKPT_DIR)  # the partial saves of an earlier fit of this run
        kwargs["plugins"] = _with_atomic_checkpoint_io(config.get("plugins"))
        if config.get("logger") in (None, True):  # default loggers live in the run directory
            kwargs["logger"] = [TensorBoardLogger(run_dir, name="tensorboard"), CSVLogger(run_dir, name="csv")]
        # The best-checkpoint callback (--checkpoint.*) moves into this list, in the order Lightning would
        # give it, so that `trainer.checkpoint_callback` is still the one that tracks the best score.
        best, init["checkpoint"] = init.get("checkpoint"), Callback()  # a no-op takes its place
        last, init["last"] = init.get("last"), Callback()  # added below, after the progress bar
        stop, init["early_stopping"] = init.get("early_stopping"), Callback()
        callbacks = list(config.get("callbacks") or [])
        if stop is not None and stop.enabled:
            callbacks.append(stop)
        if config.get("enable_checkpointing") is False:  # Lightning refuses checkpoint callbacks then
            callbacks = [c for c in callbacks if not isinstance(c, ModelCheckpoint)]
        else:
            callbacks.append(best)
            for c in callbacks:
                if isinstance(c, ModelCheckpoint) and c.dirpath is None:
                    # fixed (resume finds last.ckpt here) and absolute, as ModelCheckpoint's own init makes it
                    c.dirpath = os.path.realpath(run_dir / CKPT_DIR)
        if config.get("enable_progress_bar") is not False and not any(isinstance(c, ProgressBar) for c in callbacks):
            callbacks.append(RichProgressBar())
        if config.get("enable_checkpointing") is not False:
            last.dirpath = os.path.realpath(run_dir / CKPT_DIR)
            callbacks += [last, KeepBestScore()]
        kwargs["callbacks"] = [*callbacks, LabelIssuesReport()]  # reports/label_issues.csv at the end of fit
        check_trainer_settings(config, fit=self.subcommand == "fit")
        try:
            trainer = super().instantiate_trainer(**kwargs)
        except (MisconfigurationException, TypeError) as e:  # Lightning's check of a --trainer.* value
            raise SetupError(f"--trainer: {first_line(e)}") from None
        return trainer

    def _run_subcommand(self, subcommand: str) -> None:
        try:
            super()._run_subcommand(subcommand)
        except MisconfigurationException as e:  # Lightning's refusal of a setting (a count that fits no loader)
            raise SetupError(f"Lightning refused the run: {first_line(e)}") from None
        finally:
            self._free_run_dir()

    def _hold_run_dir(self, run_dir: Path, config) -> None:  # the fit's lock, and no other run's checkpoints
        overwrite, check = bool(config.get("overwrite")), not config.get("trainer.fast_dev_run")
        self._run_lock = hold_run_dir(run_dir, config.get("ckpt_path"), overwrite, check)

    def _free_run_dir(self) -> None:  # for the next fit, also one in this process (a notebook, a test)
        lock, self._run_lock = getattr(self, "_run_lock", None), None
        if lock is not None:
            lock.close()

    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
        except BaseException as e:
            self._free_run_dir()
            if isinstance(e, (OSError, ValueError)):  # a folder or weights file that is not there; arguments refused
                raise SetupError(str(e)) from e
            raise

    def _check_ckpt_path(self, subcommand: str) -> str | None:
        """Resolve --ckpt_path (last, best, a file or a URL; `scored_ckpt_path` for validate, test and predict) and
        have it loaded weights-only, whatever its source."""
        kwargs, run_dir = self.config_init[subcommand], Path(self.trainer.default_root_dir)
        if subcommand != "fit":
            kwargs["ckpt_path"] = scored_ckpt_path(subcommand, kwargs.get("ckpt_path"), run_dir, self.model)
        ckpt_path = resolve_ckpt_path(kwargs.get("ckpt_path"), run_dir)
        kwargs["ckpt_path"] = ckpt_path
        if "weights_only" in kwargs:
            kwargs["weights_only"] = True
        return ckpt_path

    def before_fit(self) -> None:
        config = self.config.get("fit", self.config)
        # for `stopped`, should a signal end the fit: a replaced run's last.ckpt (older than this fit) is not its
        FIT_RUN[:] = [(Path(self.trainer.default_root_dir), time.time() if config.get("overwrite") else 0.0)]
        check_monitor(config.get("checkpoint.monitor"), config.get("checkpoint.mode"))
        ckpt_path = self._check_ckpt_path("fit")
        if self.trainer.limit_val_batches != 0:
            self._check_validation_images()
        if self.trainer.global_rank == 0:
            warn_if_validated_on_its_training(self.datamodule.scan, ckpt_path, Path(self.trainer.default_root_dir))
        if config.get("overwrite"):  # the old run goes as training starts, once the checkpoint's checks have passed
            self.trainer.callbacks.append(ClearReplacedRun(self.trainer.default_root_dir, ckpt_path))
        self.datamodule.share_scan(self.trainer)  # before DDP starts its other processes (`train.ddp_scan`)
        self._fit_start = time.perf_counter()

    def _check_validation_images(self) -> None:
        """Refuse a fit whose validation set is empty, or too small to give every DDP rank an image."""
        scan = getattr(self.datamodule, "scan", None)
        if scan is None:
            return
        # a prepared (LitData) dataset keeps its split in its chunks, not in the scan
        if scan.layout != "litdata" and not scan.val:
            raise SetupError(no_validation(scan))
        world, images = self.trainer.world_size, self.datamodule.val_images
        if images < world:
            raise SetupError(
                f"{self.datamodule.root} has {images} validation image(s) for {world} DDP processes, and each "
                "process needs one: hold out more (--data.val_fraction), or run on fewer devices"
            )

    def _before_evaluation(self) -> None:  # validate, test and predict
        self._check_ckpt_path(self.subcommand)
        self.datamodule.share_scan(self.trainer)

    before_validate = before_test = before_predict = _before_evaluation

    def after_fit(self) -> None:
        if self.trainer.is_global_zero:
            report_fit(self.trainer, self.model, self.datamodule, time.perf_counter() - self._fit_start)


def _with_atomic_checkpoint_io(plugins: Any) -> list[Any]:
    """The trainer's plugins, with `AtomicCheckpointIO` unless the user chose a checkpoint IO."""
    plugins = [] if plugins is None else list(plugins) if isinstance(plugins, (list, tuple)) else [plugins]
    if not any(isinstance(p, CheckpointIO) for p in plugins):
        plugins.append(AtomicCheckpointIO())
    return plugins


def build_cli(args: list[str] | None = None, run: bool = True) -> VitCLI:
    """Parse `args` (default: the command line) and, with `run`, execute the subcommand."""
    torch.set_float32_matmul_precision("high")
    # the EMA copy is never trained, so it stays in eval mode on purpose
    warnings.filterwarnings("ignore", message=r"Found \d+ module\(s\) in eval mode")
    return VitCLI(
        ViTClassifier,
        ImageFolderDataModule,
        save_config_callback=RunDirConfig,
        save_config_kwargs={"overwrite": True},
        args=args,
        run=run,
        auto_configure_optimizers=False,
        parser_kwargs={
            "prog": "vit-train",
            "description": "Train a vitscope ViT on an image folder (root/<class>/<image>) with Lightning. "
            "Start with: vit-train fit --config configs/vit_tiny.yaml --data.root path/to/images "
            "--trainer.default_root_dir runs/mine; `vit-train fit --help` lists every option.",
        },
    )


def main(args: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("train").setLevel(logging.INFO)
    argv = sys.argv[1:] if args is None else args
    FIT_RUN.clear()  # another fit's, in this process
    if argv[:1] == ["prepare"]:  # image folder -> LitData chunks (train.shards)
        return prepare_main(argv[1:])
    if argv[:1] == ["review"]:  # a run directory -> a page to correct its labels (train.review)
        return review_main(argv[1:])
    try:
        recipe_args = auto_recipe_args(argv)
        if recipe_args != argv:  # the recipe's config goes first; LightningCLI would warn about args and sys.argv
            warnings.filterwarnings("ignore", message="LightningCLI's args parameter")
        build_cli(args if recipe_args == argv else recipe_args)
    except SetupError as e:  # the user's to fix: one line, not a traceback through Lightning
        print(f"vit-train: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    except TrainingError as e:  # stopped on purpose; the checkpoints hold the last good state
        print(f"vit-train: {e}", file=sys.stderr)
        raise SystemExit(1) from None
    except SIGTERMException:  # a scheduler stopping the job: not a success (Lightning's exception has no code)
        raise stopped("SIGTERM", EXIT_TERMINATED, argv) from None
    except SystemExit as e:  # Lightning ends a run stopped by Ctrl-C with exit(1), as it would end a failure
        if e.code != 1 or not isinstance(e.__context__, KeyboardInterrupt):
            raise
        raise stopped("Ctrl-C (SIGINT)", EXIT_INTERRUPTED, argv) from None


def stopped(signal_name: str, code: int, argv: list[str]) -> SystemExit:
    """Says that a signal stopped the command (and, for a fit, how to go on: `--ckpt_path last` once there is a
    last.ckpt to resume, else the same command again); the exit to raise."""
    resume = ""
    if argv[:1] == ["fit"]:
        lasts = [(run / CKPT_DIR / "last.ckpt", since) for run, since in FIT_RUN]
        saved = any(last.is_file() and last.stat().st_mtime >= since for last, since in lasts)
        resume = "; the same command with --ckpt_path last resumes it" if saved else (
            " before its first checkpoint; the same command runs it again"
        )  # fmt: skip
    print(f"vit-train: stopped by {signal_name}{resume}", file=sys.stderr)
    return SystemExit(code)


if __name__ == "__main__":
    main()
