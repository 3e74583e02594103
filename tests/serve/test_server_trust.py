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
    return httpx.post(
        url + "/v1/classify" + query, files={"file": ("a.png", png_bytes(image), "image/png")}, timeout=30
    )


@pytest.mark.slow
def test_classify_with_coverage_answers_with_a_prediction_set_unknown_and_ood_score(server):
    images, labels = quadrant_images(8, seed=11)
    unknown = 0
    for img, y in zip(images, labels, strict=True):
        body = classify(server.url, img, "?coverage=0.95&top_k=2").json()
        assert set(body) >= {"predictions", "prediction_set", "unknown", "ood_score"}
        assert CLASS_NAMES[y] in body["prediction_set"] or len(body["prediction_set"]) == 0
        assert isinstance(body["unknown"], bool) and isinstance(body["ood_score"], float)
        unknown += body["unknown"]
    assert unknown <= 2  # the threshold accepts 95 % of images like the training ones
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


def _v2(server, pixels: np.ndarray, outputs: list[str], parameters: dict | None = None) -> httpx.Response:
    name = httpx.get(server.url + "/readyz", timeout=30).json()["model"]
    req = {
        "inputs": [
            {"name": "pixels", "datatype": "UINT8", "shape": list(pixels.shape), "data": pixels.ravel().tolist()}
        ],
        "outputs": [{"name": n} for n in outputs],
        **({"parameters": parameters} if parameters else {}),
    }
    return httpx.post(f"{server.url}/v2/models/{name}/infer", json=req, timeout=30)


@pytest.mark.slow
def test_v2_takes_coverage_as_a_request_parameter_and_returns_the_sets_as_a_tensor(server):
    images, labels = quadrant_images(6, seed=13)
    r = _v2(server, images, ["probs", "in_set", "unknown", "ood_score"], {"coverage": 0.9})
    assert r.status_code == 200, r.text
    out = {o["name"]: np.asarray(o["data"]).reshape(o["shape"]) for o in r.json()["outputs"]}
    assert out["in_set"].shape == (6, len(CLASS_NAMES)) and set(np.unique(out["in_set"])) <= {0.0, 1.0}
    assert out["in_set"][np.arange(6), labels].mean() >= 0.8 and out["unknown"].shape == (6,)
    top = out["probs"].argmax(1)
    assert all(out["in_set"][i, top[i]] == 1 for i in range(6) if out["in_set"][i].any())
    assert _v2(server, images, ["in_set"], {"coverage": 1.5}).status_code == 422
    assert "coverage" in _v2(server, images, ["in_set"]).text  # a set needs a coverage


@pytest.mark.slow
def test_v2_answers_feed_the_trust_metrics_as_v1_answers_do(server):
    before = server.metric("vitscope_confidence_count", default=0.0)
    images, _ = quadrant_images(3, seed=17)
    assert _v2(server, images, ["logits"]).status_code == 200  # no trust output asked for: counted all the same
    assert server.metric("vitscope_confidence_count") == before + 3
