"""`train.review_store.Decisions`: the review's decisions file, written at each click and read as fit reads it."""

from __future__ import annotations

from pathlib import Path

from train.corrections import load_corrections
from train.review_store import Decisions

CLASSES = ["cat", "dog"]


def test_each_decision_is_on_disk_at_once_and_fit_reads_the_latest(tmp_path: Path):
    file = tmp_path / "corrections.csv"
    a, b = str(tmp_path / "cat" / "1.png"), str(tmp_path / "cat" / "2.png")
    decisions = Decisions(file, tmp_path, CLASSES)
    decisions.decide(a, "dog")
    assert load_corrections(file, tmp_path, CLASSES) == {a: "dog"}  # written before decide returned
    decisions.decide(b, None)
    decisions.decide(a, "cat")  # a change of mind
    assert load_corrections(file, tmp_path, CLASSES) == {a: "cat", b: None}
    assert [p.name for p in tmp_path.iterdir()] == ["corrections.csv"]  # no temporary file left behind
    assert Decisions(file, tmp_path, CLASSES).all() == {a: "cat", b: None}  # a restarted review starts from them


def test_a_decision_keeps_what_another_review_or_a_hand_edit_wrote_since(tmp_path: Path):
    """Each click wrote back the file as the review read it at start: a row added by hand, or another review's
    decisions on the same run, were gone after one click."""
    file = tmp_path / "corrections.csv"
    mine, other = Decisions(file, "/data", CLASSES), Decisions(file, "/data", CLASSES)  # two reviews of one run
    mine.decide("/data/cat/1.png", "dog")
    other.decide("/data/cat/2.png", None)
    with open(file, "a") as f:
        f.write("/data/dog/3.png,cat\n")  # by hand, while both run
    mine.decide("/data/dog/4.png", "dog")
    assert load_corrections(file, "/data", CLASSES) == {
        "/data/cat/1.png": "dog", "/data/cat/2.png": None, "/data/dog/3.png": "cat", "/data/dog/4.png": "dog"
    }  # fmt: skip


def test_an_image_named_two_ways_is_one_image_and_its_newest_decision_is_the_last_row(tmp_path: Path):
    """The review's absolute row and an older hand row naming the image from the data root were kept both, the
    hand row last: fit trained its label, not the review's newest one."""
    file = tmp_path / "corrections.csv"
    file.write_text("path,label\n/data/cat/1.png,dog\n/data/cat/2.png,\ncat/../cat/1.png,cat\n")
    decisions = Decisions(file, "/data", CLASSES)
    assert decisions.get("/data/cat/1.png") == (True, "cat")  # the later row, as fit reads it
    decisions.decide("/data/cat/1.png", None)
    # the hand rows as written, the review's own relative to the data root (it follows the images to another mount)
    assert file.read_text() == "path,label\n/data/cat/2.png,\ncat/1.png,\n"


def test_a_read_only_run_trained_with_corrections_still_opens(tmp_path: Path):
    """Its review could not write the corrections it starts from, and ended before the page opened."""
    (tmp_path / "run").write_text("")  # a file where the folder should be: no write can succeed there, even as root
    decisions = Decisions(tmp_path / "run" / "corrections.csv", "/data", CLASSES, {"/data/cat/1.png": "dog"})
    assert decisions.all() == {"/data/cat/1.png": "dog"}


def test_a_carriage_return_in_a_name_or_a_class_is_written_so_that_fit_reads_it_back(tmp_path: Path):
    """The file's "\\n" rows left a carriage return unquoted: the next review and fit read `a/x` and refused the
    file ("no label column after 'a/x'"), and a class `c\\rr` was read as `c`."""
    file, classes = tmp_path / "corrections.csv", ["cat", "c\rr"]
    odd = str(tmp_path / "cat" / "x\ry.png")
    Decisions(file, tmp_path, classes).decide(odd, "c\rr")
    assert load_corrections(file, tmp_path, classes) == {odd: "c\rr"}
    assert Decisions(file, tmp_path, classes).all() == {odd: "c\rr"}


def test_a_link_planted_at_the_temporary_name_is_removed_and_nothing_is_written_through_it(tmp_path: Path):
    """Whoever could write a shared run folder could plant `.corrections.csv.tmp` as a link to any file this user can
    write: the review's start-up check emptied the link's target, and each decision then overwrote it."""
    victim, run = tmp_path / "elsewhere.txt", tmp_path / "run"
    victim.write_text("precious\n")
    run.mkdir()
    file, planted = run / "corrections.csv", run / ".corrections.csv.tmp"
    planted.symlink_to(victim)
    decisions = Decisions(file, tmp_path, CLASSES)
    assert decisions.cannot_save is None and victim.read_text() == "precious\n"
    planted.symlink_to(victim)  # planted again while the page is open
    image = str(tmp_path / "cat" / "1.png")
    decisions.decide(image, "dog")
    assert victim.read_text() == "precious\n" and file.is_file() and not file.is_symlink()
    assert load_corrections(file, tmp_path, CLASSES) == {image: "dog"} and not planted.is_symlink()
