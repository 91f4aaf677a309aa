"""The engine loop: requests in, one scheduled step at a time, tokens and text out.

`add_request` validates a request and queues it; `step` runs one scheduler decision (decode rows and prompt chunks,
`scheduler.py`) and returns the sequences that advanced; `abort` drops a request and frees its blocks at once.
Callers (LLM, the server) drive `step` in a loop.

Lookahead (EngineArgs.async_scheduling, see in_flight.py): `step` launches the next step (decode rows, the next
chunks of running prompts and prompts admitted from the queue) before it waits for the current one, so a step is
usually in flight between two calls. Anything that needs the host to know every token first (a preemption,
speculation's drafts) drains it.

Structured outputs (orinfer/structured/): a constrained sequence's mask for its next token depends on its previous
token, which is still on the device when a lookahead step is launched. Such a step is launched in two parts: its
forward is queued at once (a DeferredSample), and its sampler once the host has the previous step's tokens. The host
then does the least it must before queuing that sampler: it gives each constrained row's matcher its new token
(`SequenceConstraint.advance_ahead`), fills the masks on llguidance's thread pool and uploads them; then it queues the
forward of the step after (`queued`, a second step in flight, its sampler deferred in turn), and only then processes
the tokens (stop checks, detokenizing, outputs; the matchers' `accept` finds its token already taken). So the
device runs step N+1's forward while the host builds its masks, and step N+2's forward while the host processes
step N and its caller takes the outputs: at steady state it waits only when the masks take longer than a forward.
A sequence that finishes at step N's token then wastes a row in steps N+1 and N+2 (skipped when they resolve; its
K/V writes go to its own blocks, freed behind them in stream order). The greedy decode graphs leave the argmax of
such steps to the sampler. Unconstrained rows in the batch get the same tokens as alone (their logits are
untouched), and CUDA graphs still replay the forward.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass
from typing import Any, Sequence as Seq

import torch
from torch import nn

from orinfer.args import EngineArgs
from orinfer.config import ModelConfig
from orinfer.engine.block_manager import BlockManager
from orinfer.engine.in_flight import HostSample, InFlightStep
from orinfer.engine.model_runner import ModelRunner, kv_bytes_per_block, kv_cache_dtype
from orinfer.engine.multimodal import prepare_images
from orinfer.engine.prompt_logprobs import prompt_spans, record_prompt_logprobs
from orinfer.engine.scheduler import Scheduler, StepPlan, attention_keys_per_token
from orinfer.engine.sequence import Sequence, TokenLogprob
from orinfer.engine.thinking import ThinkingBudget, ThinkTokens
from orinfer.engine.warmup import warm_mtp_drafts
from orinfer.errors import ConfigError, RequestError
from orinfer.layers.ops import Ops
from orinfer.sampling_params import SamplingParams
from orinfer.spec_decode.chain import ProposalChain
from orinfer.spec_decode.config import SpeculativeConfig
from orinfer.spec_decode.draft_graphs import capture_draft_graphs
from orinfer.spec_decode.draft_model import DraftModelProposer
from orinfer.spec_decode.drafter import mtp_draft_head, use_draft_head
from orinfer.spec_decode.mtp import MTPProposer, attach_mtp_kv, mtp_kv_bytes_per_block
from orinfer.spec_decode.mtp_graphs import capture_mtp_graphs
from orinfer.spec_decode.proposer import make_proposer
from orinfer.structured.constraint import SequenceConstraint
from orinfer.structured.grammar import GrammarCompiler
from orinfer.thinking import THINK_END, THINK_START, ThinkState

log = logging.getLogger(__name__)

# Speculative decoding: tries in a row that do not pay before speculation pauses, and the longest pause in steps
# (`_speculation_paid`).
SPEC_MISSES_BEFORE_PAUSE = 2
MAX_SPEC_PAUSE = 16


@dataclass
class DraftParts:
    """A draft model for speculative decoding (method draft_model): same tokenizer as the target, built like it."""

    model: nn.Module
    model_config: ModelConfig


@dataclass
class EngineParts:
    """Everything the engine runs on, however it was made (a checkpoint, random weights, a test)."""

    model: nn.Module
    model_config: ModelConfig
    tokenizer: Any | None                 # orinfer.tokenizer.Tokenizer, or None for token-id-only use
    generation_config: dict[str, Any]
    device: torch.device
    act_dtype: torch.dtype
    ops: Ops | None = None                # the backend the model was built with (its CUDA-graph hooks); None: eager
    image_processor: Any | None = None    # orinfer.multimodal.ImageProcessor for vision-language models
    draft: DraftParts | None = None       # the draft model of speculative decoding (method draft_model)
    # Tensor parallelism (orinfer/distributed/executor.py): the workers that hold the other shards; `model` then is
    # rank 0's shard, which mirrors its calls to them.
    executor: Any | None = None


class LLMEngine:
    def __init__(self, parts: EngineParts, config: EngineArgs) -> None:
        self.parts, self.config = parts, config
        self.tokenizer = parts.tokenizer
        self.generation_config = parts.generation_config
        mcfg = parts.model_config
        self.max_model_len = min(config.max_model_len or mcfg.max_position_embeddings, mcfg.max_position_embeddings)
        self.eos_token_ids = self._eos_ids()
        self.think_tokens = ThinkTokens.of(self.tokenizer)  # None: the model does not think (no budget applies)
        hooks = parts.ops.graph_hooks if parts.ops is not None else None
        # A draft model's runner follows kv_cache_dtype (it calibrates its own fp8 scales); an MTP head's KV pool
        # stays in the activation dtype (ModelRunner.allocate_extra_kv).
        draft_bytes = 0 if parts.draft is None else kv_bytes_per_block(parts.draft.model_config, config.block_size,
                                                                       kv_cache_dtype(config, parts.act_dtype))
        spec = SpeculativeConfig.parse(config.speculative_config)
        # The drafter's quantization (spec_decode/drafter.py): the drafts' LM head copies, made before the runners
        # plan their memory. A draft model's replaces its head; the MTP proposer's sits beside the target's.
        self.drafter_quantization = spec.quantization if spec is not None else None
        if parts.draft is not None:
            use_draft_head(spec, parts.draft.model)
        mtp_head = mtp_draft_head(spec, parts.model)
        # A tensor-parallel rank's runner sizes its KV cache by its shard's heads.
        runner_cfg = mcfg if parts.executor is None else parts.executor.shard.config
        if spec is not None and spec.method == "mtp":  # the MTP head's KV pool, on the target's block ids
            draft_bytes = mtp_kv_bytes_per_block(parts.model, runner_cfg, config, parts.act_dtype)
        self.runner = ModelRunner(parts.model, runner_cfg, config, parts.device, parts.act_dtype, self.max_model_len,
                                  graph_hooks=hooks, vision_warmup_patches=self._largest_image_patches(),
                                  extra_bytes_per_block=draft_bytes)
        if parts.executor is not None:
            parts.executor.attach(self.runner)
        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching,
                                          num_state_slots=self.runner.state.num_slots,
                                          num_state_snapshots=self.runner.state.num_snapshots)
        self.draft = None  # the draft-model proposer: the draft's runner, its KV pool on the target's block ids
        if parts.draft is not None:
            draft_runner = ModelRunner(parts.draft.model, parts.draft.model_config,
                                       config.replace(num_kv_blocks=self.runner.num_blocks), parts.device,
                                       parts.act_dtype, self.max_model_len, graph_hooks=hooks)
            self.draft = DraftModelProposer(draft_runner, self.block_manager, 1, config.max_num_batched_tokens)
            if spec is not None and spec.method == "draft_model":  # (the draft runs whole on rank 0, even under TP)
                self.draft.graphs = capture_draft_graphs(draft_runner, spec.num_speculative_tokens, spec.max_batch)
        self.mtp = None  # the MTP proposer: the target's MTP head, its KV pool on the target's block ids
        if spec is not None and spec.method == "mtp":
            attach_mtp_kv(self.runner, parts.model)
            self.mtp = MTPProposer(self.runner, self.block_manager, spec.num_speculative_tokens, spec.max_batch,
                                   head=mtp_head)
            if mtp_head is not None and parts.device.type == "cuda":
                warm_mtp_drafts(self.runner, mtp_head)
            if parts.executor is None:  # (tensor parallelism: proposals stay eager, spec_decode/mtp_graphs.py)
                self.mtp.graphs = capture_mtp_graphs(self.runner, spec.num_speculative_tokens, spec.max_batch,
                                                     self.mtp.logits)
        self.scheduler = Scheduler(config, self.block_manager, attention_keys_per_token(mcfg))
        self.sequences: dict[str, Sequence] = {}
        self.lookahead = config.async_scheduling
        # With lookahead, a verify step's next proposal is queued behind it (spec_decode/chain.py).
        self.chain = ProposalChain(self.block_manager, self.max_model_len, config.max_num_batched_tokens)
        self.device_proposal = None  # the drafts the step being launched verifies, when they are on the device
        self.spec: SpeculativeConfig | None = None
        self.proposer = None
        self.set_speculation(SpeculativeConfig.parse(config.speculative_config))
        self.in_flight: InFlightStep | None = None  # a launched step not yet processed (lookahead)
        # A step launched behind `in_flight` whose sampler waits for in_flight's tokens (structured outputs: see the
        # module docstring); the next `step` samples it first.
        self.queued: InFlightStep | None = None
        self.num_lookahead_steps = 0                 # steps launched behind one still in flight
        self.num_queued_steps = 0                    # of those, launched before the previous tokens were processed
        self._request_ids = itertools.count()
        self._grammars: GrammarCompiler | None = None  # made at the first constrained request (tokenizer setup)
        # Whether image sources may be local paths / file:// URLs (a server serving remote clients turns this off).
        self.allow_local_files = True

    def _largest_image_patches(self) -> int:
        """Patches of an image at the preprocessor's max_pixels (0 for text models): the GPU memory probe's image."""
        proc = self.parts.image_processor
        if proc is None or not self.parts.model_config.is_multimodal:
            return 0
        return proc.config.max_pixels // (proc.config.patch_size ** 2)

    def _eos_ids(self) -> set[int]:
        ids: set[int] = set(self.parts.model_config.eos_token_id)
        gen_eos = self.generation_config.get("eos_token_id")
        if gen_eos is not None:
            ids.update([gen_eos] if isinstance(gen_eos, int) else gen_eos)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    # --- requests ---------------------------------------------------------------------------------------------------

    def add_request(self, prompt: str | Seq[int], params: SamplingParams | None = None,
                    request_id: str | None = None, *, images: Seq[Any] | None = None,
                    max_pixels: int | None = None, arrival_time: float | None = None) -> Sequence:
        """Validates and queues one request; raises RequestError with the reason when it cannot be served.

        `images` (vision-language models): one source per <|image_pad|> placeholder of the prompt, in order -
        a path, data: URL, bytes or PIL image. Each placeholder is expanded to the image's visual tokens before the
        length checks. `max_pixels` caps the resized image size for this request (default: preprocessor config).
        `arrival_time` (time.perf_counter's clock): when the request arrived, if before this call (a server's
        handler); its latency metrics count from there.
        """
        params = (params or SamplingParams()).with_defaults(self.generation_config)
        if not self.has_unfinished():
            # An idle engine starts speculating afresh: a seeded request then repeats its output (its draws follow
            # which steps verify drafts).
            self._spec_misses = self._spec_pause = 0
        text, ids = self._encode(prompt)
        if not ids:
            raise RequestError("the prompt is empty")
        vocab = self.parts.model_config.vocab_size
        if params.logit_bias and max(params.logit_bias) >= vocab:
            raise RequestError(f"logit_bias: token id {max(params.logit_bias)} is outside the vocabulary "
                               f"(0..{vocab - 1})")
        mm = None
        mcfg = self.parts.model_config
        if mcfg.is_multimodal:
            ids, mm = prepare_images(ids, list(images or ()), self.parts.image_processor, mcfg,
                                     max_pixels=max_pixels, allow_local_files=self.allow_local_files)
        elif images:
            raise RequestError(f"this model ({mcfg.architecture}) takes no images")
        if len(ids) >= self.max_model_len:
            raise RequestError(f"the prompt has {len(ids)} tokens; the context length is {self.max_model_len}, "
                               "which leaves no room to generate")
        room = self.max_model_len - len(ids)
        if params.max_tokens is None:
            params.max_tokens = room
        elif params.max_tokens > room:
            raise RequestError(f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the context "
                               f"length of {self.max_model_len} tokens")
        capacity = self.block_manager.num_blocks * self.config.block_size
        if len(ids) + params.max_tokens > capacity:
            raise RequestError(f"prompt + max_tokens ({len(ids) + params.max_tokens} tokens) exceeds the KV cache "
                               f"({capacity} tokens)")
        request_id = request_id or str(next(self._request_ids))
        if request_id in self.sequences:
            raise RequestError(f"request id {request_id!r} is already in use")
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.parts.device).manual_seed(params.seed)
        constraint = self._constraint(params) if params.structured_outputs is not None else None
        seq = Sequence(request_id, ids, params, prompt=text, generator=generator, mm=mm)
        if arrival_time is not None:
            seq.arrival_time = arrival_time
        seq.constraint = constraint
        if self.tokenizer is not None:
            seq.detokenizer = self.tokenizer.new_detokenizer(ids, skip_special_tokens=params.skip_special_tokens)
        self._start_thinking_budget(seq)
        self.sequences[request_id] = seq
        self.scheduler.add(seq)
        return seq

    def _start_thinking_budget(self, seq: Sequence) -> None:
        """Gives `seq` its thinking budget (the request's, else EngineArgs'). A prompt that already opened the
        reasoning with a budget of 0 gets the closing tokens at once, keeping one token of max_tokens to sample (a
        sequence cannot end before its first step: one that a stop string ends there ends at that token)."""
        params = seq.params
        if params.thinking_token_budget is None:
            params.thinking_token_budget = self.config.thinking_token_budget if self.think_tokens else None
        elif self.think_tokens is None:
            raise RequestError("thinking_token_budget: this model has no <think> and </think> tokens")
        if params.thinking_token_budget is None:
            return
        seq.thinking = ThinkingBudget(self.think_tokens, params.thinking_token_budget, seq.token_ids)
        if seq.thinking.exhausted:
            seq.thinking.stop_in_closing = self._close_thinking(seq, at_admission=True) == "stop_str"

    def _close_thinking(self, seq: Sequence, at_admission: bool = False) -> str | None:
        """Appends the reasoning's closing tokens to `seq` (engine/thinking.py), as far as max_tokens and the context
        allow (at admission: one token less); returns the finish reason they cause ("stop_str", "length"), else
        None."""
        budget = seq.thinking
        budget.closed()
        room = min(seq.params.max_tokens - seq.num_completion_tokens, self.max_model_len - len(seq.token_ids))
        closing = budget.tokens.closing[:max(0, room - at_admission)]
        for token in closing:
            seq.append_token(token)
            if seq.constraint is not None and seq.constraint.think_state is not ThinkState.CONTENT:
                seq.constraint.accept(token)  # up to </think>: the grammar starts with the answer, after it
            if seq.detokenizer is not None:
                before = len(seq.output_text)
                seq.output_text += seq.detokenizer.push(token)
                if seq.params.stop and self._apply_stop_strings(seq, before):
                    return "stop_str"
        if len(closing) < len(budget.tokens.closing) or seq.num_completion_tokens >= seq.params.max_tokens:
            return "length"
        return None

    @property
    def grammars(self) -> GrammarCompiler:
        """The structured-output compiler of this engine's tokenizer (RequestError without a tokenizer)."""
        if self._grammars is None:
            if self.tokenizer is None:
                raise RequestError("structured_outputs needs a tokenizer; this engine has none")
            self._grammars = GrammarCompiler(self.tokenizer.to_json(), self.parts.model_config.vocab_size,
                                             sorted(self.eos_token_ids))
        return self._grammars

    def _constraint(self, params: SamplingParams) -> SequenceConstraint:
        matcher, release = self.grammars.lease(params.structured_outputs)
        state = ThinkState(params.think_state) if params.think_state is not None else ThinkState.CONTENT
        return SequenceConstraint(matcher, state, self.tokenizer.token_to_id(THINK_START),
                                  self.tokenizer.token_to_id(THINK_END), release=release)

    def _encode(self, prompt: str | Seq[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("this engine has no tokenizer: pass token ids")
            return prompt, self.tokenizer.encode(prompt)
        try:
            ids = [int(t) for t in prompt]
        except (TypeError, ValueError):
            raise RequestError("a prompt must be a string or a list of token ids") from None
        vocab = self.parts.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
        return None, ids

    def close(self) -> None:
        """Stops the tensor-parallel workers, if any (the engine cannot step afterwards)."""
        if self.parts.executor is not None:
            self.parts.executor.shutdown()

    def abort(self, request_id: str) -> None:
        """Stops a request now and frees its KV blocks (unknown or finished ids are ignored)."""
        seq = self.sequences.pop(request_id, None)
        if seq is not None and not seq.is_finished:
            seq.finish_reason = "abort"
            seq.finish_time = time.perf_counter()
            seq.constraint = None
            self.scheduler.finish(seq)

    def release(self, request_id: str) -> None:
        """Forgets a finished request (its output was taken)."""
        self.sequences.pop(request_id, None)

    def has_unfinished(self) -> bool:
        # A step in flight counts even if all its sequences were aborted: one more step() collects it.
        return self.scheduler.has_unfinished() or self.in_flight is not None or self.queued is not None

    # --- the loop ---------------------------------------------------------------------------------------------------

    def step(self) -> list[Sequence]:
        """Processes one step; returns the sequences that got a token (finished ones included).

        The step is the one left in flight by the previous call, if any, else a newly scheduled one. Before waiting
        for its tokens, the next decode step is launched behind it when that is safe (`_launch_lookahead`). A step
        that only ran prompt chunks returns no sequence. Tensor parallelism: a collective that failed because a
        worker died raises WorkerDiedError."""
        if self.parts.executor is None:
            return self._step()
        try:
            return self._step()
        except RuntimeError as exc:
            self.parts.executor.explain(exc)
            raise

    def _step(self) -> list[Sequence]:
        if self._spec_pause:
            self._spec_pause -= 1
        current = self.in_flight
        if current is None:
            self._propose_drafts()
            plan = self.scheduler.schedule()
            if not plan:
                return []
            current = self.in_flight = self._launch(plan)
            # (Not after a try that did not pay: drafts the target keeps rejecting would waste each queued proposal.)
            if self.lookahead and current.verifies and not self._spec_misses:
                self.chain.queue(self.proposer, self.device_proposal, current, bool(self.scheduler.waiting))
        self._finish_sampling(current)  # (only if a failure left it unsampled: it was launched as a lookahead)
        nxt, self.queued = self.queued, None
        if nxt is None:
            nxt = self._launch_lookahead(current)
        # (in_flight is replaced only once the next step is launched: if launching raises, `current` stays there
        # for the next call to collect, so no sequence keeps a pending token that nothing will resolve.)
        self.in_flight = nxt
        try:
            if nxt is not None and nxt.deferred is not None:
                self._sample_ahead(current, nxt)
            return self._resolve(current)
        finally:
            if nxt is not None and nxt.deferred is not None:
                self._finish_sampling(nxt)  # (only if the above raised before sampling it)

    def _sample_ahead(self, current: InFlightStep, nxt: InFlightStep) -> None:
        """`nxt` was launched behind `current` with its sampler deferred (constrained rows): as soon as current's
        tokens are on the host, the matchers of nxt's constrained rows take them, nxt's sampler is queued with their
        masks, and the step after nxt is launched (`queued`), all before current's tokens are processed, so that the
        device has the next forward while the host works (module docstring)."""
        sample = current.wait()
        row_of = {id(seq): i for i, seq in enumerate(current.seqs)}
        for seq in nxt.deferred.seqs:
            row = row_of.get(id(seq))
            # (no row: its first token comes from nxt, a prompt that ended there; finished: constraint is None)
            if seq.constraint is not None and row is not None:
                seq.constraint.advance_ahead(sample.token_ids[row])
        self._finish_sampling(nxt)
        self.queued = self._launch_lookahead(nxt, older=current)
        self.num_queued_steps += self.queued is not None

    def _finish_sampling(self, step: InFlightStep) -> None:
        if step.deferred is not None:
            step.sampled(self.runner.finish_sampling(step.deferred))

    def _launch(self, plan: StepPlan, after: InFlightStep | None = None, rows: list[int] | None = None,
                older: InFlightStep | None = None) -> InFlightStep:
        """Queues a step on the device: each sequence's planned tokens count as computed, and each that samples gets
        a pending token. `after`/`rows`: lookahead inputs; `older`: the step before `after`, still unprocessed (its
        tokens are pending too, for the penalties)."""
        start = time.perf_counter()
        for seq in plan.seqs:
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = start
        prev_ids = after.device_ids if after is not None else None
        sampled = plan.sampled
        prompt_seqs = [seq for seq in plan.seqs if not seq.is_decoding]
        self._restore_snapshots(plan)
        spans = prompt_spans(plan)
        older_pending = self._older_pending(plan, len(rows), older) if older is not None and rows else None
        out = self.runner.execute(plan, prev_ids, rows, spans, older_pending)
        for seq, num_new in zip(plan.seqs, plan.num_new_tokens):
            seq.num_computed_tokens += num_new
        self._save_snapshots(plan)
        for seq in sampled:
            seq.num_pending += 1
        step = InFlightStep(sampled, prompt_seqs, start, out, spans)  # (queues the copies of its samples to the host)
        self.runner.after_sampled()
        return step

    def _restore_snapshots(self, plan: StepPlan) -> None:
        """Hybrid models: a sequence admitted on a prefix-cache hit resumes the state saved where the hit ends (copied
        into its slot ahead of the step, in stream order)."""
        for seq in plan.seqs:
            if seq.restore_snapshot >= 0:
                self.runner.state.restore(seq.restore_snapshot, seq.state_slot)
                seq.restore_snapshot = -1

    def _save_snapshots(self, plan: StepPlan) -> None:
        """Hybrid models: the state of a prompt that this step brought to its snapshot point is copied out (behind
        the step, in stream order) for later prompts that start with the same tokens."""
        if not self.block_manager.takes_snapshots:
            return
        for seq in plan.seqs:
            if seq.num_computed_tokens == self.block_manager.snapshot_point(seq) > 0:
                snapshot = self.block_manager.save_snapshot(seq)
                if snapshot is not None:
                    self.runner.state.save(seq.state_slot, snapshot)

    def _older_pending(self, plan: StepPlan, num_rows: int, older: InFlightStep
                       ) -> tuple[torch.Tensor, list[int]] | None:
        """For the first `num_rows` (decode) rows of `plan`: `older`'s sampled ids on the device and each row's index
        in them (len(ids) where `older` samples none for its sequence: a prompt that ended in the step after it),
        the pending tokens the penalties must count besides the previous step's; None when no row has a penalty."""
        seqs = plan.seqs[:num_rows]
        if not any(s.params.repetition_penalty != 1.0 or s.params.presence_penalty != 0
                   or s.params.frequency_penalty != 0 for s in seqs):
            return None
        row_of = {id(seq): i for i, seq in enumerate(older.seqs)}
        return older.device_ids, [row_of.get(id(seq), len(older.seqs)) for seq in seqs]

    def _launch_lookahead(self, current: InFlightStep, older: InFlightStep | None = None) -> InFlightStep | None:
        """The next step, launched while `current` is in flight: decode rows for the running sequences whose tokens
        it samples (their input ids are its samples, on the device), the next chunks of running prompts and waiting
        prompts admitted (`Scheduler.plan_lookahead`); None (drain) when the plain next step could differ: a
        preemption. (Penalties read the pending tokens on the device: `ModelRunner.sampling_batch`.) `older`: the
        step before `current` when it is still unprocessed (`_sample_ahead`)."""
        if not self.lookahead or current.verifies or self._speculates():
            return None  # (speculation: the next step's drafts need every token on the host)
        # A sequence whose pending token is certainly its last (length) stays out: no wasted row, and the batch is
        # then what the plain step would run. One that stops on a token or string may still be in it: its extra
        # row is skipped at resolve (its KV write goes to its own, freed blocks; later users are queued behind it).
        # So does one whose pending token may bring its reasoning to its thinking budget: the host closes the
        # reasoning after that token, before anything samples past it.
        batch = [seq for seq in self.scheduler.running
                 if seq.num_uncomputed_tokens == 1 and not self._ends_by_length(seq)
                 and not (seq.thinking is not None and seq.thinking.may_exhaust_with(seq.num_pending))]
        rows = current.rows_of(batch)
        if rows is None:
            return None
        plan = self.scheduler.plan_lookahead(batch)
        if plan is None:
            return None
        self.num_lookahead_steps += 1
        return self._launch(plan, current, rows, older)

    # --- speculative decoding ---------------------------------------------------------------------------------------

    def set_speculation(self, spec: SpeculativeConfig | None) -> None:
        """Turns speculative decoding on with `spec`, or off (None), from the next step on (the benchmark compares
        settings on one engine)."""
        if spec is not None and self.parts.model_config.is_hybrid:
            self._check_rollback(spec)
        if spec is not None and spec.method != "ngram" and spec.quantization != self.drafter_quantization:
            raise ConfigError(f"speculative_config: quantization {spec.quantization!r} differs from the "
                              f"{self.drafter_quantization!r} the engine was created with (the drafter's weights are "
                              "made then)")
        self.spec = spec
        self.proposer = make_proposer(spec, self.draft, self.mtp) if spec is not None else None
        self.chain.drop()
        self._spec_misses = self._spec_pause = 0  # tries in a row that did not pay; steps until the next try
        self.runner.forced_acceptance = spec.forced_acceptance if spec is not None else None
        self.runner.num_speculative_tokens = spec.num_speculative_tokens if spec is not None else 0
        if self.runner.forced_acceptance is not None:
            log.warning("speculative decoding with forced acceptance %.2f: drafts are accepted at random, the output "
                        "is meaningless (benchmarks only)", self.runner.forced_acceptance)

    def _check_rollback(self, spec: SpeculativeConfig) -> None:
        """Hybrid models roll their linear-attention state back past rejected drafts with resources sized at engine
        start (engine/state_rollback.py): `spec` must fit them."""
        rollback = self.runner.rollback
        if rollback is None:
            raise ConfigError("a hybrid model (Qwen3.5 family) speculates only when its engine is created with "
                              "speculative_config: the state rollback's slots are sized then")
        if spec.max_batch > rollback.max_seqs or spec.num_speculative_tokens > rollback.max_drafts:
            raise ConfigError(f"speculative_config: max_batch {spec.max_batch} and num_speculative_tokens "
                              f"{spec.num_speculative_tokens} exceed what the engine was created for "
                              f"({rollback.max_seqs}, {rollback.max_drafts})")

    def _decoders(self) -> list[Sequence]:
        return [seq for seq in self.scheduler.running if seq.num_uncomputed_tokens == 1]

    def _speculates(self) -> bool:
        """Whether the next step would verify drafts: speculation is on, not paused after proposals that found
        nothing, and few enough sequences decode (past SpeculativeConfig.max_batch verifying costs more than it saves).
        Otherwise steps keep the lookahead."""
        return (self.proposer is not None and self._spec_pause == 0
                and 0 < len(self._decoders()) <= self.spec.max_batch)

    def _propose_drafts(self) -> None:
        """Gives each decoding sequence that may speculate its draft tokens for the next step: at most k, no more than
        max_tokens and the context leave room for after the token the step samples, within the step budget.
        A sequence under a grammar speculates while its output is in the answer: drafts the grammar would refuse are
        cut off (`SequenceConstraint.valid_drafts`), and the verify step masks each row with the grammar's state
        after the drafts before it. One under a thinking budget drafts no further than the token that could reach
        its budget (`ThinkingBudget.draft_room`): the host writes `</think>` right after that one."""
        self.runner.device_drafts = self.device_proposal = None  # (an earlier proposal's, if never verified)
        chained = self.chain.release()  # the proposal queued behind the last verify step, if any
        if not self._speculates():
            return
        decoders = self._decoders()
        budget = self.config.max_num_batched_tokens - len(decoders)
        eligible, rooms = [], []
        for seq in decoders:
            if (seq.constraint is not None and not seq.constraint.speculates) or seq.num_pending:
                continue
            room = min(self.spec.num_speculative_tokens, budget,
                       seq.params.max_tokens - seq.num_completion_tokens - 1,
                       self.max_model_len - len(seq.token_ids) - 1,
                       seq.thinking.draft_room() if seq.thinking is not None else budget)
            if room > 0:
                eligible.append(seq)
                rooms.append(room)
                budget -= room
        if eligible and self._drafts_stay_on_device():
            proposal = (self.chain.adopt(self.proposer, chained, eligible, rooms)
                        or self.proposer.propose_on_device(eligible, rooms))
            for seq in proposal.seqs:
                seq.draft_token_ids = [0] * proposal.k  # stand-ins: the verify step reads the ids on the device
            self.runner.device_drafts = self.device_proposal = proposal if proposal.seqs else None
        elif eligible:
            for seq, draft in zip(eligible, self.proposer.propose_batch(eligible, rooms)):
                seq.draft_token_ids = draft if seq.constraint is None else seq.constraint.valid_drafts(draft)
        self.proposer.keep_only(self.scheduler.running)
        if not any(seq.draft_token_ids for seq in decoders):
            self._speculation_paid(False)

    def _drafts_stay_on_device(self) -> bool:
        """Whether this proposal's drafts may stay on the device until the verify step reads them there (the host
        then launches that step without waiting for the proposal): a proposer that makes them there (draft model,
        MTP), one process (tensor parallelism's workers take every input from the host), and no running sequence
        whose verify rows read draft ids on the host: a grammar (its matcher cuts and masks the drafts) or a
        repetition, presence or frequency penalty (the drafts join the counted history)."""
        if not hasattr(self.proposer, "propose_on_device") or self.parts.executor is not None:
            return False
        return not any(seq.constraint is not None or seq.params.repetition_penalty != 1.0
                       or seq.params.presence_penalty != 0 or seq.params.frequency_penalty != 0
                       for seq in self.scheduler.running)

    def _speculation_paid(self, paid: bool) -> None:
        """Records whether a try at speculating paid: drafts were found and some were accepted. A try that does not
        pay costs a step (a verify step, or one without lookahead), so after SPEC_MISSES_BEFORE_PAUSE such tries in a
        row the next ones wait 1, 2, 4 ... up to MAX_SPEC_PAUSE steps, which run as plain steps with lookahead (an
        n-gram lookup that matches nothing, a draft model that the target keeps contradicting)."""
        if paid:
            self._spec_misses = 0
            return
        self._spec_misses += 1
        if self._spec_misses >= SPEC_MISSES_BEFORE_PAUSE:
            self._spec_pause = min(2 ** (self._spec_misses - SPEC_MISSES_BEFORE_PAUSE), MAX_SPEC_PAUSE)

    def _ends_by_length(self, seq: Sequence) -> bool:
        """Whether the sequence's tokens so far, pending ones included, reach max_tokens or the context length."""
        return seq.num_tokens - seq.num_prompt_tokens >= seq.params.max_tokens or seq.num_tokens >= self.max_model_len

    def _resolve(self, step: InFlightStep) -> list[Sequence]:
        """Waits for a step's tokens and processes them; sequences that finished or were aborted since its launch
        are skipped. Timings are read after the wait: they cover the device work."""
        sample = step.wait()
        now = time.perf_counter()
        for seq in step.prompt_seqs:
            seq.prefill_seconds += now - max(step.start, seq.prefill_counted_until)
            seq.prefill_counted_until = now
        if step.spans:
            record_prompt_logprobs(step.spans, sample.prompt_logprobs, sample.prompt_top_logprobs,
                                   sample.prompt_top_ids)
        live = [(i, seq) for i, seq in enumerate(step.seqs) if not seq.is_finished]
        self._process(live, sample, now)
        return [seq for _, seq in live]

    def _process(self, live: list[tuple[int, Sequence]], sample: HostSample, now: float) -> None:
        """Row i of `sample` holds the token(s) of the sequence paired with i (a verify step: its accepted drafts and
        the token after them, taken in order until one ends the sequence)."""
        for i, seq in live:
            tokens = sample.tokens_of(i)
            drafted = len(seq.draft_token_ids)  # (a sequence that finishes below drops its drafts)
            known = len(seq.token_ids)  # (the host may append more than the step's tokens: a closed reasoning)
            if seq.first_token_time is None:
                seq.first_token_time = now
            for position, token in enumerate(tokens):
                if position == 0:
                    seq.resolve_pending(token)
                else:
                    seq.append_token(token)
                if self._process_token(seq, token, sample, i, position, now):
                    break
            if sample.num_accepted is not None:
                self._end_verify(seq, drafted, sample.num_accepted[i], known)
        if sample.num_accepted is not None and self.spec is not None:
            self._speculation_paid(any(sample.num_accepted[i] for i, _ in live))

    def _end_verify(self, seq: Sequence, drafted: int, num_accepted: int, known: int) -> None:
        """After a verify step: the K/V of the rejected drafts is dropped (the next step overwrites it), and so are
        the blocks that only they used; the acceptance counts grow. `known`: the sequence's known tokens before the
        step's; the step computed the newest of them and the accepted drafts (not the tokens the host may have
        appended after the step's, a reasoning's closing text, which the next steps compute)."""
        seq.draft_token_ids = []
        if drafted:
            seq.num_draft_tokens += drafted
            seq.num_accepted_tokens += num_accepted
            seq.num_verify_steps += 1
        if not seq.is_finished:
            seq.num_computed_tokens = known + num_accepted
            seq.num_draft_computed = min(seq.num_draft_computed, seq.num_computed_tokens)
            self.block_manager.trim(seq, self.chain.spare_tokens(seq))

    def _process_token(self, seq: Sequence, token: int, sample: HostSample, row: int, position: int,
                       now: float) -> bool:
        """Records one new token of `seq` (its log-probabilities, stop checks, thinking budget); True when it ends the
        sequence."""
        if sample.logprobs is not None and seq.params.logprobs is not None:
            k = seq.params.logprobs
            logprob, top_ids, top_logprobs = sample.logprobs[row], sample.top_ids, sample.top_logprobs
            if sample.num_accepted is not None:  # per emitted token
                logprob = logprob[position]
                top_ids = top_ids and top_ids[row][position]
                top_logprobs = top_logprobs and top_logprobs[row][position]
            elif top_ids is not None:
                top_ids, top_logprobs = top_ids[row], top_logprobs[row]
            top = list(zip(top_ids[:k], top_logprobs[:k])) if top_ids is not None else []
            seq.logprobs.append(TokenLogprob(token, logprob, top))
        if seq.thinking is not None and seq.thinking.stop_in_closing:
            reason = "stop_str"  # the text already ends at the stop string (`_start_thinking_budget`)
        else:
            reason = self._stop_reason(seq, token)
            if reason is None and seq.constraint is not None and self._constraint_done(seq, token):
                reason = "stop"
            if reason is None and seq.thinking is not None:
                reason = self._count_thinking(seq, token)
        if reason is None:
            return False
        seq.constraint = None
        seq.finish_reason = reason
        seq.finish_time = now
        if seq.detokenizer is not None and reason != "stop_str":
            seq.output_text += seq.detokenizer.flush()
        if reason == "stop_str":
            seq.finish_reason = "stop"
        self.scheduler.finish(seq)
        return True

    def _count_thinking(self, seq: Sequence, token: int) -> str | None:
        """Counts a token against the sequence's thinking budget; at the budget, closes the reasoning (the closing
        tokens then run as a chunk: `Scheduler.extend`). Returns a finish reason the closing tokens cause."""
        budget = seq.thinking
        budget.observe(token, lambda: not seq.output_text.strip())
        if not budget.exhausted:
            return None
        reason = self._close_thinking(seq)
        if reason is None:
            self.scheduler.extend(seq)
        return reason

    @staticmethod
    def _constraint_done(seq: Sequence, token: int) -> bool:
        """Advances the sequence's matcher; True when the grammar is complete (nothing but EOS could follow) or,
        which sampling under its mask rules out, refused the token."""
        if not seq.constraint.accept(token):
            return True
        return seq.constraint.is_complete

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        generated = seq.num_completion_tokens
        stop_id = (not p.ignore_eos and token in self.eos_token_ids) or token in p.stop_token_ids
        if stop_id and generated >= p.min_tokens:
            return "stop"
        if seq.detokenizer is not None:
            before = len(seq.output_text)
            seq.output_text += seq.detokenizer.push(token)
            if p.stop and self._apply_stop_strings(seq, before):
                return "stop_str"
        if generated >= p.max_tokens or len(seq.token_ids) >= self.max_model_len:  # known tokens: not pending ones
            return "length"
        return None

    @staticmethod
    def _apply_stop_strings(seq: Sequence, before: int) -> bool:
        """Truncates output_text at the first stop string that the newest text completed."""
        longest = max(len(s) for s in seq.params.stop)
        search_from = max(0, before - longest + 1)
        hits = [(seq.output_text.find(s, search_from), s) for s in seq.params.stop]
        hits = [(pos, s) for pos, s in hits if pos >= 0]
        if not hits:
            return False
        pos, stop = min(hits)
        end = pos + len(stop) if seq.params.include_stop_str_in_output else pos
        seq.output_text = seq.output_text[:end]
        return True

    def take_delta(self, seq: Sequence) -> str:
        """New text of a sequence since the last call, holding back a tail that could start a stop string."""
        end = len(seq.output_text)
        if not seq.is_finished and seq.params.stop:
            end -= max(len(s) for s in seq.params.stop) - 1
        if end <= seq.emitted_chars:
            return ""
        delta = seq.output_text[seq.emitted_chars:end]
        seq.emitted_chars = end
        return delta
