"""Calibrated probabilities, prediction sets and unknown inputs: the maths, and a real exported file."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest

from serve.runtime import calibration as cal
from serve.runtime.classifier import OnnxClassifier
from tests.helpers import CALIB_IMAGES, CLASS_NAMES, quadrant_images


def _synthetic(n: int, temperature: float, seed: int = 0, K: int = 10):
    """Logits and labels drawn from softmax(logits / temperature): the right temperature is known."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(0, 3, (n, K))
    probs = cal.softmax(logits, temperature).astype(np.float64)
    labels = np.array([rng.choice(K, p=p / p.sum()) for p in probs])
    return logits, labels


def test_the_fitted_temperature_is_the_one_the_labels_were_drawn_with_and_lowers_ece():
    logits, labels = _synthetic(4000, temperature=2.0)
    T = cal.fit_temperature(logits, labels)
    assert T == pytest.approx(2.0, rel=0.1)
    before, after = cal.softmax(logits), cal.softmax(logits, T)
    assert cal.ece(after, labels) < 0.03 < cal.ece(before, labels)
    assert cal.nll(after, labels) < cal.nll(before, labels)


@pytest.mark.parametrize("method", cal.CONFORMAL_METHODS)
@pytest.mark.parametrize("coverage", [0.8, 0.9, 0.95])
def test_split_conformal_sets_cover_new_exchangeable_images_as_promised(method, coverage):
    logits, labels = _synthetic(6000, temperature=1.5, seed=1)
    probs = cal.softmax(logits, 1.5)
    calib, test = slice(0, 2000), slice(2000, None)
    scores = cal.conformal_scores(probs[calib], method)[np.arange(2000), labels[calib]]
    q = cal.conformal_threshold(np.sort(scores), coverage)
    inside = cal.conformal_scores(probs[test], method) <= q  # (n, K)
    covered = inside[np.arange(4000), labels[test]].mean()
    assert coverage - 0.02 <= covered <= coverage + 0.02
    assert 1.0 < inside.sum(1).mean() < 10  # informative: neither singletons always nor every class


def test_the_export_report_shows_an_under_covered_tail_class_and_class_conditional_sets_cover_it():
    pytest.importorskip("torch")  # the exporter's stack: not in the [serve]-only install
    from serve.export.calibrate import fit, format_report

    rng = np.random.default_rng(3)
    counts, K = [3000, 1500, 300], 3  # a long tail; the model is sure of the head and unsure of the tail
    labels = np.repeat(np.arange(K), counts)
    sure = np.array([4.0, 3.0, 0.8])[labels]  # how far each image's true logit stands out, by class
    logits = rng.normal(0, 1, (len(labels), K))
    logits[np.arange(len(labels)), labels] += sure + rng.normal(0, 1, len(labels))
    entry = fit(logits.astype(np.float32), labels, None, ood_kind="energy")
    per = entry["metrics"]["per_class_coverage"]
    assert per["images"] == counts and per["coverage"] == 0.9
    assert per["marginal"][2] < 0.8 < 0.88 < per["marginal"][0]  # one threshold: the head pays for the tail
    assert all(0.85 <= v <= 0.95 for v in per["class_conditional"])  # a threshold each: every class at 0.9
    report = format_report(entry, ["big", "middle", "tail"])
    assert "worst class" in report and "45.7% (tail, 300 images;" in report and "--class-conditional" in report
    entry = fit(logits.astype(np.float32), labels, None, ood_kind="energy", class_conditional=True)
    assert "--class-conditional gives" not in format_report(entry, ["big", "middle", "tail"])
    few = fit(logits[::200].astype(np.float32), labels[::200], None, ood_kind="energy")  # 24 images: 12 a half
    assert few["metrics"]["per_class_coverage"]["class_conditional"] == [None, None, None]


def test_one_calibration_image_per_class_gives_the_energy_score_not_a_mahalanobis_of_no_spread(caplog):
    """1,500 classes of one calibration image each: every image its class's mean, a covariance of 0, a precision of
    1e24 and a threshold of 1e23; the training images themselves scored 2e22."""
    pytest.importorskip("torch")  # the exporter's stack: not in the [serve]-only install
    from serve.export.calibrate import fit

    rng = np.random.default_rng(0)
    K = 40
    labels = np.arange(K)  # one image per class
    logits = rng.normal(0, 1, (K, K)).astype(np.float32) + 3 * np.eye(K, dtype=np.float32)
    features = rng.normal(0, 1, (K, 16)).astype(np.float32)
    with caplog.at_level("WARNING", logger="serve.export.calibrate"):
        entry = fit(logits, labels, features)
    assert entry["ood"]["score"] == "energy" and np.isfinite(entry["ood"]["threshold"])
    assert "needs 2 or more calibration images per class on average" in caplog.text
    two = fit(np.concatenate([logits, logits]), np.concatenate([labels, labels]), np.concatenate([features, -features]))
    assert two["ood"]["score"] == "mahalanobis"  # two a class: a spread to measure


@pytest.mark.parametrize("coverage", [0.0, 1.0, -0.5, 1.5, float("nan"), "0.9"])
def test_a_coverage_outside_the_open_unit_interval_is_refused_with_an_example(coverage):
    with pytest.raises(ValueError, match=r"between 0 and 1 \(exclusive\), e\.g\. 0\.9"):
        cal.quantile_index(100, coverage)


@pytest.mark.parametrize("coverage", [np.float32(0.9), np.float16(0.9), 0.9])
def test_a_coverage_of_any_real_number_type_is_taken(coverage):
    """`np.float32(0.9)` was refused as "a number between 0 and 1 ...; got np.float32(0.9)", while `top_k` took
    numpy's integers: a coverage read from an array or a config parsed by numpy."""
    assert cal.quantile_index(100, coverage) == 91


@pytest.mark.parametrize("coverage", [True, np.bool_(True), 1j])
def test_a_coverage_that_is_no_real_number_is_refused(coverage):
    with pytest.raises(ValueError, match=r"between 0 and 1 \(exclusive\)"):
        cal.quantile_index(100, coverage)


def test_a_coverage_finer_than_the_calibration_images_allow_is_refused():
    assert cal.quantile_index(99, 0.99) == 99  # ceil(100 * 0.99): the largest score
    with pytest.raises(ValueError, match=r"finer than the 99 calibration images.*0\.9900"):
        cal.quantile_index(99, 0.995)


def test_psi_is_zero_for_the_stored_distribution_and_large_for_a_shifted_one():
    expected = np.full(10, 0.1)
    assert cal.psi(expected, np.full(10, 50)) == pytest.approx(0.0, abs=1e-9)
    assert cal.psi(expected, np.array([0] * 9 + [500])) > 1.0


def test_the_confidence_map_gives_each_image_the_mapped_top_probability_and_keeps_its_class_order():
    logits, labels = _synthetic(3000, temperature=1.0)
    squashed = np.tanh(logits / 6) * 6  # confident images squashed together, as label smoothing does
    T = cal.fit_temperature(squashed, labels)
    scaled = cal.softmax(squashed, T)
    knots = cal.fit_confidence_map(scaled.max(1), scaled.argmax(1) == labels, 10)
    assert (np.diff(knots[0]) > 0).all() and (np.diff(knots[1]) > 0).all()  # strictly increasing: no ties
    probs = cal.calibrated_softmax(squashed, T, knots)
    np.testing.assert_allclose(probs.max(1), np.interp(scaled.max(1), *knots), atol=1e-5)
    np.testing.assert_allclose(probs.sum(1), 1.0, atol=1e-5)
    assert (np.argsort(probs, 1) == np.argsort(squashed, 1)).all()  # the same class order in every image
    assert cal.ece(probs, labels) < cal.ece(scaled, labels)
    # beyond the last knot (a confident image), a tie and a flat row: finite, and the map's end value
    extreme = np.array([[15.0] + [0.0] * 9, [40.0] + [0.0] * 9, [3.0, 3.0] + [0.0] * 8, [0.0] * 10])
    out = cal.calibrated_softmax(extreme, T, knots)
    assert np.isfinite(out).all() and out[0].max() == pytest.approx(knots[1, -1], abs=1e-5)
    np.testing.assert_allclose(out[3], 0.1, atol=1e-6)


def test_tritons_probs_output_computes_the_calibrated_probabilities_in_the_graph():
    onnx = pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    from serve.export.triton import add_probabilities

    logits, labels = _synthetic(2000, temperature=1.0, seed=3)
    T = 0.8
    scaled = cal.softmax(logits, T)
    knots = cal.fit_confidence_map(scaled.max(1), scaled.argmax(1) == labels, 10)
    vi = onnx.helper.make_tensor_value_info("logits", onnx.TensorProto.FLOAT, [None, 10])
    for opset in (17, 21):
        for k in (None, knots):
            graph = onnx.helper.make_graph([], "g", [vi], [vi])
            model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", opset)])
            model.ir_version = 8
            add_probabilities(model, T, k)
            session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
            x = np.concatenate([logits[:60], [[15.0] + [0.0] * 9, [40.0] + [0.0] * 9, [0.0] * 10]]).astype(np.float32)
            (probs,) = session.run(["probs"], {"logits": x})
            np.testing.assert_allclose(probs, cal.calibrated_softmax(x, T, k), atol=2e-5)


def test_the_shrunk_gaussian_scores_new_images_like_the_fitted_ones_even_with_few_images_for_the_width():
    rng = np.random.default_rng(0)
    D, K, n = 64, 4, 48  # fewer images than feature dimensions: the plain covariance is singular
    centres = rng.normal(0, 3, (K, D))
    draw = lambda m: (lambda y: (centres[y] + rng.normal(0, 1, (m, D)), y))(rng.integers(0, K, m))
    (fitted, y), (new, _) = draw(n), draw(400)
    means, precision = cal.fit_gaussian(fitted, y, K)
    assert np.isfinite(precision).all() and np.linalg.cond(precision) < 1e3
    inside, outside = (
        cal.mahalanobis(new, means, precision),
        cal.mahalanobis(rng.normal(0, 3, (400, D)), means, precision),
    )
    assert np.quantile(inside, 0.95) < 3 * np.quantile(cal.mahalanobis(fitted, means, precision), 0.95)
    assert (outside > np.quantile(inside, 0.95)).mean() > 0.99  # far images: past the 95 % threshold


def test_the_files_unknown_score_is_the_mahalanobis_distance_of_its_features_output(tiny_onnx):
    clf = OnnxClassifier(tiny_onnx)
    assert clf.trust.ood_kind == "mahalanobis" and clf.needs_features
    pixels = np.random.default_rng(1).integers(0, 256, (5, 32, 32, 3), dtype=np.uint8)
    logits, features = clf.session.run(["logits", "features"], {"pixels": pixels})
    g = clf.trust.gaussian
    np.testing.assert_allclose(clf.assess(pixels).ood_scores, cal.mahalanobis(features, g["means"], g["precision"]))
    assert g["means"].shape == (len(CLASS_NAMES), features.shape[1])


def test_the_exported_file_carries_calibration_fitted_on_the_runs_calibration_split(tiny_run, tmp_path):
    from serve.export.cli import export_onnx

    run = tmp_path / "run"  # a copy: the export writes the run's reports, and other workers export the shared run
    shutil.copytree(tiny_run / "checkpoints", run / "checkpoints")
    shutil.copy(tiny_run / "split.json", run)
    export_onnx(run / "checkpoints" / "best.ckpt", tmp_path / "t.onnx", gradients=False)
    clf = OnnxClassifier(tmp_path / "t.onnx")
    assert clf.calibrated and clf.trust.images == CALIB_IMAGES
    summary = clf.trust_summary()
    assert summary["max_coverage"] == pytest.approx(CALIB_IMAGES / (CALIB_IMAGES + 1), abs=1e-6)
    m = summary["metrics"]
    assert m["ece_after"] <= m["ece_before"] + 1e-6 and m["nll_after"] <= m["nll_before"] + 1e-6
    assert (run / "reports" / "reliability.png").stat().st_size > 1000
    report = json.loads((run / "reports" / "calibration.json").read_text())
    assert report["temperature"] == pytest.approx(clf.trust.temperature)


def test_predict_gives_each_image_its_top_k_prediction_set_and_unknown_verdict(tiny_onnx):
    clf = OnnxClassifier(tiny_onnx)
    images, labels = quadrant_images(40, seed=7)
    preds = clf.predict(list(images), top_k=2, coverage=0.95)
    assert all(len(p) == 2 and p[0][1] >= p[1][1] for p in preds)
    covered = [CLASS_NAMES[y] in p.prediction_set for p, y in zip(preds, labels, strict=True)]
    assert np.mean(covered) >= 0.9
    assert all(p.prediction_set[0] == p[0][0] for p in preds if p.prediction_set)  # most probable first
    assert np.mean([p.unknown for p in preds]) <= 0.2 and all(math.isfinite(p.ood_score) for p in preds)
    plain = clf.predict(list(images[:3]), top_k=1)
    assert all(p.prediction_set is None and p.unknown is not None for p in plain)  # no coverage: no set


def test_wider_coverage_never_gives_a_smaller_set(tiny_onnx):
    clf = OnnxClassifier(tiny_onnx)
    pixels = np.stack([clf.prepare(img) for img in quadrant_images(12, seed=3)[0]])
    small, large = (clf.assess(pixels, c).sets for c in (0.5, 0.99))
    assert all(set(a) <= set(b) for a, b in zip(small, large, strict=True))


def test_noise_images_score_as_unknown_more_often_than_training_like_images(tiny_onnx):
    clf = OnnxClassifier(tiny_onnx)
    rng = np.random.default_rng(0)
    noise = rng.integers(0, 256, (40, 32, 32, 3), dtype=np.uint8)
    known = np.stack([clf.prepare(img) for img in quadrant_images(40, seed=5)[0]])
    a, b = clf.assess(noise), clf.assess(known)
    assert a.ood_scores.mean() > b.ood_scores.mean()
    assert a.unknown.mean() > b.unknown.mean()


def test_a_bad_coverage_is_refused_before_any_image_is_read(tiny_onnx):
    clf = OnnxClassifier(tiny_onnx)
    with pytest.raises(ValueError, match="between 0 and 1"):
        clf.predict(["no-such-file.png"], coverage=1.0)
    with pytest.raises(ValueError, match="finer than the 120 calibration images"):
        clf.predict(["no-such-file.png"], coverage=0.999)


def strip_calibration(path: Path, out: Path) -> Path:
    """The file as exported before calibration existed: no `calibration` metadata entry."""
    onnx = pytest.importorskip("onnx")  # the [serve]-only venv has no onnx to rewrite the file with
    model = onnx.load(str(path))
    keep = [p for p in model.metadata_props if p.key != "calibration"]
    del model.metadata_props[:]
    model.metadata_props.extend(keep)
    onnx.save(model, str(out))
    return out


def test_a_file_without_calibration_still_loads_and_says_it_is_uncalibrated(tiny_onnx, tmp_path):
    old = OnnxClassifier(strip_calibration(tiny_onnx, tmp_path / "old.onnx"))
    assert not old.calibrated and "no calibration" in old.trust_summary()["note"]
    pixels = np.stack([old.prepare(img) for img in quadrant_images(4)[0]])
    np.testing.assert_allclose(old.predict_pixels(pixels), cal.softmax(old.logits(pixels)), atol=1e-6)
    (p,) = old.predict(list(pixels[:1]))
    assert p.prediction_set is None and p.unknown is None and p.ood_score is None
    with pytest.raises(ValueError, match="carries no calibration.*export it again"):
        old.predict(list(pixels[:1]), coverage=0.9)
