"""The OpenAPI document tells the truth: schemathesis fuzzes a live server with every check on.

Each answer must be documented (status, content type, body schema), requests that break the schema must
be refused, and nothing may answer 5xx. One check is off: `positive_data_acceptance` expects any body
the schema allows to succeed, and no schema can say which bytes are a decodable image (random bytes in
an image field rightly get 415).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.serve.process import ServerProcess

SCHEMATHESIS = Path(sys.executable).with_name("schemathesis")


@pytest.fixture(scope="module")
def server(tiny_onnx):
    with ServerProcess(tiny_onnx, "--no-ui", "--max-bytes", "262144", "--graceful-timeout-s", "3") as s:
        yield s


def test_errors_are_documented_with_the_body_they_really_have(server):
    doc = httpx.get(server.url + "/openapi.json").json()
    assert "HTTPValidationError" not in str(doc)
    error = doc["components"]["schemas"]["Error"]
    assert error["required"] == ["error"]
    classify = doc["paths"]["/v1/classify"]["post"]
    assert {"multipart/form-data", "image/*"} <= set(classify["requestBody"]["content"])
    assert {"200", "413", "415", "422"} <= set(classify["responses"])
    assert "404" in doc["paths"]["/v2/models/{name}"]["get"]["responses"]
    assert set(doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
    r = httpx.post(server.url + "/v1/classify?top_k=0", content=b"x")
    assert r.status_code in (415, 422) and set(r.json()) == {"error"}


@pytest.mark.slow
@pytest.mark.skipif(not SCHEMATHESIS.exists() and not shutil.which("schemathesis"), reason="pip install schemathesis")
def test_schemathesis_finds_no_5xx_and_no_schema_violation(server, tmp_path):
    cmd = [
        str(SCHEMATHESIS if SCHEMATHESIS.exists() else shutil.which("schemathesis")),
        "run",
        server.url + "/openapi.json",
        "--checks",
        "all",
        "--exclude-checks",
        "positive_data_acceptance",
        "--max-examples",
        "25",
        "--generation-deterministic",
        "--request-timeout",
        "20",
        "--no-color",
    ]
    run = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
