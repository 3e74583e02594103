"""vit-train refuses what would run foreign code, lose a run, or fail deep inside Lightning: one line, exit 2."""

from __future__ import annotations

import csv
import functools
import http.server
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from tests.helpers import REPO, write_shapes
from train.checkpoint_format import META_KEY, load_checkpoint
from train.cli import main

SAMPLE = str(REPO / "configs" / "sample.yaml")
FAULTS = "--trainer.callbacks+=tests.train.faults."


def args(root: Path, run_dir: Path, *extra: str, command: str = "fit") -> list[str]:
    return [
        command, "--config", SAMPLE, "--data.root", str(root), "--trainer.default_root_dir", str(run_dir),
        "--trainer.max_epochs", "1", "--trainer.enable_progress_bar", "false", "--data.batch_size", "4", *extra,
    ]  # fmt: skip


def one_line_error(argv: list[str], capsys, code: int = 2) -> str:
    """Run vit-train, expect exit `code` and a single `vit-train: ...` line on stderr; return that line."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    return the_one_error_line(exit_info.value.code, capsys.readouterr().err, code)


def the_one_error_line(exit_code: int, err: str, code: int = 2) -> str:
    """The single `vit-train: ...` line of `err`, after checking that vit-train exited with `code`."""
    lines = [line for line in err.splitlines() if line.startswith("vit-train: ")]
    assert exit_code == code, err[-2000:]
    assert "Traceback" not in err and len(lines) == 1, err[-2000:]
    return lines[0]


# what lets root read and write past file modes; without them, chmod binds root as it binds anyone
ROOT_BYPASS = "-dac_override,-dac_read_search"


def run_bound_by_file_modes(*argv: str) -> subprocess.CompletedProcess:
    """`python ARGV` in a child process that file modes bind, root included: as root it runs (`setpriv`)
    without CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH, so a chmod 000 folder cannot be listed and a chmod
    555 one cannot be written, even by its owner."""
    cmd = [sys.executable, *argv]
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("running as root without setpriv (util-linux): no way to make file modes bind root")
        cmd = ["setpriv", f"--inh-caps={ROOT_BYPASS}", f"--bounding-set={ROOT_BYPASS}", *cmd]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)


@pytest.fixture
def small_folder(tmp_path: Path) -> Path:
    return write_shapes(tmp_path / "shapes", per_class=5)


class Evil:
    """Unpickling it runs code: it writes `marker` (what an attacker's checkpoint would do, and worse)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').write('pwned')",)


@pytest.fixture
def http_dir(tmp_path: Path):
    """A real HTTP server on 127.0.0.1 serving the folder it yields (as (folder, base URL))."""
    folder = tmp_path / "www"
    folder.mkdir()
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(folder))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield folder, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("command", ["validate", "fit"])
def test_a_checkpoint_url_is_loaded_weights_only_and_its_code_never_runs(
    command, small_folder, http_dir, tmp_path, capsys, monkeypatch
):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch_home"))  # where a hub download would be cached
    www, url = http_dir
    marker = tmp_path / "marker"
    torch.save({"state_dict": Evil(marker), "vitscope": {}}, www / "evil.ckpt")
    err = one_line_error(
        args(small_folder, tmp_path / "run", "--ckpt_path", f"{url}/evil.ckpt", command=command), capsys
    )
    assert not marker.exists(), "the checkpoint's pickled code ran"
    assert "evil.ckpt" in err and "weights-only" in err


def test_a_local_checkpoint_holding_code_is_refused_the_same_way(small_folder, tmp_path, capsys):
    marker = tmp_path / "marker"
    evil = tmp_path / "run" / "checkpoints" / "last.ckpt"
    evil.parent.mkdir(parents=True)
    torch.save({"state_dict": Evil(marker), "vitscope": {}}, evil)
    err = one_line_error(args(small_folder, tmp_path / "run", "--ckpt_path", "last"), capsys)
    assert not marker.exists() and "last.ckpt holds Python objects that a weights-only load refuses" in err


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (["--model.lr", "0"], "--model.lr must be a positive number, got 0"),
        (["--model.lr", "-0.001"], "--model.lr must be a positive number, got -0.001"),
        (["--model.min_lr", "-1.0"], "--model.min_lr must be zero or a positive number"),
        (["--data.batch_size", "0"], "--data.batch_size must be at least 1, got 0"),
        (["--data.num_workers", "-1"], "--data.num_workers must be 0 or more"),
        # each of these trained, or failed deep in torch or Lightning, some only after an epoch
        (["--data.num_workers", "100000"], "--data.num_workers 100000 is far more than"),  # the OOM killer
        (["--model.min_lr", "1.0"], "--model.min_lr must be zero or a positive number up to --model.lr"),  # rising
        (["--model.betas", "[2, -1]"], "--model.betas must be two numbers in [0, 1)"),
        (["--model.layer_decay", "-0.5"], "--model.layer_decay must be in [0, 1]"),  # lr 0 for most blocks
        (["--model.net_args", "{drop_path_rate: 2}"], "--model.net_args.drop_path_rate must be in [0, 1)"),
        (["--model.net_args", "{depth: 0}"], "--model.net_args.depth must be in [1, inf)"),
        (["--model.net_args", "{patch_size: 0}"], "--model.net_args.patch_size must be in [1, inf)"),
        (["--trainer.accumulate_grad_batches", "0"], "--trainer.accumulate_grad_batches must be at least 1"),
        (["--trainer.limit_train_batches", "0"], "--trainer.limit_train_batches 0 trains nothing"),
        # these three trained nothing, exit 0, and left a summary.json that refused the next fit into the folder
        (["--trainer.max_steps", "0"], "--trainer.max_steps 0 trains nothing"),
        (["--trainer.max_epochs", "0", "--trainer.max_steps", "2"], "--trainer.max_epochs 0 trains nothing"),
        (["--trainer.max_time", "00:00:00:00"], "--trainer.max_time of no time trains nothing"),
        (["--data.img_size", "100000"], "100000 x 100000 at patch 4 is 625,000,000 patches, over the 16,384"),
        (["--trainer.devices", "-5"], "--trainer: "),
        (["--checkpoint.monitor", "val/accuracy"], "--checkpoint.monitor 'val/accuracy' is no metric the run logs"),
        # the network's own message, after the folder scan, named neither option nor a size that fits
        (["--data.img_size", "30"], "--data.img_size 30 is not a multiple of the patch size 4 (vit_micro_patch4_32)"),
        (["--data.img_size", "30", "--model.net_args", "{patch_size: 7}"], "multiple of the patch size 7 (--model"),
    ],
)
def test_impossible_settings_are_one_line_errors(extra, expected, small_folder, tmp_path, capsys):
    assert expected in one_line_error(args(small_folder, tmp_path / "run", *extra), capsys)


@pytest.mark.parametrize("inside", ["runs", "."])
def test_a_run_directory_inside_the_image_folder_is_refused_before_it_is_made(small_folder, capsys, inside):
    run_dir = small_folder / inside  # its confusion_matrix.png made the next fit read a class "runs"
    err = one_line_error(args(small_folder, run_dir), capsys)
    assert "--trainer.default_root_dir must be outside --data.root" in err and not (small_folder / "runs").exists()


def test_a_run_directory_or_image_folder_not_named_in_utf8_is_refused_before_any_work(small_folder, tmp_path, capsys):
    """A run directory so named stopped in a TensorBoard traceback with `.lock` and `tensorboard/` left behind; an
    image folder so named trained, but the run's config.yaml held it as an escape its own --config refused."""
    odd = os.fsdecode(os.fsencode(tmp_path) + b"/run\xff")
    err = one_line_error(args(small_folder, Path(odd)), capsys)
    assert "the run directory b'" in err and "\\xff' is not named in UTF-8" in err and not os.path.exists(odd)
    images = Path(os.fsdecode(os.fsencode(tmp_path) + b"/images\xff"))
    shutil.copytree(small_folder, images)
    err = one_line_error(args(images, tmp_path / "run"), capsys)
    assert "--data.root b'" in err and "is not named in UTF-8" in err and not (tmp_path / "run").exists()


def test_a_pretrained_file_that_is_not_weights_is_a_one_line_error(small_folder, tmp_path, capsys):
    bad = tmp_path / "weights.safetensors"
    bad.write_text("not weights\n")
    extra = ["--model.pretrained", str(bad), "--model.variant", "vit_tiny_patch16_224", "--data.img_size", "32"]
    err = one_line_error(args(small_folder, tmp_path / "run", *extra), capsys)
    assert str(bad) in err and "not a readable timm weights file" in err


@pytest.mark.slow
@pytest.mark.parametrize("where", ["new", "existing"])  # an existing one was locked first: a PermissionError traceback
def test_a_read_only_run_directory_is_a_one_line_error(tmp_path, where):
    """Said before the image folder is read (minutes for a large one): a new run directory was tried only after the
    scan. The folder here is not there yet, so a scan would fail first."""
    read_only = tmp_path / "read_only"
    run = read_only / "run" if where == "new" else read_only
    read_only.mkdir()
    read_only.chmod(0o555)
    try:
        child = run_bound_by_file_modes("-m", "train", *args(tmp_path / "images_still_copying", run))
    finally:
        read_only.chmod(0o755)
    err = the_one_error_line(child.returncode, child.stderr)
    assert f"cannot write into the run directory {run}" in err


@pytest.mark.parametrize("under", ["", "run"])
def test_a_run_directory_through_a_link_to_nowhere_is_refused_before_the_scan(tmp_path, under):
    """Checked before the images are read: a run directory that is, or is under, a link to nowhere passed, and
    failed after the scan with a bare "File exists"."""
    from train.errors import SetupError
    from train.run_dir import check_run_dir

    (tmp_path / "runs").symlink_to(tmp_path / "gone")
    with pytest.raises(SetupError, match=f"cannot be made in {tmp_path / 'runs'}: .* is a link to nowhere"):
        check_run_dir(tmp_path / "runs" / under, None, create=False)


@pytest.mark.parametrize("option", ["--trainer.default_root_dir", "--data.root", "--data.root ~"])
def test_a_run_directory_or_image_folder_that_is_a_link_loop_is_one_line(tmp_path, option, monkeypatch):
    """Python 3.11's Path.resolve raised "RuntimeError: Symlink loop from ..." through vit-train fit."""
    from train.errors import SetupError
    from train.run_dir import check_run_dir

    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    monkeypatch.setenv("HOME", str(tmp_path))
    loop = "~/a" if option.endswith("~") else str(tmp_path / "a")
    run, root = (Path(loop), None) if option == "--trainer.default_root_dir" else (tmp_path / "run", loop)
    with pytest.raises(SetupError, match=f"^{option.split()[0]} {tmp_path / 'a'} is a symbolic link that loops"):
        check_run_dir(run, root, create=False)


def _fake_run(run_dir: Path, *names: str) -> Path:
    """A run directory whose checkpoints are whole torch.save files (enough for the path rules)."""
    (run_dir / "checkpoints").mkdir(parents=True)
    for name in names:
        torch.save({"epoch": 0}, run_dir / "checkpoints" / name)
    return run_dir / "checkpoints"


def test_ckpt_path_last_without_a_last_ckpt_is_refused_naming_the_usable_files(small_folder, tmp_path, capsys):
    ckpts = _fake_run(tmp_path / "run", "best.ckpt")
    before = (ckpts / "best.ckpt").read_bytes()
    err = one_line_error(args(small_folder, tmp_path / "run", "--ckpt_path", "last"), capsys)
    assert f"there is no {ckpts / 'last.ckpt'}" in err and str(ckpts / "best.ckpt") in err
    assert (ckpts / "best.ckpt").read_bytes() == before  # nothing started from scratch over it


def test_ckpt_path_last_in_a_new_run_directory_says_there_is_nothing_to_resume(small_folder, tmp_path, capsys):
    err = one_line_error(args(small_folder, tmp_path / "run", "--ckpt_path", "last"), capsys)
    assert "holds no usable checkpoint: start without --ckpt_path" in err


def _flip_weights(path: Path) -> None:
    """Save a checkpoint at `path` whose weight record then has bytes changed in place, as a bad disk or copy does:
    the zip and its directory stay whole, only the record's checksum tells."""
    weights = torch.arange(1000, dtype=torch.float32)
    torch.save({"epoch": 0, META_KEY: {}, "state_dict": {"net.w": weights}}, path)
    data, raw = bytearray(path.read_bytes()), weights.numpy().tobytes()
    at = data.index(raw) + 400
    data[at : at + 64] = bytes(64)
    path.write_bytes(bytes(data))


def test_a_checkpoint_with_changed_bytes_is_refused_before_it_is_loaded(small_folder, tmp_path, capsys):
    """It loaded without a word: a checkpoint with 64 bytes flipped in one weight exported with exit 0, and its
    parity gate passed at chance accuracy against itself."""
    ckpts = _fake_run(tmp_path / "run", "best.ckpt")
    _flip_weights(ckpts / "last.ckpt")
    err = one_line_error(args(small_folder, tmp_path / "run", "--ckpt_path", "last"), capsys)
    assert "last.ckpt is damaged: its record" in err and "fails its checksum" in err and "best.ckpt" in err
    with pytest.raises(ValueError, match=r"last.ckpt is damaged: its record .* fails its checksum"):
        load_checkpoint(ckpts / "last.ckpt")


def test_a_truncated_last_ckpt_is_one_line_naming_the_usable_files(small_folder, tmp_path, capsys):
    ckpts = _fake_run(tmp_path / "run", "best.ckpt", "last.ckpt")
    whole = (ckpts / "last.ckpt").read_bytes()
    (ckpts / "last.ckpt").write_bytes(whole[: len(whole) // 2])  # what a kill during a copy left
    for ckpt_path in ("last", str(ckpts / "last.ckpt")):
        err = one_line_error(args(small_folder, tmp_path / "run", "--ckpt_path", ckpt_path), capsys)
        assert "last.ckpt is damaged or truncated" in err and f"usable checkpoints: {ckpts / 'best.ckpt'}" in err


def test_another_runs_checkpoint_cannot_be_fitted_into_a_run_that_holds_checkpoints(small_folder, tmp_path, capsys):
    ckpts = _fake_run(tmp_path / "run", "best.ckpt", "last.ckpt")
    other = _fake_run(tmp_path / "other", "last.ckpt") / "last.ckpt"
    before = (ckpts / "best.ckpt").read_bytes()
    err = one_line_error(args(small_folder, tmp_path / "run", "--ckpt_path", str(other)), capsys)
    assert "already holds a run" in err and f"--ckpt_path {other} is not one of its checkpoints" in err
    assert "--overwrite true" in err and (ckpts / "best.ckpt").read_bytes() == before


def test_a_folder_with_no_validation_images_is_refused(tmp_path, capsys):
    root = write_shapes(tmp_path / "shapes", per_class=1)  # one image per class: all of it goes to training
    err = one_line_error(args(root, tmp_path / "run", "--data.calib_fraction", "0"), capsys)  # refused first
    assert "gives no validation images" in err and "at least 2 images" in err
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.parametrize("calib", ["0", "0.1"])
def test_a_class_of_copies_of_one_picture_is_told_so(tmp_path, calib, capsys):
    root = write_shapes(tmp_path / "shapes", per_class=1)
    for image in root.glob("*/*.png"):  # each class: 4 copies of its one picture, which stay in one split
        for i in range(3):
            shutil.copy(image, image.with_name(f"copy{i}.png"))
    err = one_line_error(args(root, tmp_path / "run", "--data.calib_fraction", calib), capsys)
    assert "1 different picture(s)" in err and "copies of one picture stay together" in err, err


def test_fewer_validation_images_than_ddp_processes_is_refused(tmp_path, capsys):
    root = write_shapes(tmp_path / "shapes", per_class=2, classes=("bar", "column"))
    (root / "column" / "001.png").unlink()  # a class of one image trains on it: 1 held out in all
    ddp = ["--trainer.strategy", "ddp", "--trainer.devices", "2", "--trainer.accelerator", "cpu"]
    err = one_line_error(args(root, tmp_path / "run", *ddp, "--data.calib_fraction", "0"), capsys)
    assert "1 validation image(s) for 2 DDP processes" in err and "--data.val_fraction" in err


WRITE_REPORTS = """
import sys
from pathlib import Path
from train.datamodule import ImageFolderDataModule
ImageFolderDataModule(sys.argv[1]).write_reports(Path(sys.argv[2]))
"""


@pytest.mark.slow
def test_an_unreadable_subfolder_is_reported_not_skipped_silently(tmp_path):
    root = write_shapes(tmp_path / "shapes", per_class=3)
    locked = root / "bar" / "more"
    write_shapes(locked, per_class=1, classes=("x",))
    locked.chmod(0o000)
    try:
        child = run_bound_by_file_modes("-c", WRITE_REPORTS, str(root), str(tmp_path / "run"))
    finally:
        locked.chmod(0o755)
    assert child.returncode == 0, child.stderr[-2000:]
    with open(tmp_path / "run" / "bad_files.csv", newline="") as f:
        header, *bad = csv.reader(f)
    assert [path for path, _ in bad] == [str(locked)] and "folder cannot be read" in bad[0][1]
    split = (tmp_path / "run" / "split.json").read_text()
    assert str(root / "bar" / "000.png") in split and str(locked) not in split


@pytest.mark.slow
def test_a_real_checkpoint_served_over_http_validates(http_dir, tmp_path, capsys):
    www, url = http_dir
    root = write_shapes(tmp_path / "shapes", per_class=6)
    main(args(root, tmp_path / "run", "--trainer.limit_train_batches", "1"))
    shutil.copy(tmp_path / "run" / "checkpoints" / "last.ckpt", www / "good.ckpt")
    main(args(root, tmp_path / "other", "--ckpt_path", f"{url}/good.ckpt", command="validate"))
    assert "val/acc" in capsys.readouterr().out


@pytest.mark.slow
def test_an_evaluation_scores_the_runs_own_split_and_leaves_its_files_as_its_fit_wrote_them(tmp_path, capsys, caplog):
    """validate, test and predict scanned the folder again, split it anew and rewrote split.json, reports/ and
    bad_files.csv: after images were added, they scored a split that could hold training images, and the run's
    split (which a resumed fit, vit-export and the review read) was another."""
    root, run = write_shapes(tmp_path / "shapes", per_class=5), tmp_path / "run"
    main(args(root, run, "--trainer.limit_train_batches", "1"))
    scored = {"confusion_matrix.csv", "confusion_matrix.png", "per_class.csv"}  # an evaluation writes its own
    files = [run / "split.json", run / "bad_files.csv", *(run / "reports").iterdir()]
    written = {p: p.read_bytes() for p in files if p.is_file() and p.name not in scored}
    assert len(written) >= 4, sorted(written)
    write_shapes(root, per_class=9, seed=1)  # the folder grows, and a broken file comes in
    (root / "bar" / "broken.png").write_bytes(b"not a png")
    main(args(root, run, command="test"))
    assert "test/acc" in capsys.readouterr().out
    assert "12 image(s) it does not list (added since it started" in caplog.text
    caplog.clear()  # another run's checkpoint (a copy of this one, elsewhere) is scored on a split of its own
    main(args(root, run, "--ckpt_path", shutil.copy(run / "checkpoints" / "best.ckpt", tmp_path), command="test"))
    assert "test/acc" in capsys.readouterr().out and "left out" not in caplog.text
    assert {p: p.read_bytes() for p in written} == written


def test_a_checkpoint_vit_train_did_not_write_is_a_one_line_error(small_folder, tmp_path, capsys):
    foreign = tmp_path / "foreign.ckpt"
    torch.save({"epoch": 0, "weights": torch.zeros(3)}, foreign)  # loads weights-only, but is not a run's checkpoint
    err = one_line_error(args(small_folder, tmp_path / "run", "--ckpt_path", str(foreign), command="validate"), capsys)
    assert f"checkpoint {foreign} is not one vit-train wrote" in err


def test_a_run_directory_beside_a_folders_own_train_and_val_is_not_refused(tmp_path):
    """root/train and root/val are what is scanned there: root/runs is never read as a class."""
    from train.run_dir import check_run_dir

    write_shapes(tmp_path / "flowers" / "train", per_class=1)
    write_shapes(tmp_path / "flowers" / "val", per_class=1)
    check_run_dir(tmp_path / "flowers" / "runs", str(tmp_path / "flowers"))
    assert (tmp_path / "flowers" / "runs").is_dir()


def test_validate_without_a_checkpoint_is_refused_rather_than_scoring_untrained_weights(small_folder, tmp_path, capsys):
    """It scored the random network at chance with exit 0, and rewrote the run's config.yaml and reports."""
    for command in ("validate", "test", "predict"):
        err = one_line_error(args(small_folder, tmp_path / "empty", command=command), capsys)
        assert f"vit-train {command} scores trained weights" in err and "--ckpt_path" in err


@pytest.mark.slow
@pytest.mark.parametrize(
    ("signal_name", "code", "said"), [("SIGTERM", 143, "SIGTERM"), ("SIGINT", 130, "Ctrl-C (SIGINT)")]
)
def test_a_fit_stopped_by_a_signal_exits_with_its_code_and_says_how_to_resume(
    small_folder, tmp_path, signal_name, code, said
):
    """Lightning's SIGTERM exit has no code: a scheduler read the stopped run as a success (exit 0). And `timeout`,
    systemd and SLURM signal the whole process group: a DataLoader worker died of it first, and the run ended with
    PyTorch's "DataLoader worker ... is killed by signal: Terminated" traceback, exit 1 and no word on resuming.
    Ctrl-C (SIGINT to the terminal's process group) ended in Lightning's exit 1, as a failure, with no word either.
    The fit replaces an earlier run (--overwrite true), which kept its checkpoints and summary.json until the new
    run wrote its own: stopped before that, the old model stood under the new config, for --ckpt_path last."""
    _fake_run(tmp_path / "run", "best.ckpt", "last.ckpt", "epoch=3.ckpt")
    (tmp_path / "run" / "summary.json").write_text("{}")
    run, fault = (
        tmp_path / "run",
        [f"{FAULTS}Stop", "--trainer.callbacks.epoch", "1", "--trainer.callbacks.group", "true",
         "--trainer.callbacks.signal", signal_name],
    )  # fmt: skip
    argv = args(small_folder, run, "--trainer.max_epochs", "3", "--data.num_workers", "2", "--overwrite", "true")
    argv += fault
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    child = subprocess.run(  # a session of its own: the signal goes to its process group, not to pytest's
        [sys.executable, "-m", "train", *argv],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # not ignored, whatever pytest inherited
    )
    err = the_one_error_line(child.returncode, child.stderr, code=code)
    assert f"stopped by {said}" in err and "--ckpt_path last" in err
    assert (run / "checkpoints" / "last.ckpt").is_file() and not (run / "summary.json").exists()
    assert "state_dict" in torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)  # this run's, not the old
    assert not (run / "checkpoints" / "epoch=3.ckpt").exists()


def test_a_replacing_fit_refused_for_its_checkpoint_keeps_the_run_it_replaces(small_folder, tmp_path, capsys):
    """--overwrite true removed the old run before the checkpoint was checked (as it loads): a checkpoint trained on
    other classes was refused, and the run it was to replace was gone already."""
    import lightning

    from tests.train.test_distillation import write_teacher

    ckpts = _fake_run(tmp_path / "run", "best.ckpt", "last.ckpt")
    (tmp_path / "run" / "summary.json").write_text("{}")
    other = write_teacher(tmp_path / "other.ckpt", classes=["x", "y", "z"])  # another run's, on other classes
    state = torch.load(other, weights_only=True) | {"pytorch-lightning_version": lightning.__version__, "epoch": 0}
    torch.save(state | {"global_step": 0}, other)
    argv = args(small_folder, tmp_path / "run", "--overwrite", "true", "--ckpt_path", str(other))
    assert "the checkpoint was trained on 3 classes ['x', 'y', 'z']" in one_line_error(argv, capsys)
    assert sorted(p.name for p in ckpts.iterdir()) == ["best.ckpt", "last.ckpt"]
    assert (tmp_path / "run" / "summary.json").is_file()


def test_a_fit_stopped_before_its_first_checkpoint_is_told_to_start_again_not_to_resume(tmp_path, capsys, monkeypatch):
    """Told "--ckpt_path last resumes it", the user got "there is no last.ckpt" for doing so."""
    import train.cli as cli

    monkeypatch.setattr(cli, "FIT_RUN", [(tmp_path / "run", 0.0)])
    assert cli.stopped("Ctrl-C (SIGINT)", 130, ["fit", "--config", "x.yaml"]).code == 130
    said = "vit-train: stopped by Ctrl-C (SIGINT) before its first checkpoint; the same command runs it again\n"
    assert capsys.readouterr().err == said
    _fake_run(tmp_path / "run", "last.ckpt")
    monkeypatch.setattr(cli, "FIT_RUN", [(tmp_path / "run", time.time() + 60)])  # --overwrite: the replaced run's
    cli.stopped("Ctrl-C (SIGINT)", 130, ["fit", "--config", "x.yaml"])
    assert capsys.readouterr().err == said
    monkeypatch.setattr(cli, "FIT_RUN", [(tmp_path / "run", 0.0)])
    cli.stopped("SIGTERM", 143, ["fit", "--config", "x.yaml"])
    assert (
        capsys.readouterr().err == "vit-train: stopped by SIGTERM; the same command with --ckpt_path last resumes it\n"
    )


def test_a_stopped_evaluation_is_not_told_to_resume(capsys):
    # `--ckpt_path last` would score the last checkpoint where validate, test and predict score the best one
    from train.cli import stopped

    assert stopped("SIGTERM", 143, ["validate", "--config", "x.yaml"]).code == 143
    assert capsys.readouterr().err == "vit-train: stopped by SIGTERM\n"
