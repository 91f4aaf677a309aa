"""Bad input gets a clear error naming the problem, never a traceback from deep inside."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from orinfer import LLM, SamplingParams
from orinfer.cli import main as cli_main
from orinfer.errors import ConfigError, RequestError, WeightsError
from orinfer.tokenizer import TokenizerError


@pytest.fixture()
def model_copy(tiny_dir, tmp_path):
    dst = tmp_path / "model"
    shutil.copytree(tiny_dir, dst)
    return dst


def _load(path):
    return LLM(path, dtype="float32", device="cpu", progress=False)


def test_missing_directory(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        _load(tmp_path / "nope")


def test_missing_config(model_copy):
    (model_copy / "config.json").unlink()
    with pytest.raises(ConfigError, match="no config.json"):
        _load(model_copy)


def test_malformed_config(model_copy):
    (model_copy / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        _load(model_copy)


def test_unknown_architecture_lists_supported(model_copy):
    cfg = json.loads((model_copy / "config.json").read_text())
    cfg["architectures"] = ["LlamaForCausalLM"]
    (model_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="LlamaForCausalLM.*Qwen2ForCausalLM, Qwen3ForCausalLM"):
        _load(model_copy)


def test_unsupported_rope_scaling(model_copy):
    cfg = json.loads((model_copy / "config.json").read_text())
    cfg["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0}
    (model_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="yarn"):
        _load(model_copy)


def test_missing_weights(model_copy):
    (model_copy / "model.safetensors").unlink()
    with pytest.raises(WeightsError, match="no \\*.safetensors"):
        _load(model_copy)


def test_missing_tensor_is_named(model_copy):
    path = model_copy / "model.safetensors"
    tensors = load_file(path)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, path)
    with pytest.raises(WeightsError, match="model.layers.1.mlp.up_proj.weight"):
        _load(model_copy)


def test_wrongly_shaped_tensor_is_named(model_copy):
    path = model_copy / "model.safetensors"
    tensors = load_file(path)
    name = "model.layers.0.self_attn.k_proj.weight"
    tensors[name] = torch.zeros(tensors[name].shape[0] + 1, tensors[name].shape[1])
    save_file(tensors, path)
    with pytest.raises(WeightsError, match=f"{name}: expected shape"):
        _load(model_copy)


def test_corrupt_safetensors(model_copy):
    path = model_copy / "model.safetensors"
    path.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(WeightsError, match="model.safetensors"):
        _load(model_copy)


def test_index_listing_absent_shard(model_copy):
    (model_copy / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(WeightsError, match="model-00002-of-00002"):
        _load(model_copy)


def test_missing_tokenizer_for_text_prompt(tiny_dir, tmp_path):
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        LLM(tiny_dir, tokenizer=tmp_path, dtype="float32", device="cpu", progress=False)


def test_bad_dtype_and_device(tiny_dir):
    with pytest.raises(ConfigError, match="unknown dtype"):
        LLM(tiny_dir, dtype="float8", device="cpu", progress=False)
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="CUDA is not available"):
            LLM(tiny_dir, device="cuda", progress=False)
    with pytest.raises(ConfigError, match="unknown backend"):
        LLM(tiny_dir, backend="tpu", device="cpu", progress=False)


def test_empty_prompt(tiny_llm):
    with pytest.raises(RequestError, match="empty"):
        tiny_llm.generate("", SamplingParams(max_tokens=4))
    with pytest.raises(RequestError, match="empty"):
        tiny_llm.generate([[]], SamplingParams(max_tokens=4))
    with pytest.raises(RequestError, match="no prompts"):
        tiny_llm.generate([], SamplingParams(max_tokens=4))


def test_prompt_longer_than_context(tiny_dir):
    llm = LLM(tiny_dir, dtype="float32", device="cpu", progress=False, max_model_len=64)
    with pytest.raises(RequestError, match="context length is 64"):
        llm.generate([[5] * 64], SamplingParams(max_tokens=1))
    with pytest.raises(RequestError, match="exceeds the context length of 64"):
        llm.generate([[5] * 40], SamplingParams(max_tokens=30))
    # Nothing is left behind in the engine after a rejected request.
    assert not llm.engine.has_unfinished()


def test_token_ids_outside_vocabulary(tiny_llm):
    with pytest.raises(RequestError, match="outside the vocabulary"):
        tiny_llm.generate([[1, 2, 10 ** 9]], SamplingParams(max_tokens=2))


@pytest.mark.parametrize("field,value", [
    ("temperature", -0.5), ("temperature", float("nan")), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -3),
    ("min_p", 2.0), ("repetition_penalty", 0.0), ("presence_penalty", 3.0), ("frequency_penalty", float("inf")),
    ("max_tokens", 0), ("max_tokens", 2.5), ("seed", "abc"), ("logprobs", 50), ("stop", [""]),
    ("stop_token_ids", [-1]), ("temperature", "hot"),
])
def test_invalid_sampling_values(field, value):
    with pytest.raises(RequestError, match=field):
        SamplingParams(**{field: value})


def test_cli_reports_errors_without_traceback(tmp_path, capsys):
    assert cli_main(["generate", "-m", str(tmp_path / "none"), "-p", "hi", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: model directory not found") and "Traceback" not in err
    assert cli_main(["generate", "-m", str(tmp_path), "-p", "hi", "--top-p", "7"]) == 2
    assert "top_p" in capsys.readouterr().err
