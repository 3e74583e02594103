"""`vit-predict --ray` on a local Ray cluster started here (a head and a worker node, one CPU each).

The Parquet directory holds the local run's rows, image for image (a name that is not UTF-8 included),
unreadable files left out and reported the same way; an actor killed mid-job loses and duplicates nothing; a
run killed while it writes leaves no table at --out, and a job no image reached writes the local run's columns.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Collection
from pathlib import Path

import pytest
from PIL import Image

from serve.runtime.predict import main as predict_local
from tests.helpers import CLASS_NAMES, quadrant_images, wait_until

ray = pytest.importorskip("ray.data")
pq = pytest.importorskip("pyarrow.parquet")
pd = pytest.importorskip("pandas")
import ray as ray_core  # noqa: E402 (after the skip when ray is absent)

from serve.cluster import ray_job  # noqa: E402
from serve.cluster.cli import main as vit_predict  # noqa: E402
from serve.cluster.output import OutputFolder  # noqa: E402
from serve.server.testing import LocalRayCluster  # noqa: E402

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
COVERAGE = "0.9"  # every run here also writes prediction sets, unknown verdicts and OOD scores
ACTOR_TITLE = b"MapBatches(Scorer)"  # how Ray names the actor processes of `map_batches(Scorer)`


@pytest.fixture(scope="module")
def cluster():
    with LocalRayCluster(nodes=2, cpus_per_node=1) as c:
        yield c


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> Path:
    """241 images in two folders, one named with a byte that is not UTF-8, and four files that cannot be read
    (a link to nothing among them)."""
    folder = tmp_path_factory.mktemp("photos")
    images, labels = quadrant_images(240, seed=11)
    for i, (img, label) in enumerate(zip(images, labels, strict=True)):
        sub = folder / ("b" if i % 2 else "a")
        sub.mkdir(exist_ok=True)
        Image.fromarray(img).save(sub / f"{i:04d}_{CLASS_NAMES[label]}.png")
    good = (folder / "a" / "0000_top_left.png").read_bytes()
    (folder / "a" / "truncated.png").write_bytes(good[: len(good) // 2])
    (folder / "b" / "notes.jpg").write_text("not an image")
    (folder / "b" / "empty.png").write_bytes(b"")
    (folder / "a" / "zz\udcffname.png").write_bytes(good)  # the file system's name is b"zz\xffname.png"
    (folder / "a" / "dead.png").symlink_to("/nonexistent.png")
    return folder


@pytest.fixture(scope="module")
def local_rows(tiny_onnx, photos, tmp_path_factory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("local") / "preds.parquet"
    args = [str(tiny_onnx), str(photos), "--out", str(out), "--top-k", "3", "--coverage", COVERAGE]
    assert predict_local(args) == 1
    return {r["path"]: r for r in pq.read_table(out).to_pylist()}


def _ray_predict(model: Path, inputs: list[Path], out: Path, address: str, *args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_AUTH_MODE": "disabled"}
    cmd = [sys.executable, "-m", "serve.cluster.cli", str(model), *map(str, inputs), "--ray", "--ray-address", address]
    cmd += ["--out", str(out), "--top-k", "3", "--coverage", COVERAGE]
    cmd += ["--workers", "2", "--cpus-per-worker", "1", *args]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _check_same_as_local(out: Path, local_rows: dict[str, dict]) -> None:
    table = pq.read_table(out)
    assert len(pd.read_parquet(out)) == len(local_rows)  # how a user reads it: every part's path is text
    assert table.column_names == list(next(iter(local_rows.values())))  # the same columns, in the same order
    rows = table.to_pylist()
    assert sorted(r["path"] for r in rows) == sorted(local_rows)  # every image once, no unreadable one
    for row in rows:
        want = local_rows[row["path"]]
        assert [row[f"label_{i}"] for i in (1, 2, 3)] == [want[f"label_{i}"] for i in (1, 2, 3)]
        assert [row[f"score_{i}"] for i in (1, 2, 3)] == pytest.approx(
            [want[f"score_{i}"] for i in (1, 2, 3)], abs=1e-6
        )
        assert row["prediction_set"] == want["prediction_set"] and row["unknown"] == want["unknown"]
        assert row["ood_score"] == pytest.approx(want["ood_score"], abs=1e-6)


def test_ray_run_writes_the_local_runs_predictions_image_for_image(cluster, tiny_onnx, photos, local_rows, tmp_path):
    out = tmp_path / "preds.parquet"
    proc = _ray_predict(tiny_onnx, [photos], out, cluster.address, "--batch-size", "16")
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 1, err  # 1: some inputs could not be read
    assert out.is_dir() and len(list(out.glob("*.parquet"))) >= 1
    _check_same_as_local(out, local_rows)
    assert str(photos / "a" / "zz\\xffname.png") in local_rows  # the local run's spelling, which Ray's rows match
    reported = sorted(line.split(":")[0].rsplit("/", 1)[1] for line in err.splitlines() if line.startswith(str(photos)))
    assert reported == ["dead.png", "empty.png", "notes.jpg", "truncated.png"]
    assert f"{photos}/a/dead.png: a symbolic link to /nonexistent.png, which does not exist (or loops)" in err
    assert "classified 241 images; 4 input(s) could not be read" in err


def _actor_pids(cluster: LocalRayCluster, before: Collection[int] = ()) -> list[int]:
    """The scoring actors running in `cluster`'s sessions, but those in `before` (an earlier job's, still stopping):
    another run's actors on the machine, or this file's last job's, are not this job's."""
    sessions = {p.pid for p in cluster.procs}  # each node starts a session; a worker has its own process group
    pids = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if ACTOR_TITLE not in f.read():
                    continue
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
            session = int(stat[stat.rindex(b")") + 2 :].split()[3])  # after the name: state, parent, group, session
        except (OSError, ValueError):
            continue
        if session in sessions and int(entry) not in before:
            pids.append(int(entry))
    return pids


def test_an_actor_killed_mid_job_loses_and_duplicates_nothing(cluster, tiny_onnx, photos, local_rows, tmp_path):
    out = tmp_path / "preds.parquet"
    before = set(_actor_pids(cluster))
    proc = _ray_predict(tiny_onnx, [photos], out, cluster.address, "--batch-size", "2")  # many small batches
    deadline = time.monotonic() + 240
    while not (pids := _actor_pids(cluster, before)):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    os.kill(pids[0], signal.SIGKILL)  # one of this job's actors, started by the cluster this test runs
    assert proc.poll() is None  # killed while the job was running
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 1, err
    _check_same_as_local(out, local_rows)


def test_sigterm_mid_job_stops_the_run_as_ctrl_c_does_with_the_shells_status(cluster, tiny_onnx, photos, tmp_path):
    """`timeout`, systemd and a pod's stop send SIGTERM: Ray's own handler, set by `ray.init`, exited 15 without a
    word, where the local run says what was kept and exits 143."""
    out = tmp_path / "preds.parquet"
    before = set(_actor_pids(cluster))
    proc = _ray_predict(tiny_onnx, [photos], out, cluster.address, "--batch-size", "2")
    deadline = time.monotonic() + 240
    while not _actor_pids(cluster, before):  # the job runs on the cluster: its driver has called ray.init
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err
    said = f"vit-predict: terminated: {out} was not written (--ray runs the whole job again)"
    assert err.strip().splitlines()[-1] == said
    assert list(tmp_path.iterdir()) == []  # neither the table nor its parts


def test_a_run_killed_while_writing_leaves_no_table_and_the_next_run_starts_over(
    cluster, tiny_onnx, photos, local_rows, tmp_path
):
    out = tmp_path / "preds.parquet"
    proc = _ray_predict(tiny_onnx, [photos], out, cluster.address, "--batch-size", "2")  # a part for each 2 images
    wait_until(lambda: list(tmp_path.glob("*/*.parquet")) or proc.poll() is not None, 240, "the first part written")
    proc.kill()  # SIGKILL while the parts are being written: no handler of ours runs
    assert proc.wait(timeout=60) == -signal.SIGKILL, proc.communicate()
    assert not out.exists()  # not a table that reads as complete with rows missing
    # the same --out again, here of files that cannot be read: Ray scores none, and the table has the columns alone
    unreadable = [photos / "a" / "truncated.png", photos / "b" / "notes.jpg"]
    proc = _ray_predict(tiny_onnx, unreadable, out, cluster.address, "--workers", "1")
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 1, err
    assert f"{out}.incomplete: deleting the parts of a stopped --ray run" in err
    assert "classified 0 images; 2 input(s) could not be read" in err
    assert pq.read_table(out).column_names == list(next(iter(local_rows.values()))) and len(pd.read_parquet(out)) == 0
    assert [p.name for p in tmp_path.iterdir()] == [out.name]  # nothing else left beside it


def test_a_job_no_image_reached_writes_the_local_runs_columns_without_starting_ray(tiny_onnx, tmp_path, monkeypatch):
    empty = tmp_path / "empty"
    empty.mkdir()
    args = [str(tiny_onnx), str(empty), "--top-k", "3", "--coverage", COVERAGE]
    assert predict_local([*args, "--out", str(tmp_path / "local.parquet")]) == 1
    monkeypatch.setattr(ray_core, "init", lambda *a, **kw: pytest.fail("Ray started for a job of no inputs"))
    assert vit_predict([*args, "--ray", "--out", str(tmp_path / "ray.parquet")]) == 1
    local, remote = pq.read_table(tmp_path / "local.parquet"), pq.read_table(tmp_path / "ray.parquet")
    assert remote.num_rows == 0 and remote.schema.equals(local.schema)  # the header: names and types


def test_ctrl_c_leaves_neither_out_nor_its_parts(tiny_onnx, photos, tmp_path, monkeypatch, capsys):
    out = tmp_path / "preds.parquet"

    def interrupted(sources, folder, *args):
        (folder / "part-0.parquet").write_bytes(b"a part Ray wrote before the interrupt")
        raise KeyboardInterrupt

    monkeypatch.setattr(ray_job, "_score", interrupted)
    assert vit_predict([str(tiny_onnx), str(photos), "--ray", "--out", str(out)]) == 130
    assert f"interrupted: {out} was not written" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_a_second_run_on_the_same_out_is_refused_while_the_first_writes_it(tmp_path):
    first, second = OutputFolder(tmp_path / "preds.parquet"), OutputFolder(tmp_path / "preds.parquet")
    first.take(sys.stderr)
    (first.tmp / "part-0.parquet").write_bytes(b"the first run's part")
    with pytest.raises(ValueError, match="another vit-predict is writing"):
        second.take(sys.stderr)
    assert (first.tmp / "part-0.parquet").exists()  # not deleted as a stopped run's
    first.release()


@pytest.mark.parametrize("option", ["--threads", "--decode-threads"])
def test_ray_refuses_the_thread_options_it_would_ignore_before_ray_starts(option, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(ray_core, "init", lambda *a, **kw: pytest.fail("Ray started for arguments it cannot run"))
    with pytest.raises(SystemExit) as stopped:
        vit_predict(
            [str(tmp_path / "model.onnx"), str(tmp_path), option, "2", "--ray", "--out", str(tmp_path / "p.parquet")]
        )
    assert stopped.value.code == 2 and "with --ray, give --cpus-per-worker" in capsys.readouterr().err


def test_a_folder_at_the_parts_path_that_vit_predict_did_not_make_is_refused_and_kept(tiny_onnx, tmp_path, capsys):
    """Any folder named like --out's parts (`preds.parquet.incomplete`) was taken for a stopped run's and deleted
    whole, whatever it held: a folder of someone's notes went with the next run."""
    out, empty = tmp_path / "preds.parquet", tmp_path / "empty"
    empty.mkdir()
    theirs = tmp_path / "preds.parquet.incomplete"
    (theirs / "sub").mkdir(parents=True)
    (theirs / "notes.txt").write_text("precious")
    (theirs / "part-0.parquet").write_bytes(b"a part beside them")
    assert vit_predict([str(tiny_onnx), str(empty), "--ray", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"{theirs} is not a folder of vit-predict's (it holds notes.txt): remove it, or give another --out" in err
    assert (theirs / "notes.txt").read_text() == "precious" and (theirs / "sub").is_dir()
    assert (theirs / "part-0.parquet").is_file()
    (theirs / "notes.txt").unlink()
    with pytest.raises(ValueError, match=r"is not a folder of vit-predict's \(it holds sub\)"):
        OutputFolder(out).take(sys.stderr)
    assert (theirs / "sub").is_dir() and (theirs / "part-0.parquet").is_file()


def test_a_stopped_runs_parts_are_deleted_and_its_folder_reused_by_the_next_run(tmp_path, capsys):
    out = tmp_path / "preds.parquet"
    stopped = OutputFolder(out)
    stopped.take(sys.stderr)
    (stopped.tmp / "part-0.parquet").write_bytes(b"a part of a run killed before it published")
    os.close(stopped._held)  # the kernel lets go of the lock as a SIGKILL would; the folder stays
    folder = OutputFolder(out)
    folder.take(sys.stderr)
    assert f"{folder.tmp}: deleting the parts of a stopped --ray run" in capsys.readouterr().err
    assert not (folder.tmp / "part-0.parquet").exists()
    (folder.tmp / "part-1.parquet").write_bytes(b"this run's part")
    folder.publish({"path": "x"})
    folder.release()
    assert [p.name for p in out.iterdir()] == ["part-1.parquet"]


@pytest.mark.cluster
def test_a_worker_larger_than_the_ray_started_here_is_refused_not_waited_for(tiny_onnx, photos, tmp_path):
    """A worker reserving more CPUs than the Ray the run started has waited for ever, "pending: 64 CPU"."""
    out = tmp_path / "preds.parquet"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)
    cmd = [sys.executable, "-m", "serve.cluster.cli", str(tiny_onnx), str(photos), "--ray", "--out", str(out)]
    run = subprocess.run([*cmd, "--cpus-per-worker", "64"], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 2, run.stderr[-2000:]
    assert (
        "a worker reserves 64 CPUs (--cpus-per-worker) and Ray has" in run.stderr
        and "lower --cpus-per-worker" in run.stderr
    )
    assert list(tmp_path.iterdir()) == []  # neither the table nor its parts
