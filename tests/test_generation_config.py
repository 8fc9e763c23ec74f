"""A model's generation_config.json as vLLM takes it: its sampling keys are
the defaults of whatever a request leaves out (offline and over HTTP),
`--generation-config vllm` ignores them, a folder or an override replaces
them, checkpoints written from the model keep them, bad ones fail the start."""
from __future__ import annotations

import json

import httpx
import pytest
from conftest import in_process_server

from qoqserve.llm import LLM
from qoqserve.model_loader import load_model_source
from qoqserve.model_loader.export import export_hf_dir
from qoqserve.model_loader.generation_config import read_generation_config, sampling_defaults
from qoqserve.sampling_params import SamplingParams

GEN = {"temperature": 0.0, "top_k": 5, "max_new_tokens": 7, "do_sample": True, "pad_token_id": 0}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    out = export_hf_dir("synthetic:tiny", str(tmp_path_factory.mktemp("gen") / "hf"), "float32")
    with open(f"{out}/generation_config.json") as f:
        body = json.load(f)
    with open(f"{out}/generation_config.json", "w") as f:
        json.dump({**body, **GEN}, f)
    return out


def test_the_sampling_keys_are_read_and_kept_by_exports(model_dir, tmp_path):
    source = load_model_source(model_dir)
    assert source.generation_config == {"temperature": 0.0, "top_k": 5, "max_new_tokens": 7}
    again = export_hf_dir(model_dir, str(tmp_path / "again"), "float32")
    assert read_generation_config(again) == source.generation_config
    assert load_model_source(again).arch.eos_token_ids == source.arch.eos_token_ids


def test_modes_overrides_and_errors(model_dir):
    model = {"temperature": 0.6, "max_new_tokens": 9}
    assert sampling_defaults("auto", model) == {"temperature": 0.6, "max_tokens": 9}
    assert sampling_defaults("vllm", model) == {}
    assert sampling_defaults(model_dir, {}) == {"temperature": 0.0, "top_k": 5, "max_tokens": 7}
    assert sampling_defaults("auto", model, '{"temperature": 0.2, "top_p": 0.5}') == {
        "temperature": 0.2, "top_p": 0.5, "max_tokens": 9}
    for mode, override, message in [("nowhere", None, "auto, vllm or a folder"),
                                    ("auto", '{"seed": 1}', "unknown keys"), ("auto", "{", "not JSON"),
                                    ("auto", '{"temperature": -1}', "not valid")]:
        with pytest.raises(ValueError, match=message):
            sampling_defaults(mode, model, override)


def test_requests_without_settings_get_the_models_defaults(model_dir):
    with LLM(model_dir, dtype="float32", kv_cache_gb=0.05, max_model_len=128) as llm:
        assert llm.get_default_sampling_params() == SamplingParams(temperature=0.0, top_k=5, max_tokens=7)
        plain = llm.generate([[5, 6, 7]])[0]
        assert len(plain.token_ids) == 7 and plain.finish_reason == "length"
        assert plain.token_ids == llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=7))[0].token_ids
        with in_process_server(llm.engine) as (base, _):
            body = httpx.post(base + "/v1/completions", timeout=60,
                              json={"prompt": [5, 6, 7], "max_tokens": None}).json()
            assert body["usage"]["completion_tokens"] == len(plain.token_ids)  # greedy, 7 tokens
            assert body["choices"][0]["text"] == plain.text
            hot = httpx.post(base + "/v1/completions", timeout=60,  # a request's own settings win
                             json={"prompt": [5, 6, 7], "max_tokens": 3, "temperature": 1.0, "seed": 1}).json()
            assert hot["usage"]["completion_tokens"] == 3
    with LLM(model_dir, dtype="float32", kv_cache_gb=0.05, max_model_len=128, generation_config="vllm") as llm:
        assert llm.get_default_sampling_params() == SamplingParams()
