"""``/admin/*``'s credential without an API key (cluster/admin_token.py): made at start from the cluster secret, kept
in a file only its user can read, found by the CLI from the URL, and gone when the cluster stops."""

from __future__ import annotations

import stat

import httpx
import pytest

from cli.scale_cmd import post_scale
from cluster import admin_token
from tests.helpers.cluster import tiny_cluster_config, wait_all_kv_free


@pytest.fixture(autouse=True)
def runtime(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    return tmp_path / "pdserve"


def test_the_token_file_is_the_users_alone_and_found_by_the_url(runtime):
    path = admin_token.write_token("http://127.0.0.1:8123", "t0k")
    assert path.parent == runtime and stat.S_IMODE(runtime.stat().st_mode) == 0o700
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert (
        admin_token.read_token("http://127.0.0.1:8123/") == "t0k" and admin_token.read_token("127.0.0.1:8124") is None
    )
    assert admin_token.admin_headers("http://127.0.0.1:8123", None) == {"Authorization": "Bearer t0k"}
    assert admin_token.admin_headers("http://127.0.0.1:8123", "sk-key") == {"Authorization": "Bearer sk-key"}
    admin_token.remove_token("http://127.0.0.1:8123", "another cluster's")  # a newer cluster's file stays
    assert path.exists()
    admin_token.remove_token("http://127.0.0.1:8123", "t0k")
    assert not path.exists()


def test_a_folder_others_can_enter_is_refused(runtime):
    runtime.mkdir(mode=0o755)
    runtime.chmod(0o755)
    with pytest.raises(PermissionError, match="0700"):
        admin_token.write_token("http://127.0.0.1:8123", "t0k")


def test_pdserve_scale_finds_the_token_of_a_running_cluster(tiny_llama_path):
    from cluster.run.launch import start_serving

    handle = start_serving(tiny_cluster_config(tiny_llama_path), in_process=True)
    try:
        url = f"{handle.base_url}/admin/scale"
        assert handle.token_file is not None and stat.S_IMODE(handle.token_file.stat().st_mode) == 0o600
        refused = httpx.post(url, json={"pool": "decode", "replicas": 2}, timeout=10)
        assert refused.status_code == 401 and refused.json()["error"]["type"] == "authentication_error"
        answer = post_scale(handle.base_url, "decode", 2, None, 60.0, api_key=None)  # what `pdserve scale` sends
        assert answer["pools"]["decode"]["workers"] == ["decode-0", "decode-1"]
        post_scale(handle.base_url, "decode", 1, None, 60.0, api_key=None)
        assert handle.scaler is not None and handle.scaler.wait_idle(timeout_s=20)
        wait_all_kv_free(handle.base_url)
    finally:
        handle.stop()
    assert not handle.token_file.exists()


def test_with_an_api_key_no_token_file_is_written(serve):
    handle = serve(router={"api_key": "sk-admin-test"})
    assert handle.token_file is None and admin_token.read_token(handle.base_url) is None
