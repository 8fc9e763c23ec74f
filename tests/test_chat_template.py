"""Chat templates given in place of the model's (--chat-template, LLM(chat_template=),
a request's chat_template) and vLLM's render options: continue_final_message,
chat_template_kwargs; their errors name what is wrong."""
from __future__ import annotations

import json

import httpx
import pytest
from conftest import in_process_server

from qoqserve.llm import LLM
from qoqserve.model_loader.chat_template import ChatTemplateError, load_chat_template, render_chat
from qoqserve.sampling_params import SamplingParams
from qoqserve.server.config import ServerConfig

KEY = {"Authorization": "Bearer test-key"}
PLAIN = "{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>\n{% endfor %}" \
        "{% if add_generation_prompt %}<assistant>{% endif %}"
PARTIAL = [{"role": "user", "content": "Name a yellow fruit."}, {"role": "assistant", "content": "A yellow fruit is"}]


def post(base: str, path: str, body: dict, headers: dict | None = None) -> httpx.Response:
    return httpx.post(base + path, content=json.dumps(body).encode(),
                      headers={**(headers or {}), "Content-Type": "application/json"}, timeout=60)


def test_a_template_is_text_or_a_file_and_a_bad_one_is_named(tmp_path):
    assert load_chat_template(PLAIN) == PLAIN
    f = tmp_path / "t.jinja"
    f.write_text(PLAIN, encoding="utf-8")
    assert load_chat_template(str(f)) == PLAIN
    missing = str(tmp_path / "nope.jinja")
    with pytest.raises(ChatTemplateError, match="nope.jinja.*could not be read"):
        load_chat_template(missing)
    bad = tmp_path / "bad.jinja"
    bad.write_text("line one\n{% for m in messages %}\n{{ m.content }}\n", encoding="utf-8")
    with pytest.raises(ChatTemplateError, match=r"bad\.jinja: Jinja syntax error at line \d"):
        load_chat_template(str(bad))
    with pytest.raises(ChatTemplateError, match="syntax error"):
        load_chat_template("{{ unclosed")


def test_continue_final_message_leaves_the_last_message_open(reference_llm):
    tok = reference_llm.engine.tokenizer
    closed = tok.apply_chat_template(PARTIAL, add_generation_prompt=False)
    open_ = tok.apply_chat_template(PARTIAL, add_generation_prompt=False, continue_final_message=True)
    assert open_.endswith("A yellow fruit is") and closed.startswith(open_) and len(closed) > len(open_)
    # a template that writes the content trimmed still ends where the text does
    trimmed = "{% for m in messages %}[{{ m.content | trim }}]{% endfor %}"
    last = [{"role": "assistant", "content": "  it is  "}]
    assert render_chat(trimmed, last, add_generation_prompt=False, continue_final_message=True) == "[it is"
    with pytest.raises(ChatTemplateError) as both:
        render_chat(PLAIN, PARTIAL, add_generation_prompt=True, continue_final_message=True)
    assert both.value.option == "continue_final_message"
    with pytest.raises(ChatTemplateError, match="does not appear"):
        render_chat(PLAIN, [{"role": "assistant", "content": ""}], add_generation_prompt=False,
                    continue_final_message=True)


def test_template_kwargs_reach_the_template_but_cannot_replace_its_inputs():
    greet = "{{ greeting }}: {{ messages[0].content }}"
    msgs = [{"role": "user", "content": "x"}]
    assert render_chat(greet, msgs, template_kwargs={"greeting": "Hey"}) == "Hey: x"
    with pytest.raises(ChatTemplateError) as e:
        render_chat(greet, msgs, template_kwargs={"messages": []})
    assert e.value.option == "chat_template_kwargs"


def test_llm_chat_takes_vllms_template_options(reference_llm):
    tok, params = reference_llm.engine.tokenizer, SamplingParams(temperature=0.0, max_tokens=4)
    [out] = reference_llm.chat(PARTIAL[:1], params, chat_template=PLAIN)
    assert out.prompt_token_ids == tok.encode("<user>Name a yellow fruit.</user>\n<assistant>",
                                              add_special_tokens=False)
    [cont] = reference_llm.chat(PARTIAL, params, add_generation_prompt=False, continue_final_message=True)
    expected = tok.apply_chat_template(PARTIAL, add_generation_prompt=False, continue_final_message=True)
    assert cont.prompt_token_ids == tok.encode(expected, add_special_tokens=False)
    [ref] = reference_llm.generate([cont.prompt_token_ids], params)
    assert cont.token_ids == ref.token_ids


def test_the_engine_option_replaces_the_models_template_and_a_bad_one_fails_the_start(default_gguf_path, tmp_path):
    f = tmp_path / "plain.jinja"
    f.write_text(PLAIN, encoding="utf-8")
    llm = LLM(default_gguf_path, dtype="float32", kv_cache_gb=0.02, max_model_len=256, enforce_eager=True,
              chat_template=str(f))
    try:
        assert llm.engine.tokenizer.chat_template == PLAIN
        assert llm.engine.tokenizer.apply_chat_template(PARTIAL[:1]) == "<user>Name a yellow fruit.</user>\n<assistant>"
    finally:
        llm.shutdown()
    with pytest.raises(ChatTemplateError, match="missing.jinja"):
        LLM(default_gguf_path, dtype="float32", kv_cache_gb=0.02, max_model_len=256,
            chat_template=str(tmp_path / "missing.jinja"))


def test_the_server_renders_the_options_as_the_tokenizer_does(server, reference_llm):
    tok = reference_llm.engine.tokenizer
    r = post(server.base, "/tokenize", {"messages": PARTIAL, "add_generation_prompt": False,
                                        "continue_final_message": True}, KEY).json()
    expected = tok.apply_chat_template(PARTIAL, add_generation_prompt=False, continue_final_message=True)
    assert r["tokens"] == tok.encode(expected, add_special_tokens=False)
    done = post(server.base, "/v1/chat/completions", {"messages": PARTIAL, "add_generation_prompt": False,
                                                      "continue_final_message": True, "max_tokens": 3,
                                                      "temperature": 0}, KEY).json()
    assert done["usage"]["prompt_tokens"] == r["count"]
    # kwargs the model's template does not read change nothing
    plain = post(server.base, "/tokenize", {"messages": PARTIAL[:1]}, KEY).json()
    kw = post(server.base, "/tokenize", {"messages": PARTIAL[:1], "chat_template_kwargs": {"unused": 1}}, KEY).json()
    assert kw["tokens"] == plain["tokens"]


@pytest.mark.parametrize("body,param", [
    ({"messages": PARTIAL, "continue_final_message": True}, "continue_final_message"),
    ({"messages": PARTIAL[:1], "chat_template": PLAIN}, "chat_template"),
    ({"messages": PARTIAL[:1], "chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs"),
    ({"messages": PARTIAL[:1], "chat_template_kwargs": [1]}, "chat_template_kwargs"),
])
@pytest.mark.parametrize("path", ["/tokenize", "/v1/chat/completions"])
def test_bad_template_options_are_400s_naming_the_field(server, path, body, param):
    r = post(server.base, path, {**body, "max_tokens": 2} if path != "/tokenize" else body, KEY)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_a_trusting_server_renders_the_requests_template(reference_llm):
    tok = reference_llm.engine.tokenizer
    with in_process_server(reference_llm.engine, ServerConfig(trust_request_chat_template=True)) as (base, _):
        r = post(base, "/tokenize", {"messages": PARTIAL[:1], "chat_template": PLAIN}).json()
        assert r["tokens"] == tok.encode("<user>Name a yellow fruit.</user>\n<assistant>", add_special_tokens=False)
        greet = post(base, "/tokenize", {"messages": PARTIAL[:1], "chat_template": "{{ hi }}!",
                                         "chat_template_kwargs": {"hi": "Hello"}}).json()
        assert greet["tokens"] == tok.encode("Hello!", add_special_tokens=False)
        done = post(base, "/v1/chat/completions", {"messages": PARTIAL[:1], "chat_template": PLAIN,
                                                   "max_tokens": 2, "temperature": 0}).json()
        assert done["usage"]["prompt_tokens"] == r["count"]
        bad = post(base, "/v1/chat/completions", {"messages": PARTIAL[:1], "chat_template": "{% if %}",
                                                  "max_tokens": 2})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "chat_template"
