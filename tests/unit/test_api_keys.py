"""API keys come from RAYPD_API_KEYS or http.api_keys_file, are never shown, and a missing key fails closed."""

import logging

import pytest

from serving.front.api_keys import ApiKeyError, is_loopback, load_api_keys
from serving.config import DeploymentConfig


def http(**kw):
    return DeploymentConfig.from_dict({"http": kw}).http


def test_keys_from_the_environment_and_a_file_with_comments(tmp_path):
    f = tmp_path / "keys"
    f.write_text("# team A\nsk-file-1\n\n  sk-file-2   # rotated in May\nsk-env-1\n")
    keys = load_api_keys(http(api_keys_file=str(f)), environ={"RAYPD_API_KEYS": " sk-env-1, sk-env-2 ,"})
    assert keys.keys == (b"sk-env-1", b"sk-env-2", b"sk-file-1", b"sk-file-2")
    assert keys.sources == ("RAYPD_API_KEYS", str(f))


def test_keys_never_show_in_repr_or_in_the_config(tmp_path):
    f = tmp_path / "keys"
    f.write_text("sk-secret-123\n")
    cfg = DeploymentConfig.from_dict({"http": {"api_keys_file": str(f)}})
    keys = load_api_keys(cfg.http, environ={"RAYPD_API_KEYS": "sk-secret-456"})
    assert "sk-secret" not in repr(keys) and "sk-secret" not in str(keys)
    assert "sk-secret" not in cfg.model_dump_json()  # what travels as Serve arguments


def test_unreadable_or_empty_key_file_is_an_error(tmp_path):
    with pytest.raises(ApiKeyError, match="cannot be read"):
        load_api_keys(http(api_keys_file=str(tmp_path / "missing")), environ={})
    empty = tmp_path / "empty"
    empty.write_text("# nothing yet\n\n")
    with pytest.raises(ApiKeyError, match="holds no key"):
        load_api_keys(http(api_keys_file=str(empty)), environ={})


def test_required_keys_fail_closed_when_none_is_found():
    with pytest.raises(ApiKeyError, match="require_api_keys.*RAYPD_API_KEYS"):
        load_api_keys(http(require_api_keys=True), environ={})


def test_non_loopback_bind_without_keys_warns(caplog):
    with caplog.at_level(logging.WARNING, logger="raypd.api_keys"):
        assert not load_api_keys(http(host="0.0.0.0"), environ={})
    assert "binding 0.0.0.0 with no API key" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="raypd.api_keys"):
        load_api_keys(http(host="127.0.0.1"), environ={})
        load_api_keys(http(host="0.0.0.0"), environ={"RAYPD_API_KEYS": "k"})
    assert caplog.text == ""


@pytest.mark.parametrize("host, loopback", [("127.0.0.1", True), ("localhost", True), ("::1", True),
                                            ("0.0.0.0", False), ("10.1.2.3", False), ("myhost", False)])
def test_loopback(host, loopback):
    assert is_loopback(host) is loopback
