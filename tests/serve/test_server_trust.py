"""A real server's answers carry calibrated scores, prediction sets and unknown verdicts, and /metrics notices drift."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from serve.server.drift import DRIFT_ALERT, DRIFT_WINDOW
from tests.helpers import CLASS_NAMES, ServerProcess, png_bytes, quadrant_images


@pytest.fixture(scope="module")
def server(tiny_onnx):
    with ServerProcess(tiny_onnx, "--max-delay-ms", "2", "--no-ui") as s:
        yield s


def classify(url: str, image: np.ndarray, query: str = "") -> httpx.Response:
    return httpx.post(url + "/v1/classify" + query, files={"file": ("a.png", png_bytes(image), "image/png")})


@pytest.mark.slow
def test_classify_with_coverage_answers_with_a_prediction_set_unknown_and_ood_score(server):
    images, labels = quadrant_images(8, seed=11)
    for img, y in zip(images, labels, strict=True):
        body = classify(server.url, img, "?coverage=0.95&top_k=2").json()
        assert set(body) >= {"predictions", "prediction_set", "unknown", "ood_score"}
        assert CLASS_NAMES[y] in body["prediction_set"] or len(body["prediction_set"]) == 0
        assert body["unknown"] is False and isinstance(body["ood_score"], float)
    plain = classify(server.url, images[0]).json()
    assert plain["prediction_set"] is None and isinstance(plain["unknown"], bool)  # no coverage: no set


@pytest.mark.slow
@pytest.mark.parametrize(("coverage", "says"), [("1.0", "between 0 and 1"), ("0.9999", "finer than"), ("x", "number")])
def test_a_bad_coverage_is_a_422_that_says_why(server, coverage, says):
    r = classify(server.url, quadrant_images(1)[0][0], f"?coverage={coverage}")
    assert r.status_code == 422 and says in r.text


@pytest.mark.slow
def test_the_drift_gauge_stays_under_its_alert_for_test_images_and_passes_it_for_unknown_ones(server):
    psi = lambda: server.metric("vitscope_drift_psi", signal="ood_score")
    for img in quadrant_images(100, seed=21)[0]:  # images like the training ones
        assert classify(server.url, img).status_code == 200
    assert psi() < DRIFT_ALERT
    unknown_before = server.metric("vitscope_unknown_total", default=0.0)
    rng = np.random.default_rng(0)
    sent = 0
    while sent < DRIFT_WINDOW and psi() <= DRIFT_ALERT:  # the alert must fire before the window is all noise
        classify(server.url, rng.integers(0, 256, (32, 32, 3), dtype=np.uint8))
        sent += 1
    assert psi() > DRIFT_ALERT, f"no drift alert after {sent} noise images"
    assert server.metric("vitscope_unknown_total") > unknown_before
    assert server.metric("vitscope_confidence_count") >= 100 + sent
    assert sum(server.metric("vitscope_predicted_total", label=c) for c in CLASS_NAMES) >= 100 + sent
