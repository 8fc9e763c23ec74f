"""The server's HTTP options as vLLM's flags name them: CORS (every origin
by default, as vLLM and llama.cpp's server; a preflight needs no API key),
HTTPS from a key and certificate, and the flags' errors."""
from __future__ import annotations

import subprocess
import sys

import httpx
import pytest
from conftest import ServerProcess, in_process_server

from qoqserve.server.config import ServerConfig


def test_cors_allows_browsers_by_default_and_only_the_given_origins_when_told(reference_llm):
    pre = {"Origin": "http://app.example", "Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "authorization,content-type"}
    with in_process_server(reference_llm.engine, ServerConfig(api_key="k")) as (base, _):
        r = httpx.options(base + "/v1/chat/completions", headers=pre)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
        r = httpx.get(base + "/v1/models", headers={"Origin": "http://app.example", "Authorization": "Bearer k"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
        assert httpx.get(base + "/v1/models", headers={"Origin": "http://app.example"}).status_code == 401
    only = ServerConfig(allowed_origins=["http://ok.example"])
    with in_process_server(reference_llm.engine, only) as (base, _):
        assert httpx.options(base + "/v1/completions", headers=pre).status_code == 400
        ok = httpx.options(base + "/v1/completions", headers={**pre, "Origin": "http://ok.example"})
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "http://ok.example"


def test_https_with_a_key_and_certificate(tmp_path):
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=127.0.0.1"], check=True, capture_output=True)
    server = ServerProcess(["synthetic:tiny", "--ssl-keyfile", str(key), "--ssl-certfile", str(cert)],
                           scheme="https")
    try:
        assert server.base.startswith("https://")
        r = httpx.post(server.base + "/v1/completions", verify=False, timeout=60,
                       json={"prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        with pytest.raises(httpx.HTTPError):  # no plain HTTP on that port
            httpx.get(server.base.replace("https", "http") + "/health", timeout=5)
    finally:
        assert server.stop() == 0


def test_root_path_names_the_proxys_prefix_and_keeps_the_key():
    """Behind a proxy that serves the API under /api and strips it (uvicorn's
    root_path: the prefix is in each request's path as the app sees it)."""
    server = ServerProcess(["synthetic:tiny", "--root-path", "/api"], api_key="k")
    try:
        assert httpx.get(server.base + "/v1/models").status_code == 401
        r = httpx.get(server.base + "/v1/models", headers={"Authorization": "Bearer k"})
        assert r.status_code == 200 and r.json()["data"]
        assert httpx.get(server.base + "/openapi.json").json()["servers"] == [{"url": "/api"}]
    finally:
        assert server.stop() == 0


def test_several_served_model_names_are_each_taken_and_the_first_answers(reference_llm):
    """vLLM's --served-model-name with several names (an alias an app has
    written in, say): requests may give any, answers carry the first."""
    config = ServerConfig(served_model_name=["smol", "gpt-4o-mini"])
    with in_process_server(reference_llm.engine, config) as (base, _):
        assert [m["id"] for m in httpx.get(base + "/v1/models").json()["data"]] == ["smol", "gpt-4o-mini"]
        body = {"prompt": "Hi", "max_tokens": 2, "temperature": 0}
        r = httpx.post(base + "/v1/completions", json={**body, "model": "gpt-4o-mini"}, timeout=60)
        assert r.status_code == 200 and r.json()["model"] == "smol"
        r = httpx.post(base + "/v1/completions", json={**body, "model": "gpt-4"}, timeout=60)
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    from qoqserve.cli.main import build_parser
    args = build_parser().parse_args(["serve", "--served-model-name", "a", "b"])
    assert args.served_model_name == ["a", "b"] and ServerConfig(served_model_name="a").served_model_name == ["a"]


@pytest.mark.parametrize("args, message", [
    (["--allowed-origins", "*"], "JSON list"),
    (["--ssl-keyfile", "k.pem"], "both --ssl-keyfile and --ssl-certfile")])
def test_bad_flags_say_what_is_wrong(args, message):
    r = subprocess.run([sys.executable, "-m", "qoqserve.cli.main", "serve", "synthetic:tiny", *args],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and message in r.stderr


def test_vllm_command_lines_for_tools_and_reasoning_parse():
    """`vllm serve ... --enable-auto-tool-choice --tool-call-parser hermes
    --reasoning-parser qwen3` runs unchanged; a tool-call format this server does
    not read is refused by argparse, naming the one it does."""
    from qoqserve.cli.main import build_parser
    args = build_parser().parse_args(["serve", "Qwen/Qwen3-0.6B", "--enable-auto-tool-choice",
                                      "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3",
                                      "--trust-remote-code", "--enable-chunked-prefill", "--disable-log-requests",
                                      "--disable-log-stats", "--gpu-memory-utilization", "0.9"])
    assert args.enable_auto_tool_choice and args.tool_call_parser == "hermes" and args.reasoning_parser == "qwen3"
    assert args.gpu_memory_utilization == 0.9
    r = subprocess.run([sys.executable, "-m", "qoqserve.cli.main", "serve", "synthetic:tiny",
                        "--tool-call-parser", "llama3_json"], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "hermes" in r.stderr
