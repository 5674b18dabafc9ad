"""Configuration from the environment: PANTHEON_MODEL, caps, PANTHEON_NO_THINK."""

import pytest

from pantheon.config import ServeConfig, no_think_default


def test_serve_config_from_env(monkeypatch):
    monkeypatch.setenv("PANTHEON_MODEL", "/m/a.gguf,alpha;/m/b.gguf")
    monkeypatch.setenv("PANTHEON_CTX_CAP", "2048")
    monkeypatch.setenv("PANTHEON_MAX_SESSIONS", "3")
    c = ServeConfig.from_env()
    assert c.models == (("/m/a.gguf", "alpha"), ("/m/b.gguf", None))
    m = c.model_config("/m/b.gguf", None)
    assert (m.name, m.ctx_cap, m.max_sessions, m.max_concurrent_configured) == ("b", 2048, 3, 3)


def test_bad_integer_env_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("PANTHEON_CTX_CAP", "lots")
    with pytest.raises(ValueError, match="PANTHEON_CTX_CAP"):
        ServeConfig.from_env()


@pytest.mark.parametrize("value,expected", [("1", True), ("true", True), ("0", False), ("", False)])
def test_no_think_env(monkeypatch, value, expected):
    monkeypatch.setenv("PANTHEON_NO_THINK", value)
    assert no_think_default() is expected
