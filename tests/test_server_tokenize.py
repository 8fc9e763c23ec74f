"""vLLM's /tokenize and /detokenize: the served tokenizer, and conversations
rendered exactly as /v1/chat/completions renders them."""
from __future__ import annotations

import json

import httpx
import pytest

KEY = {"Authorization": "Bearer test-key"}
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a yellow fruit."}]


def post(server, path: str, body: dict) -> httpx.Response:
    raw = json.dumps(body).encode()  # ASCII escapes: a lone surrogate travels as \\ud800
    return httpx.post(server.base + path, content=raw, headers={**KEY, "Content-Type": "application/json"},
                      timeout=60)


def test_a_text_tokenizes_as_the_engine_does_and_comes_back(server, reference_llm):
    tok = reference_llm.engine.tokenizer
    text = "Héllo wörld, 中文 🙂 tokens"
    r = post(server, "/tokenize", {"prompt": text, "return_token_strs": True}).json()
    assert r["tokens"] == tok.encode(text) and r["count"] == len(r["tokens"])
    assert r["token_strs"] == [tok.token_to_str(t) for t in r["tokens"]]
    assert r["max_model_len"] == 512  # the test server's --max-model-len
    bare = post(server, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()
    assert bare["tokens"] == tok.encode(text, add_special_tokens=False) and bare["token_strs"] is None
    assert post(server, "/detokenize", {"tokens": bare["tokens"]}).json() == {"prompt": text}


def test_a_conversation_counts_what_chat_completions_bills(server):
    r = post(server, "/tokenize", {"messages": CHAT}).json()
    done = post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 1}).json()
    assert r["count"] == done["usage"]["prompt_tokens"]
    shorter = post(server, "/tokenize", {"messages": CHAT, "add_generation_prompt": False}).json()
    assert shorter["tokens"] == r["tokens"][:shorter["count"]] and shorter["count"] < r["count"]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    with_tools = post(server, "/tokenize", {"messages": CHAT, "tools": tools}).json()
    assert with_tools["count"] > r["count"]  # the tools are described in the prompt


@pytest.mark.parametrize("path,body,param", [
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "\ud800"}, "prompt"),
    ("/tokenize", {"messages": []}, "messages"),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ("/tokenize", {"prompt": "hi", "model": "nope"}, "model"),
    ("/detokenize", {"tokens": [10**8]}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens.0"),
    ("/detokenize", {"tokens": "12"}, "tokens"),
])
def test_bad_bodies_are_openai_errors(server, path, body, param):
    r = post(server, path, body)
    assert r.status_code in (400, 404), r.text
    assert r.json()["error"]["param"] == param


def test_version_is_the_packages(server):
    from qoqserve import __version__

    assert httpx.get(server.base + "/version").json() == {"version": __version__}
