"""Operator routes beyond the contract (in process, tiny model): PANTHEON_ADMIN_TOKEN guards /admin/*
(client routes stay open), PANTHEON_MODELS_DIR confines /admin/models/load, load errors never quote
a file's bytes, and `pantheon serve` warns when it listens beyond loopback without a token."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from pantheon.cli import build_parser
from pantheon.config import ServeConfig
from pantheon.web.serve import config_from_args, exposure_warning
from tests.fixtures.tiny_models import write_tiny_llama
from tests.web.inprocess import InProcessApp

TOKEN = "s3cret-t0ken"
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "temperature": 0}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("admin")
    inside, outside = root / "models", root / "elsewhere"
    inside.mkdir()
    outside.mkdir()
    tiny = write_tiny_llama(inside / "tiny.gguf")
    far = write_tiny_llama(outside / "far.gguf")
    (inside / "link.gguf").symlink_to(far)
    (inside / "passwd").write_text("root:x:0:0:root:/root:/bin/bash\n")
    return {"dir": inside, "tiny": tiny, "far": far, "link": inside / "link.gguf", "passwd": inside / "passwd"}


@pytest.fixture(scope="module")
def app(models):
    server = InProcessApp([(str(models["tiny"]), "tiny")], admin_token=TOKEN, models_dir=str(models["dir"]))
    yield server
    server.close()


def request(app, method: str, path: str, body=None, headers=None):
    async def go():
        r = await app.client.open(path, method=method, json=body, headers=headers or {})
        return r.status_code, await r.get_json(), r.headers

    return app.run(go())


BEARER = {"Authorization": f"Bearer {TOKEN}"}


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN},
                                     {"Authorization": f"Basic {TOKEN}"}, {"Authorization": "Bearer"},
                                     {"Authorization": f"Bearer {TOKEN}x"}])
@pytest.mark.parametrize("method,path,body", [("GET", "/admin/models", None), ("GET", "/admin/dies", None),
                                              ("POST", "/admin/models/unload", {"name": "tiny"}),
                                              ("POST", "/admin/models/load", {"path": "x.gguf"}),
                                              ("POST", "/admin/session/export", {"session_id": "s"}),
                                              ("GET", "/admin/nope", None), ("GET", "/metrics", None),
                                              ("GET", "//metrics", None)])
def test_admin_routes_refuse_a_missing_or_wrong_token(app, headers, method, path, body):
    status, err, hdrs = request(app, method, path, body, headers)
    assert status == 401, err
    assert err["error"]["type"] == "unauthorized" and err["error"]["message"]
    assert "code" in err["error"] and hdrs.get("WWW-Authenticate") == "Bearer"
    assert app.engine("tiny")  # the unload was never run


@settings(max_examples=int(os.environ.get("PANTHEON_FUZZ_EXAMPLES", "60")), deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(header=st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=255), max_size=40))
def test_no_other_authorization_header_opens_admin(app, header):
    assume(header.strip().partition(" ")[2].strip() != TOKEN)
    status, err, _ = request(app, "GET", "/admin/models", headers={"Authorization": header})
    assert status == 401 and err["error"]["type"] == "unauthorized"


def test_admin_routes_answer_the_right_token(app):
    status, body, _ = request(app, "GET", "/admin/models", headers=BEARER)
    assert status == 200 and [row["id"] for row in body["data"]] == ["tiny"]
    assert request(app, "GET", "/admin/dies", headers={"Authorization": f"bearer  {TOKEN}"})[0] == 200


def test_client_routes_stay_open(app):
    assert request(app, "GET", "/")[0] == 200
    assert request(app, "GET", "/v1/models")[0] == 200
    assert request(app, "GET", "/session/estimate?tokens=100")[0] == 200
    status, body, _ = request(app, "POST", "/v1/chat/completions", CHAT)
    assert status == 200, body
    assert request(app, "POST", "/session/release", {"session_id": "nobody"})[0] != 401


def test_a_preflight_is_answered_without_a_token(app):
    status, _, hdrs = request(app, "OPTIONS", "/admin/models")
    assert status == 200 and hdrs.get("Access-Control-Allow-Origin") == "*"


def test_a_model_inside_the_models_dir_loads(app, models):
    status, row, _ = request(app, "POST", "/admin/models/load", {"path": str(models["tiny"]), "name": "again"},
                             BEARER)
    assert status == 200, row
    assert row["id"] == "again"
    status, _, _ = request(app, "POST", "/admin/models/unload", {"name": "again"}, BEARER)
    assert status == 200
    # a path relative to the models dir
    status, row, _ = request(app, "POST", "/admin/models/load", {"path": "tiny.gguf", "name": "rel"}, BEARER)
    assert status == 200, row
    assert request(app, "POST", "/admin/models/unload", {"name": "rel"}, BEARER)[0] == 200


@pytest.mark.parametrize("which", ["far", "link", "dotdot", "etc"])
def test_a_path_outside_the_models_dir_is_refused_403(app, models, which):
    path = {"far": str(models["far"]), "link": str(models["link"]), "etc": "/etc/passwd",
            "dotdot": str(models["dir"] / ".." / "elsewhere" / "far.gguf")}[which]
    status, err, _ = request(app, "POST", "/admin/models/load", {"path": path, "name": "x"}, BEARER)
    assert status == 403 and err["error"]["type"] == "load_failed", err
    assert "root:" not in err["error"]["message"]
    assert [m["id"] for m in request(app, "GET", "/admin/models", headers=BEARER)[1]["data"]] == ["tiny"]


def test_a_non_gguf_file_is_refused_without_quoting_its_bytes(app, models):
    status, err, _ = request(app, "POST", "/admin/models/load", {"path": str(models["passwd"])}, BEARER)
    assert status >= 400 and err["error"]["type"] == "load_failed", err
    message = err["error"]["message"]
    assert "not a GGUF file" in message
    assert "root" not in message.replace(str(models["dir"]), "") and "b'" not in message


def test_without_a_token_or_models_dir_admin_is_open_as_the_contract_says(models, tmp_path):
    server = InProcessApp([])
    try:
        assert request(server, "GET", "/admin/models")[0] == 200
        status, err, _ = request(server, "POST", "/admin/models/load", {"path": str(models["passwd"])})
        assert err["error"]["type"] == "load_failed" and "root" not in err["error"]["message"].replace(
            str(models["dir"]), "")
        assert request(server, "POST", "/admin/models/load", {"path": str(tmp_path / "none.gguf")})[0] == 404
    finally:
        server.close()


def serve_config(argv, monkeypatch, env=None):
    for key in ("PANTHEON_ADMIN_TOKEN", "PANTHEON_MODELS_DIR"):
        monkeypatch.delenv(key, raising=False)
    for key, value in (env or {}).items():
        monkeypatch.setenv(key, value)
    return config_from_args(build_parser().parse_args(["serve", *argv]))


def test_serve_flags_and_environment_reach_the_config(monkeypatch):
    config = serve_config(["--admin-token", "t", "--models-dir", "/m"], monkeypatch)
    assert (config.admin_token, config.models_dir, config.host) == ("t", "/m", "127.0.0.1")
    config = serve_config([], monkeypatch, {"PANTHEON_ADMIN_TOKEN": "e", "PANTHEON_MODELS_DIR": "/d"})
    assert (config.admin_token, config.models_dir) == ("e", "/d")
    assert ServeConfig().admin_token is None and ServeConfig().models_dir is None


@pytest.mark.parametrize("argv,env,warns", [
    ([], {}, False),
    (["--host", "localhost"], {}, False),
    (["--host", "::1"], {}, False),
    (["--host", "0.0.0.0"], {}, True),
    (["--host", "::"], {}, True),
    (["--host", "10.1.2.3"], {}, True),
    (["--host", "0.0.0.0", "--admin-token", "t"], {}, False),
    (["--host", "0.0.0.0"], {"PANTHEON_ADMIN_TOKEN": "t"}, False),
])
def test_serve_warns_when_listening_beyond_loopback_without_a_token(monkeypatch, argv, env, warns):
    warning = exposure_warning(serve_config(argv, monkeypatch, env))
    assert (warning is not None) == warns
    if warns:
        assert "admin token" in warning and "\n" not in warning


def test_metrics_answer_the_admin_token_and_stay_open_without_one(app, models):
    async def go(client, headers):
        r = await client.get("/metrics", headers=headers)
        return r.status_code, (await r.get_data()).decode()

    status, text = app.run(go(app.client, BEARER))
    assert status == 200 and "pantheon_requests" in text
    open_app = InProcessApp([(str(models["tiny"]), "tiny")])
    try:
        assert open_app.run(go(open_app.client, {}))[0] == 200
    finally:
        open_app.close()
