"""`vit-train review`: the decisions file fit reads, the refusals, and the page in a real browser (Chromium)."""

from __future__ import annotations

import csv
import json
import logging
import os
import shutil
import socket
from pathlib import Path

import httpx
import pytest
from PIL import Image

from tests.helpers import CLASS_NAMES, TINY_NET, free_port, quadrant_images, wait_until
from tests.serve.test_browser import CHROMIUM, CHROMIUM_ARGS
from train.corrections import load_corrections
from train.review_store import Decisions


def write_review_run(root: Path, classes: list[str] = CLASS_NAMES) -> Path:
    """A run directory as fit leaves it: checkpoints/best.ckpt (a seeded, untrained tiny ViT in the contract
    format: wrong often enough to give every list images), split.json over real PNGs in one folder per class of
    `classes`, and reports/ with the two lists the run writes (label issues, copies)."""
    import torch

    from vit import VisionTransformer

    torch.manual_seed(0)
    net = VisionTransformer(**TINY_NET).eval()
    split = {"root": str(root / "data"), "classes": classes}
    for key, seed, n in (("train", 0, 24), ("val", 1, 12), ("calib", 2, 24)):
        images, labels = quadrant_images(n, seed=seed)
        split[key] = []
        for i, (img, y) in enumerate(zip(images, labels, strict=True)):
            path = root / "data" / classes[y] / f"{key}{i:02d}.png"
            path.parent.mkdir(parents=True, exist_ok=True)
            Image.fromarray(img).save(path)
            split[key].append({"path": str(path), "label": int(y)})
    (root / "split.json").write_text(json.dumps(split))
    meta = {
        "model_config": net.config,
        "class_names": classes,
        "preprocess": {"img_size": [32, 32], "crop_pct": 1.0, "interpolation": "bicubic"},
        "weights_prefix": "net.",
        "variant": "tiny_test",
    }
    (root / "checkpoints").mkdir()
    state = {"net." + k: v for k, v in net.state_dict().items()}
    torch.save({"state_dict": state, "vitscope": meta}, root / "checkpoints" / "best.ckpt")
    (root / "reports").mkdir()
    with open(root / "reports" / "label_issues.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["path", "given", "suggested", "score"])
        for i, e in enumerate(split["train"][:3]):
            w.writerow([e["path"], classes[e["label"]], classes[(e["label"] + 1) % 4], 0.9 - i / 10])
    with open(root / "reports" / "duplicates.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["group", "path", "kind", "split"])
        w.writerows([[0, split["train"][5]["path"], "exact", "train"], [0, split["val"][0]["path"], "exact", "val"]])
    return root


@pytest.fixture(scope="module")
def review_run(tmp_path_factory) -> Path:
    pytest.importorskip("torch")
    return write_review_run(tmp_path_factory.mktemp("review") / "run")


def test_review_of_a_run_folder_that_is_a_link_loop_is_one_line(tmp_path, capsys):
    """Python 3.11's Path.resolve raised "RuntimeError: Symlink loop from ..." (exit 1)."""
    from train.cli import main

    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    with pytest.raises(SystemExit) as e:
        main(["review", str(tmp_path / "a")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith(f"vit-train review: {tmp_path / 'a'} is a symbolic link that loops")


def test_review_refuses_a_run_without_checkpoints_or_reports_and_names_missing_lists(
    review_run, tmp_path, capsys, caplog
):
    from train.cli import main

    with pytest.raises(SystemExit) as e, caplog.at_level(logging.INFO):
        main(["review", str(tmp_path)])
    assert e.value.code == 2
    assert "has no checkpoints/best.ckpt or last.ckpt" in capsys.readouterr().err
    assert "scoring" not in caplog.text  # it said "scoring the images of ..." before refusing the folder
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "best.ckpt").write_bytes((review_run / "checkpoints" / "best.ckpt").read_bytes())
    (tmp_path / "split.json").write_text((review_run / "split.json").read_text())
    with pytest.raises(SystemExit):
        main(["review", str(tmp_path)])
    assert "has no reports/ folder" in capsys.readouterr().err
    from train.review_data import LISTS, ReviewRun

    (tmp_path / "reports").mkdir()  # a run from before these reports: reviewed, and the page says what is missing
    assert set(ReviewRun(tmp_path).missing) == set(LISTS[:2])
    # another run's split (a refit stopped before its first checkpoint): an IndexError, or every label shown wrong
    split = json.loads((review_run / "split.json").read_text())
    for classes in ([*split["classes"], "extra"], split["classes"][::-1], None):
        other = {**split, "classes": classes} if classes else {"classes": split["classes"]}  # None: no root
        (tmp_path / "split.json").write_text(json.dumps(other))
        with pytest.raises(SystemExit):
            main(["review", str(tmp_path)])
        err = capsys.readouterr().err
        assert err.startswith("vit-train review: ") and "Traceback" not in err and "split.json" in err, err


def test_a_port_in_use_is_said_before_the_run_is_scored(review_run, capsys, caplog):
    """The review scored every image of the run (minutes for a large one) before Gradio found the port taken."""
    from train.cli import main

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(SystemExit) as e, caplog.at_level(logging.INFO):
            main(["review", str(review_run), "--port", str(port)])
    assert e.value.code == 2 and "scoring" not in caplog.text
    assert f"port {port} on 127.0.0.1 is in use" in capsys.readouterr().err


def test_review_lists_every_kind_of_image_to_look_at(review_run):
    from train.review_data import LISTS, ReviewRun

    run = ReviewRun(review_run)
    assert [len(run.lists[name]) > 0 for name in LISTS[:2]] == [True, True]
    errors = run.lists[LISTS[3]]
    assert errors and all(it.given != it.suggested for it in errors)
    assert [it.score for it in errors] == sorted((it.score for it in errors), reverse=True)  # most sure first
    pixels, probs, overlay = run.explain(run.lists[LISTS[0]][0].path)
    assert pixels.shape == (32, 32, 3) and overlay.shape == (256, 256, 3)
    assert set(probs) == set(CLASS_NAMES) and abs(sum(probs.values()) - 1) < 1e-5
    assert run.calibrated and run.missing == {}


@pytest.mark.browser
@pytest.mark.slow
def test_relabel_and_leave_out_in_a_real_browser_survive_a_reload(review_run):
    if not CHROMIUM.exists():
        pytest.skip("Debian's chromium is not installed at /usr/bin/chromium (apt-get install chromium)")
    pytest.importorskip("playwright")
    pytest.importorskip("gradio")
    from playwright.sync_api import sync_playwright

    from train.review import launch_review

    (review_run / "corrections.csv").unlink(missing_ok=True)
    split = json.loads((review_run / "split.json").read_text())
    first, second = split["train"][1], split["train"][2]  # the 2nd and 3rd likely wrong labels
    port = free_port()
    app = launch_review(review_run, port=port, block=False)
    try:  # the page takes no upload: Gradio's upload route kept whatever it was sent, in /tmp, for ever
        upload = httpx.post(
            f"http://127.0.0.1:{port}/gradio_api/upload", files={"files": ("a.bin", bytes(1 << 20))}, timeout=30
        )
        assert upload.status_code == 413
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
            try:
                page = browser.new_page()
                page.set_default_timeout(30_000)
                page.goto(f"http://127.0.0.1:{port}/", wait_until="domcontentloaded")
                page.locator("#about", has_text="1 of 3").wait_for()
                page.locator("#items [role=gridcell]", has_text=Path(first["path"]).name).click()
                page.locator("#about", has_text="2 of 3").wait_for()
                page.locator("#new-label input").click()
                page.get_by_role("option", name="bottom_right").click()
                page.locator("#relabel").click()
                page.locator("#status", has_text="relabelled bottom_right").wait_for()
                page.locator("#about", has_text="3 of 3").wait_for()  # moved on to the next image
                page.locator("#leave-out").click()
                page.locator("#status", has_text="left out").wait_for()

                page.reload(wait_until="domcontentloaded")
                page.locator("#about", has_text="1 of 3").wait_for()
                table = page.locator("#items")
                table.locator("[role=gridcell]", has_text="relabelled bottom_right").wait_for()
                table.locator("[role=gridcell]", has_text="left out").wait_for()
                page.locator("#items [role=gridcell]", has_text=Path(second["path"]).name).click()
                page.locator("#about", has_text="Decision: left out").wait_for()
            finally:
                browser.close()
    finally:
        app.close()
    file = review_run / "corrections.csv"
    root = json.loads((review_run / "split.json").read_text())["root"]  # relative paths start there, as in fit
    fixes = wait_until(lambda: file.is_file() and load_corrections(file, root, CLASS_NAMES), 5, "corrections")
    assert fixes == {first["path"]: "bottom_right", second["path"]: None}


def test_keep_records_the_given_label_and_a_class_the_run_does_not_know_cannot_be_kept(review_run, tmp_path):
    gr = pytest.importorskip("gradio")
    from train.review_app import ReviewActions
    from train.review_data import LISTS, Item, ReviewRun

    on = ReviewActions(ReviewRun(review_run, limit=2))
    on.decisions = Decisions(tmp_path / "corrections.csv", on.run.data_root, on.run.labels)
    copy = on.run.lists[LISTS[1]][0]
    on.decide(LISTS[1], 0, "keep", None)
    assert on.decisions.all() == {copy.path: copy.given}
    on.run.lists[LISTS[1]][1] = Item(str(tmp_path / "gone.png"), "?", None, 0.0, "copy")
    with pytest.raises(gr.Error, match="relabel it or leave it out"):
        on.decide(LISTS[1], 1, "keep", None)
    assert on.decisions.all() == {copy.path: copy.given}


def test_a_review_starts_from_the_corrections_its_run_was_trained_with(tmp_path):
    """Round one's corrections trained run two; its review wrote only round two's decisions, and the fit on them put
    round one's relabelled and left-out images back as they were, without a word. The review now carries them on."""
    pytest.importorskip("gradio")
    from train.review_app import ReviewActions
    from train.review_data import ReviewRun

    run = write_review_run(tmp_path / "run")
    split = json.loads((run / "split.json").read_text())
    relabelled, left_out, new = (split[k][i]["path"] for k, i in (("train", 7), ("train", 8), ("val", 3)))
    earlier = tmp_path / "round1.csv"  # relative to the data root, as a person writes one
    rel = lambda p: os.path.relpath(p, split["root"])
    earlier.write_text(f"path,label\n{rel(relabelled)},top_left\n{rel(left_out)},\n")
    (run / "split.json").write_text(json.dumps({**split, "corrections": str(earlier)}))
    on = ReviewActions(ReviewRun(run, limit=2))
    assert on.decisions.all() == {relabelled: "top_left", left_out: None}
    on.decisions.decide(new, "bottom_left")
    every = load_corrections(run / "corrections.csv", split["root"], CLASS_NAMES)
    assert every == {relabelled: "top_left", left_out: None, new: "bottom_left"}  # round one's and round two's


def test_a_corrections_file_with_a_label_that_is_no_class_is_refused_when_the_review_starts(
    review_run, tmp_path, caplog
):
    """The review took 'Four' for a decision and wrote it back; the next fit then refused the whole file. It is
    refused before the run is scored (minutes for a large one): it was only after."""
    from train.review_data import ReviewRun

    run = tmp_path / "run"
    shutil.copytree(review_run, run)
    (run / "corrections.csv").write_text("path,label\n/data/4/0004.png,Four\n")
    with pytest.raises(ValueError, match="line 2: label 'Four' is not a class"), caplog.at_level(logging.INFO):
        ReviewRun(run, limit=2)
    assert "scoring" not in caplog.text


def _in_split(change):
    return lambda text: (split := json.loads(text), change(split), json.dumps(split))[-1]


def _rows_after_header(*rows: str):
    return lambda text: "\n".join([text.splitlines()[0], *rows, ""])


DAMAGES = {
    "copies header cut": ("reports/duplicates.csv", lambda text: "group,path,ki"),
    "copy group no number": ("reports/duplicates.csv", _rows_after_header("x,/x.png,exact,train")),
    "label issues header cut": ("reports/label_issues.csv", lambda text: "path,giv"),
    "label issues in utf-16": ("reports/label_issues.csv", lambda text: text.encode("utf-16")),
    "class index out of range": ("reports/label_issues.csv", _rows_after_header("/x.png,99,1,0.5")),
    "score no number": ("reports/label_issues.csv", _rows_after_header("/x.png,0,1,abc")),
    "stray quote": ("reports/label_issues.csv", _rows_after_header('"/x.png,0,1,0.5', "/y.png,0,1,0.5")),
    "stray quote over the field limit": ("reports/label_issues.csv", _rows_after_header('"' + "a" * 200_000)),
    "split label 99": ("split.json", _in_split(lambda split: split["train"][0].update(label=99))),
    "split label -1": ("split.json", _in_split(lambda split: split["train"][0].update(label=-1))),
    "split label true": ("split.json", _in_split(lambda split: split["val"][0].update(label=True))),
    "split entry without path": ("split.json", _in_split(lambda split: split["val"][0].pop("path"))),
    "split path a number": ("split.json", _in_split(lambda split: split["calib"][0].update(path=5))),
    "split train null": ("split.json", _in_split(lambda split: split.update(train=None))),
}


@pytest.mark.parametrize(("file", "damage"), DAMAGES.values(), ids=DAMAGES.keys())
def test_a_damaged_report_or_split_entry_is_refused_in_one_line_naming_the_file(review_run, tmp_path, file, damage):
    """Each ended the review in a traceback (KeyError: 'kind', IndexError, TypeError, _csv.Error), was read wrong
    without a word (a label -1 shown as the last class), or was said without naming the file."""
    from train.errors import SetupError
    from train.review_data import ReviewRun

    run = Path(shutil.copytree(review_run, tmp_path / "run"))
    damaged = damage((run / file).read_text())
    (run / file).write_bytes(damaged if isinstance(damaged, bytes) else damaged.encode())
    with pytest.raises(SetupError) as refused:
        ReviewRun(run, limit=5)
    said = str(refused.value)
    assert said.startswith(str(run / file)) and len(said.splitlines()) == 1, said
    assert ("line " in said and "run vit-train fit again" in said) or "fit the run again" in said, said


def test_an_image_gone_since_the_run_is_shown_as_such_and_can_be_left_out(review_run, tmp_path):
    """A moved image made the page answer an error for the click that had just been saved, and it could never be
    chosen, so never left out."""
    pytest.importorskip("gradio")
    from train.review_app import ReviewActions
    from train.review_data import LISTS, ReviewRun

    run = tmp_path / "run"
    shutil.copytree(review_run, run)
    on = ReviewActions(ReviewRun(run, limit=3))
    items = on.run.lists[LISTS[0]]
    Path(items[1].path).rename(tmp_path / "moved.png")
    try:
        rows, pixels, overlay, probs, about, choice, shown, seen, status = on.decide(LISTS[0], 0, "leave", None)
        assert shown == (LISTS[0], 1) and pixels is None and "Cannot read it" in about and "left out" in status
        *_, status = on.decide(LISTS[0], 1, "leave", None)
        assert on.decisions.all()[items[1].path] is None and "left out" in status
    finally:
        (tmp_path / "moved.png").rename(items[1].path)
