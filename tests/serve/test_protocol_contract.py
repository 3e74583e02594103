"""The server extends two private pieces of uvicorn: `HttpToolsProtocol` (serve.server.http.protocol) and
`Server._wait_tasks_to_complete` (serve.server.cli), and overrides the public `Server.handle_exit` (readiness
ends with the signal). pyproject.toml bounds uvicorn's version; these tests fail loudly when the code we extend
changes, so that an upgrade is a decision, not a surprise."""

from __future__ import annotations

import hashlib
import inspect

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from serve.server.http.protocol import LimitedHttpToolsProtocol

# uvicorn version -> sha256 of the source we extend, checked by reading serve/server/http/protocol.py and
# serve/server/cli.py against it. A new version: read its HttpToolsProtocol and Server, then add its row.
REVIEWED = {
    "0.55.0": {
        "HttpToolsProtocol": "ec7f438cf5cec43e89f2636c4521d2937acfcbd11db4cfdc627dad3b9962ff3f",
        "Server._wait_tasks_to_complete": "17209be1e991445d37d11e0eb1abada64140131ef8d10dd0d095f384b693b734",
    },
}


def digest(obj) -> str:
    return hashlib.sha256(inspect.getsource(obj).encode()).hexdigest()


def test_the_uvicorn_code_we_extend_is_the_code_we_reviewed():
    version = uvicorn.__version__
    assert version in REVIEWED, (
        f"uvicorn {version} has not been checked against LimitedHttpToolsProtocol and AnnouncingServer: "
        "read their overrides against its HttpToolsProtocol and Server, then add it to REVIEWED"
    )
    seen = {
        "HttpToolsProtocol": digest(HttpToolsProtocol),
        "Server._wait_tasks_to_complete": digest(uvicorn.Server._wait_tasks_to_complete),
    }
    changed = [name for name, sha in seen.items() if REVIEWED[version][name] != sha]
    assert not changed, f"uvicorn {version} changed {', '.join(changed)}: re-check the overrides before upgrading"


def test_the_server_s_signal_handler_takes_what_uvicorn_passes_it():
    from serve.server.cli import AnnouncingServer

    theirs, ours = inspect.signature(uvicorn.Server.handle_exit), inspect.signature(AnnouncingServer.handle_exit)
    assert list(theirs.parameters) == list(ours.parameters), f"uvicorn's handle_exit now takes {theirs}"


def test_every_override_exists_in_uvicorn_with_the_same_parameters():
    ours = {n: f for n, f in vars(LimitedHttpToolsProtocol).items() if callable(f) and not n.startswith("_")}
    assert {"data_received", "on_headers_complete", "on_message_complete", "connection_made"} <= set(ours)
    for name, method in ours.items():
        theirs = getattr(HttpToolsProtocol, name, None)
        assert theirs is not None, f"uvicorn's HttpToolsProtocol has no {name} any more"
        params = list(inspect.signature(theirs).parameters)
        assert params == list(inspect.signature(method).parameters), f"{name} now takes {params}"
