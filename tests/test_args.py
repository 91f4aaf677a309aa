"""EngineArgs: one declaration of the engine settings, taken by the Python API and every CLI command."""

from __future__ import annotations

import dataclasses

import pytest

from orinfer.args import EngineArgs, engine_args_from_namespace
from orinfer.cli import build_parser
from orinfer.errors import ConfigError

MODEL_COMMANDS = {"generate": ["-p", "x"], "chat": [], "serve": []}


def _parse(command: str, *extra: str):
    return build_parser().parse_args([command, "-m", "DIR", *MODEL_COMMANDS[command], *extra])


def _cli_settings() -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(EngineArgs) if "help" in f.metadata]


@pytest.mark.parametrize("command", sorted(MODEL_COMMANDS))
def test_every_model_command_takes_every_setting_with_the_same_defaults(command):
    args = engine_args_from_namespace(_parse(command))
    assert args == EngineArgs()
    names = {f.name for f in _cli_settings()}
    assert names <= set(vars(_parse(command)))


@pytest.mark.parametrize("command", sorted(MODEL_COMMANDS))
def test_flags_reach_the_engine_args(command):
    ns = _parse(command, "--max-num-seqs", "7", "--no-cuda-graph", "--dtype", "float16", "--max-num-batched-tokens",
                "512", "--gpu-memory-utilization", "0.5", "--no-async-scheduling", "--pre-dequant", "--backend",
                "torch")
    args = engine_args_from_namespace(ns)
    assert (args.max_num_seqs, args.cuda_graph, args.dtype, args.max_num_batched_tokens) == (7, False, "float16", 512)
    assert (args.gpu_memory_utilization, args.async_scheduling, args.pre_dequant, args.backend) == (
        0.5, False, True, "torch")


def test_generate_sampling_seed_is_not_an_engine_setting():
    """`generate --seed` seeds the request's sampling; EngineArgs.seed (Python only) seeds torch at load."""
    ns = _parse("generate", "--seed", "3")
    assert ns.seed == 3 and engine_args_from_namespace(ns).seed is None


def test_bench_takes_its_subset_with_bf16_by_default():
    ns = build_parser().parse_args(["bench", "--synthetic", "qwen3-8b", "--no-fused-ffn"])
    assert ns.dtype == "bfloat16" and ns.fused_ffn is False and ns.cuda_graph is True
    assert not hasattr(ns, "max_num_seqs")  # the workload sets the batching limits


def test_python_only_settings_have_no_flags():
    assert {f.name for f in dataclasses.fields(EngineArgs)} - {f.name for f in _cli_settings()} == {
        "seed", "progress", "kv_cache_bytes", "num_kv_blocks"}


@pytest.mark.parametrize("setting, value, message", [
    ("max_num_seqs", 0, "max_num_seqs must be a positive integer"),
    ("block_size", -16, "block_size must be a positive integer"),
    ("max_model_len", 0, "max_model_len must be a positive integer or None"),
    ("gpu_memory_utilization", 1.5, "gpu_memory_utilization must be in"),
    ("num_kv_blocks", True, "num_kv_blocks must be a positive integer or None"),
])
def test_out_of_range_settings_are_config_errors(setting, value, message):
    with pytest.raises(ConfigError, match=message):
        EngineArgs(**{setting: value})
    with pytest.raises(ConfigError, match=message):
        EngineArgs().replace(**{setting: value})


def test_unknown_setting_is_named():
    with pytest.raises(ConfigError, match="unknown engine setting.*max_num_seq\\b"):
        EngineArgs.from_kwargs(max_num_seq=4)


def test_llm_rejects_an_unknown_setting_before_loading(tmp_path):
    from orinfer import LLM

    with pytest.raises(ConfigError, match="unknown engine setting.*gpu_mem"):
        LLM(tmp_path / "no-such-model", gpu_mem=0.5)


def test_cli_reports_a_bad_setting_as_an_error_not_a_traceback(capsys):
    from orinfer.cli import main

    assert main(["generate", "-m", "/nonexistent", "-p", "x", "--max-num-seqs", "0"]) == 2
    assert "max_num_seqs must be a positive integer" in capsys.readouterr().err
