"""The OpenAPI documents tell the truth: schemathesis fuzzes a live server with every check on, through
our own document and through Gradio's (`/gradio_api/openapi.json`, the UI's routes).

Each answer must be documented (status, content type, body schema), requests that break the schema must
be refused, and nothing may answer 5xx. On our document one check is off: `positive_data_acceptance`
expects any body the schema allows to succeed, and no schema can say which bytes are a decodable image
(random bytes in an image field rightly get 415). On Gradio's, the checks it is wrong about are off for
the routes where it is, each with its reason, in `schemathesis_gradio.toml`.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.helpers import ServerProcess

SCHEMATHESIS = Path(sys.executable).with_name("schemathesis")
GRADIO_CHECKS = Path(__file__).with_name("schemathesis_gradio.toml")
no_schemathesis = pytest.mark.skipif(
    not SCHEMATHESIS.exists() and not shutil.which("schemathesis"), reason="pip install schemathesis"
)


@pytest.fixture(scope="module")
def server(tiny_onnx):
    with ServerProcess(tiny_onnx, "--no-ui", "--max-bytes", "262144", "--graceful-timeout-s", "3") as s:
        yield s


def test_errors_are_documented_with_the_body_they_really_have(server):
    doc = httpx.get(server.url + "/openapi.json", timeout=30).json()
    assert "HTTPValidationError" not in str(doc)
    error = doc["components"]["schemas"]["Error"]
    assert error["required"] == ["error"]
    classify = doc["paths"]["/v1/classify"]["post"]
    assert {"multipart/form-data", "image/*"} <= set(classify["requestBody"]["content"])
    assert {"200", "413", "415", "422"} <= set(classify["responses"])
    assert "404" in doc["paths"]["/v2/models/{name}"]["get"]["responses"]
    assert set(doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
    r = httpx.post(server.url + "/v1/classify?top_k=0", content=b"x", timeout=30)
    assert r.status_code in (415, 422) and set(r.json()) == {"error"}
    r = httpx.get(server.url + "/v2/models/nope", timeout=30)  # /v2 answers in the KServe v2 protocol's shape
    assert r.status_code == 404 and isinstance(r.json()["error"], str)
    assert set(r.json()) <= set(doc["components"]["schemas"]["KServeError"]["properties"])
    load = doc["paths"]["/v2/repository/models/{name}/load"]["post"]["responses"]["400"]["description"]
    assert "Host" in load and "failed to load" in load  # a model that fails its checks is a 400 too


def test_each_classify_route_is_documented_with_its_parameters_and_answer(server):
    """The classify routes are plain routes, which FastAPI leaves out: `classify_openapi` writes them."""
    doc = httpx.get(server.url + "/openapi.json", timeout=30).json()
    paths = {
        "/v1/classify": [],
        "/v1/models/{name}/classify": ["name"],
        "/v1/models/{name}/versions/{version}/classify": ["name", "version"],
    }
    for path, in_path in paths.items():
        op = doc["paths"][path]["post"]
        where = {p["name"]: p["in"] for p in op["parameters"]}
        assert {name: "path" for name in in_path}.items() <= where.items()
        assert {"top_k", "explain", "head_fusion", "discard_ratio", "coverage"} <= set(where)
        assert op["responses"]["200"]["content"]["application/json"]["schema"] == {
            "$ref": "#/components/schemas/Predictions"
        }
        assert ("404" in op["responses"]) == bool(in_path)
    assert len({doc["paths"][p]["post"]["operationId"] for p in paths}) == 3
    assert {"Prediction", "Predictions"} <= set(doc["components"]["schemas"])


def schemathesis(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """`schemathesis ARGS` with bounded, reproducible examples; its report is in the result's stdout."""
    exe = str(SCHEMATHESIS if SCHEMATHESIS.exists() else shutil.which("schemathesis"))
    bounds = ["--max-examples", "25", "--generation-deterministic", "--request-timeout", "20", "--no-color"]
    return subprocess.run([exe, *args, *bounds], cwd=cwd, capture_output=True, text=True, timeout=180)


@pytest.mark.slow
@no_schemathesis
def test_schemathesis_finds_no_5xx_and_no_schema_violation(server, tmp_path):
    checks = ["--checks", "all", "--exclude-checks", "positive_data_acceptance"]
    # unloading the only model makes every later request an honest 503: the repository routes have their own tests
    keep = ["--exclude-path-regex", "^/v2/repository/models/"]
    run = schemathesis("run", server.url + "/openapi.json", *checks, *keep, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]


@pytest.fixture(scope="module")
def ui_server(tiny_onnx):
    with ServerProcess(tiny_onnx, "--examples-dir", "", "--max-bytes", "262144", "--graceful-timeout-s", "3") as s:
        yield s


@pytest.mark.slow
@no_schemathesis
def test_schemathesis_finds_no_5xx_on_gradios_routes_and_no_violation_of_its_document(ui_server, tmp_path):
    run = schemathesis(
        "--config-file", str(GRADIO_CHECKS), "run", ui_server.url + "/gradio_api/openapi.json", cwd=tmp_path
    )
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    fuzzed = set(httpx.get(ui_server.url + "/gradio_api/openapi.json", timeout=30).json()["paths"])
    for name in ("classify", "attention", "gradient_rollout"):  # each endpoint: its call and its result stream
        assert {f"/gradio_api/call/v2/{name}", f"/gradio_api/call/{name}/{{event_id}}"} <= fuzzed
    assert "/gradio_api/upload" in fuzzed
