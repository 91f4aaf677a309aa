"""The public Python API: `LLM(model_dir).generate(prompts, SamplingParams(...))`, `.chat(...)`, `.stream(...)`."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any, Iterator, Sequence as Seq

import torch

from orinfer.args import EngineArgs
from orinfer.config import QWEN3_VL_MOE_ARCHITECTURE, VL_ARCHITECTURE, ModelConfig, resolve_dtype
from orinfer.distributed.executor import TensorParallelExecutor
from orinfer.distributed.group import rank_local
from orinfer.distributed.shard_source import ShardSource
from orinfer.distributed.sharding import check_supported
from orinfer.engine.llm_engine import DraftParts, EngineParts, LLMEngine
from orinfer.engine.sequence import Sequence
from orinfer.errors import ConfigError, RequestError
from orinfer.layers.ops import get_ops
from orinfer.loader import load_hf_model, online_quantization, read_generation_config
from orinfer.loader.seed_bin import is_seed_bin, load_bin_model, read_bin_config
from orinfer.outputs import RequestOutput
from orinfer.prompt_inputs import parse_prompt, split_chat
from orinfer.sampling_params import SamplingParams
from orinfer.spec_decode.config import SpeculativeConfig
from orinfer.spec_decode.drafter import draft_config, target_config
from orinfer.thinking import initial_state
from orinfer.tool_calls import (answer_start, check_parser_for, check_tools, constrain_tool_choice, parse_chat_output,
                                parse_tool_choice, resolve_format)
from orinfer.tool_calls.history import template_messages

log = logging.getLogger(__name__)

# Checkpoints that get orinfer's Qwen3-VL chat template when their tokenizer has none (`_load_tokenizer`).
_QWEN3_VL_TEMPLATE = (VL_ARCHITECTURE, QWEN3_VL_MOE_ARCHITECTURE)

# A string, token ids, or {"prompt"/"prompt_token_ids": ..., "multi_modal_data": {"image": [...]}} (see
# orinfer/prompt_inputs.py).
Prompt = str | Seq[int] | dict[str, Any]
Message = dict[str, Any]


def _load_draft(args: EngineArgs, target: ModelConfig, ops: Any, weight_dtype: torch.dtype, act_dtype: torch.dtype,
                device: torch.device) -> DraftParts | None:
    """The draft model of `speculative_config` (method draft_model), loaded like the target; None for other methods.
    It must share the target's vocabulary and be a plain decoder (no linear-attention state to roll back)."""
    spec = SpeculativeConfig.parse(args.speculative_config)
    if spec is None or spec.method != "draft_model":
        return None
    draft_dir = Path(spec.model)
    config = draft_config(spec, ModelConfig.from_hf(draft_dir), str(draft_dir))
    if config.vocab_size != target.vocab_size:
        raise ConfigError(f"speculative_config: the draft model's vocabulary ({config.vocab_size}) is not the "
                          f"target's ({target.vocab_size}); use a model of the same tokenizer")
    if config.is_hybrid or config.is_multimodal:
        raise ConfigError(f"speculative_config: the draft model must be a text-only decoder without linear attention "
                          f"(e.g. Qwen3-0.6B), not {config.architecture}")
    with rank_local():  # tensor parallelism: the draft is whole, on rank 0 only, and runs without collectives
        model = load_hf_model(draft_dir, ops, weight_dtype, act_dtype, device, config, progress=args.progress)
    return DraftParts(model, config)


def start_tensor_parallel(source: ShardSource) -> TensorParallelExecutor:
    """Checks that `source` can be split over `args.tensor_parallel_size` ranks, then starts them (rank 0 here)."""
    world = source.args.tensor_parallel_size
    check_supported(source.config, world)
    if source.device_type == "cuda":
        if source.args.device not in (None, "cuda"):
            raise ConfigError(f"tensor_parallel_size {world} runs rank r on cuda:r; device must be 'cuda', "
                              f"not {source.args.device!r}")
        if torch.cuda.device_count() < world:
            raise ConfigError(f"tensor_parallel_size {world} needs {world} GPUs; this machine has "
                              f"{torch.cuda.device_count()}")
    return TensorParallelExecutor(source, world)


def resolve_device(device: str | torch.device | None) -> torch.device:
    """None -> cuda when available, else cpu. A cuda device without CUDA is a clear error."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device 'cuda' was requested but CUDA is not available on this machine")
    return dev


class LLM:
    """A loaded model plus its engine. Settings are `EngineArgs` fields, given as keywords (as vLLM's `LLM` takes
    them) or as one `EngineArgs`: `LLM(dir, dtype="bfloat16", max_num_seqs=32)` or `LLM(dir, args)`."""

    def __init__(self, model: str | Path, args: EngineArgs | None = None, **settings: Any) -> None:
        """Loads `model` (a local HF directory, or the seed's `.bin` file) and starts its engine.

        Settings (see `orinfer.args.EngineArgs` for each one's meaning and default) include dtype, device, backend,
        max_model_len, max_num_seqs, max_num_batched_tokens, gpu_memory_utilization, cuda_graph, pre_dequant (AWQ
        models: a 16-bit weight copy for prefill; a ConfigError for others) and max_pixels (vision-language models).
        An unknown setting is a ConfigError naming it."""
        args = _merge_settings(args, settings)
        if args.seed is not None:
            torch.manual_seed(args.seed)
        dev = resolve_device(args.device)
        model_dir = Path(model)
        seed_bin = is_seed_bin(model_dir)  # the seed's single-file .bin (AWQ v5 / FP16 v6), else a HF directory
        model_config = read_bin_config(model_dir) if seed_bin else ModelConfig.from_hf(model_dir)
        if args.quantization is not None:
            if seed_bin:
                raise ConfigError("quantization (--quantization) applies to Hugging Face directories, not .bin files")
            model_config = online_quantization(model_config, args.quantization, str(model_dir))
        if args.pre_dequant and model_config.quantization is None:
            raise ConfigError(f"pre_dequant (--pre-dequant) applies to AWQ INT4 models; {model_dir} is not quantized "
                              "(its weights are already 16-bit)")
        spec = SpeculativeConfig.parse(args.speculative_config)
        if model_config.mtp_num_hidden_layers and (spec is None or spec.method != "mtp"):
            # The MTP head (mtp.* tensors) is built and loaded only for speculative_config method "mtp".
            model_config = dataclasses.replace(model_config, mtp_num_hidden_layers=0)
        model_config = target_config(spec, model_config)  # the FP8 drafter's MTP head (spec_decode/drafter.py)
        weight_dtype, act_dtype = resolve_dtype(args.dtype, dev, model_config.torch_dtype)
        ops = get_ops(args.backend, dev, fused_ffn=args.fused_ffn)
        home = _home(model_dir, args, seed_bin)
        tok = _load_tokenizer(args.tokenizer, home, model_config.architecture in _QWEN3_VL_TEMPLATE)
        executor = None
        if args.tensor_parallel_size > 1:
            if seed_bin:
                raise ConfigError("tensor_parallel_size > 1 needs a Hugging Face directory, not the seed's .bin file")
            executor = start_tensor_parallel(ShardSource(model_config, str(model_dir), weight_dtype, act_dtype, args,
                                                         dev.type))
            net, ops, dev = executor.driver_model(), executor.shard.ops, executor.shard.device
        elif seed_bin:
            net, _ = load_bin_model(model_dir, ops, weight_dtype, act_dtype, dev)
        else:
            net = load_hf_model(model_dir, ops, weight_dtype, act_dtype, dev, model_config, progress=args.progress)
        if args.pre_dequant and executor is None:  # tensor parallelism: each rank's own (build_shard)
            from orinfer.layers.awq_linear import pre_dequantize_model

            pre_dequantize_model(net, act_dtype)
        image_processor = _image_processor(home, args.max_pixels) if model_config.is_multimodal else None
        parts = EngineParts(net, model_config, tok, read_generation_config(home), dev, act_dtype, ops=ops,
                            image_processor=image_processor,
                            draft=_load_draft(args, model_config, ops, weight_dtype, act_dtype, dev),
                            executor=executor)
        try:
            self.engine = LLMEngine(parts, args)
        except BaseException:
            if executor is not None:
                executor.shutdown()
            raise
        self.tokenizer = tok
        self.device = dev
        log.info("loaded %s (%s, %s weights, %s activations, %s backend)", model_dir, model_config.architecture,
                 weight_dtype, act_dtype, ops.name)

    def close(self) -> None:
        """Stops the engine's worker processes (tensor parallelism; nothing to do otherwise). Also run at exit."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @staticmethod
    def load_tokenizer(model: str | Path, args: EngineArgs | None = None) -> Any:
        """The tokenizer `LLM(model, args)` would use (None when there is none), without loading the weights: for a
        process that serves an engine running elsewhere."""
        args = args or EngineArgs()
        model_dir = Path(model)
        seed_bin = is_seed_bin(model_dir)
        model_config = read_bin_config(model_dir) if seed_bin else ModelConfig.from_hf(model_dir)
        return _load_tokenizer(args.tokenizer, _home(model_dir, args, seed_bin),
                               model_config.architecture in _QWEN3_VL_TEMPLATE)

    @classmethod
    def from_parts(cls, parts: EngineParts, args: EngineArgs | None = None) -> "LLM":
        """An LLM over an already built model (random weights for benchmarks, models made in tests)."""
        self = cls.__new__(cls)
        try:
            self.engine = LLMEngine(parts, args or EngineArgs())
        except BaseException:
            if parts.executor is not None:
                parts.executor.shutdown()
            raise
        self.tokenizer = parts.tokenizer
        self.device = parts.device
        return self

    # --- generation -------------------------------------------------------------------------------------------------

    def generate(self, prompts: Prompt | Seq[Prompt], params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Runs all prompts to completion, batched together; outputs come back in the order of the prompts."""
        batch = _as_prompt_list(prompts)
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(batch)
        if len(plist) != len(batch):
            raise RequestError(f"got {len(plist)} SamplingParams for {len(batch)} prompts")
        seqs = []
        try:
            for prompt, p in zip(batch, plist):
                seqs.append(self._add(prompt, p))
            self._run(len(seqs), use_tqdm)
        except BaseException:
            for seq in seqs:  # leave nothing half-run in the engine (e.g. after Ctrl-C or a bad prompt)
                self.engine.abort(seq.request_id)
            raise
        outputs = [RequestOutput.of(seq) for seq in seqs]
        for seq in seqs:
            self.engine.release(seq.request_id)
        return outputs

    def _add(self, prompt: Prompt, params: SamplingParams | None) -> Sequence:
        """Queues one prompt of any accepted form (text, token ids, dict with images)."""
        request = parse_prompt(prompt)
        return self.engine.add_request(request.prompt, params, images=request.images or None,
                                       max_pixels=request.max_pixels)

    def _run(self, total: int, use_tqdm: bool) -> None:
        from tqdm.auto import tqdm

        bar = tqdm(total=total, desc="Generating", disable=not use_tqdm, leave=False)
        with bar:
            while self.engine.has_unfinished():
                done = sum(s.is_finished for s in self.engine.step())
                bar.update(done)

    def chat(self, messages: list[Message] | list[list[Message]], params: SamplingParams | None = None, *,
             enable_thinking: bool | None = None, add_generation_prompt: bool = True,
             tools: list[dict] | None = None, tool_choice: str | dict[str, Any] | None = None,
             chat_template_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """Renders each conversation with the model's chat template and generates the assistant's reply.

        A message's content may be a list of OpenAI-style parts (text, image_url, image): see prompt_inputs.py.
        Each output's `reasoning_content`, `content` and `tool_calls` hold the answer split as the server splits it.
        `tools` (OpenAI's function tools) and `tool_choice` ("auto" by default with tools, "none", "required" or
        {"type": "function", "function": {"name": ...}}) work as in the server; a bad one is a RequestError naming
        the field. The tool-call format is the chat template's (EngineArgs.tool_call_parser overrides it)."""
        tools = check_tools(tools)
        choice = parse_tool_choice(tool_choice, tools)
        tool_format = resolve_format(self.engine.config.tool_call_parser,
                                     self.tokenizer.chat_template_for(True) if self.tokenizer is not None else None)
        check_parser_for(choice, tool_format)
        prompt_tools = tools if choice.parses else None
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.chat_prompt(c, enable_thinking=enable_thinking, add_generation_prompt=add_generation_prompt,
                                    tools=prompt_tools, **(chat_template_kwargs or {})) for c in conversations]
        params = constrain_tool_choice(params, choice, prompt_tools, tool_format)
        per_prompt: SamplingParams | list[SamplingParams] | None = params
        if params is not None and params.structured_outputs is not None and params.think_state is None:
            # The constraint applies after </think>: each prompt says where its output starts.
            per_prompt = [dataclasses.replace(params, think_state=initial_state(
                p if isinstance(p, str) else p["prompt"]).value) for p in prompts]
        outputs = self.generate(prompts, per_prompt)
        for out, prompt in zip(outputs, prompts):
            text = prompt if isinstance(prompt, str) else prompt["prompt"]
            res = parse_chat_output(out.text, answer_start(self.tokenizer, text),
                                    prompt_tools is not None and tool_format is not None, prompt_tools)
            out.reasoning_content, out.content, out.tool_calls = res.reasoning, res.content, res.calls
        return outputs

    def chat_prompt(self, messages: list[Message], **kwargs: Any) -> Prompt:
        """The generate() prompt of a conversation: the rendered text, with its images when it has any."""
        multimodal = self.engine.parts.model_config.is_multimodal
        rendered, images = split_chat(template_messages(messages), multimodal)
        text = self.render_chat(rendered, **kwargs)
        if not images:
            return text
        return {"prompt": text, "multi_modal_data": {"image": images}}

    def render_chat(self, messages: list[Message], **kwargs: Any) -> str:
        if self.tokenizer is None:
            raise RequestError("this model has no tokenizer, so it cannot render a chat")
        if not messages:
            raise RequestError("messages is empty")
        return self.tokenizer.apply_chat_template(messages, **kwargs)

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[str]:
        """Yields text deltas as they are decoded (never half a character, never part of a stop string)."""
        seq = self._add(prompt, params)
        try:
            while not seq.is_finished:
                self.engine.step()
                delta = self.engine.take_delta(seq)
                if delta:
                    yield delta
            tail = self.engine.take_delta(seq)
            if tail:
                yield tail
        finally:
            self.engine.abort(seq.request_id)
            self.engine.release(seq.request_id)
        self.last_output = RequestOutput.of(seq)


def _merge_settings(args: EngineArgs | None, settings: dict[str, Any]) -> EngineArgs:
    """`args` (default EngineArgs()) with the keyword settings applied; a ConfigError names an unknown one."""
    base = args or EngineArgs()
    if not settings:
        return base
    EngineArgs.from_kwargs(**settings)  # validates the names (replace() would raise a bare TypeError)
    return base.replace(**settings)


def _home(model_dir: Path, args: EngineArgs, seed_bin: bool) -> Path:
    """Where the tokenizer and generation_config are looked for: the model directory; for a .bin file, the directory
    of the tokenizer.json given with it, else the file's own directory."""
    if not seed_bin:
        return model_dir
    given = Path(args.tokenizer) if args.tokenizer else None
    return given.parent if given is not None and given.is_file() else model_dir.parent


def _load_tokenizer(tokenizer: str | Path | None, home: Path, qwen3_vl: bool) -> Any:
    """The tokenizer: `tokenizer` (a directory or a tokenizer.json file) if given, else the one in `home`; None when
    there is none (token-id prompts only). A Qwen3-VL model's tokenizer without a chat template gets orinfer's
    Qwen3-VL template (not other vision-language families: Qwen3.5's format differs, with thinking and XML tool
    calls, and its checkpoints ship their template)."""
    from orinfer.tokenizer import Tokenizer, builtin_chat_template  # local: keeps `import orinfer` light

    tok_file = Path(tokenizer) if tokenizer and Path(tokenizer).is_file() else None
    if tok_file is not None:
        tok = Tokenizer.from_dir(tok_file.parent, tok_file)
    elif tokenizer or (home / "tokenizer.json").is_file():
        tok = Tokenizer.from_dir(tokenizer or home)
    else:
        return None
    if qwen3_vl and tok.set_default_chat_template(builtin_chat_template("qwen3_vl")):
        log.info("%s has no chat template: using orinfer's Qwen3-VL template", home)
    return tok


def _image_processor(model_dir: Path, max_pixels: int | None) -> Any:
    """The model directory's image preprocessing (preprocessor_config.json), with `max_pixels` if given."""
    from orinfer.multimodal import ImageProcessor, ImageProcessorConfig  # PIL and numpy: only for VL models

    config = ImageProcessorConfig.from_dir(model_dir)
    if max_pixels is not None:
        try:
            config = config.with_max_pixels(max_pixels)
        except RequestError as exc:
            raise ConfigError(str(exc)) from None
    return ImageProcessor(config)


def _as_prompt_list(prompts: Prompt | Seq[Prompt]) -> list[Prompt]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    items = list(prompts)
    if not items:
        raise RequestError("no prompts given")
    if all(isinstance(t, int) and not isinstance(t, bool) for t in items):
        return [items]  # one prompt given as token ids
    return items
