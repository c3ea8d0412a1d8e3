"""Engine outputs (token ids) -> RequestOutput: incremental detokenization at O(1) per token,
stop strings (which finish a sample here and abort it in the core), logprobs, and gathering
the n samples of a request."""

from __future__ import annotations

import time

from matrixinfer.engine.messages import EngineCoreOutput
from matrixinfer.engine.request import Logprob
from matrixinfer.engine.sampling_params import RequestOutputKind, SamplingParams
from matrixinfer.frontend.outputs import CompletionOutput, RequestOutput
from matrixinfer.frontend.processor import child_id
from matrixinfer.tokenizer import Tokenizer


class SampleState:
    def __init__(self, index: int, params: SamplingParams, tokenizer: Tokenizer | None):
        self.index, self.params = index, params
        self.token_ids: list[int] = []
        self.text = ""
        self.logprobs: list[Logprob] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob = 0.0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.decoder = tokenizer.decode_stream(params.skip_special_tokens) if tokenizer is not None else None
        self.max_stop_len = max((len(s) for s in params.stop_list), default=0)

    def add(self, out: EngineCoreOutput) -> bool:
        """Take one engine output; True when a stop string ended this sample here."""
        for i, tok in enumerate(out.new_token_ids):
            self.token_ids.append(tok)
            if self.logprobs is not None and out.new_logprobs:
                self.logprobs.append(out.new_logprobs[i])
                self.cumulative_logprob += out.new_logprobs[i].logprob
            if self.decoder is not None:
                delta = self.decoder.step(tok)
                if delta:
                    self.text += delta
                    if self.max_stop_len and len(self.token_ids) >= self.params.min_tokens and self._stop_string(len(delta)):
                        return True
        if out.finish_reason is not None and self.finish_reason is None:
            self.finish_reason, self.stop_reason = out.finish_reason, out.stop_reason
        return False

    def _stop_string(self, delta_len: int) -> bool:
        # only the tail can hold a new match: the delta plus a stop string's length before it
        start = max(0, len(self.text) - delta_len - self.max_stop_len + 1)
        for stop in self.params.stop_list:
            at = self.text.find(stop, start)
            if at != -1:
                self.text = self.text[: at + len(stop)] if self.params.include_stop_str_in_output else self.text[:at]
                self.finish_reason, self.stop_reason = "stop", stop
                return True
        return False

    def output(self) -> CompletionOutput:
        return CompletionOutput(self.index, self.text, list(self.token_ids),
                                self.cumulative_logprob if self.logprobs is not None else None,
                                list(self.logprobs) if self.logprobs is not None else None,
                                self.finish_reason, self.stop_reason)


class RequestState:
    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                 tokenizer: Tokenizer | None, arrival_time: float):
        self.request_id, self.prompt, self.prompt_token_ids = request_id, prompt, prompt_token_ids
        self.samples = [SampleState(i, params, tokenizer) for i in range(params.n)]
        self.children = {child_id(request_id, i, params.n): s for i, s in enumerate(self.samples)}
        self.arrival_time, self.first_token_time = arrival_time, None
        self.num_cached_tokens, self.num_preemptions = 0, 0
        self.prompt_logprobs = None
        self.final_only = params.output_kind is RequestOutputKind.FINAL_ONLY

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)

    def output(self) -> RequestOutput:
        metrics = {"arrival_time": self.arrival_time, "first_token_time": self.first_token_time,
                   "num_preemptions": self.num_preemptions}
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, [s.output() for s in self.samples],
                             self.finished, self.num_cached_tokens, metrics, self.prompt_logprobs)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None):
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}
        self._parent: dict[str, RequestState] = {}  # engine (child) request id -> its request

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                    arrival_time: float) -> RequestState:
        state = RequestState(request_id, prompt, prompt_token_ids, params, self.tokenizer, arrival_time)
        self.requests[request_id] = state
        for cid in state.children:
            self._parent[cid] = state
        return state

    def child_ids(self, request_id: str) -> list[str]:
        state = self.requests.get(request_id)
        return [cid for cid, s in state.children.items() if s.finish_reason is None] if state else []

    def streamed_tokens(self, child_id: str) -> list[int] | None:
        """Token ids of one sample so far (None: its request is gone)."""
        state = self._parent.get(child_id)
        return None if state is None else list(state.children[child_id].token_ids)

    def remove(self, request_id: str) -> None:
        state = self.requests.pop(request_id, None)
        for cid in state.children if state else []:
            self._parent.pop(cid, None)

    def process(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """-> (outputs of requests that changed, engine request ids to abort (stop strings))."""
        changed: dict[str, RequestState] = {}
        to_abort: list[str] = []
        now = time.monotonic()
        for out in outputs:
            state = self._parent.get(out.request_id)
            if state is None:
                continue
            sample = state.children[out.request_id]
            if sample.finish_reason is not None:
                continue
            if out.new_token_ids and state.first_token_time is None:
                state.first_token_time = now
            state.num_cached_tokens = max(state.num_cached_tokens, out.num_cached_tokens)
            state.num_preemptions = max(state.num_preemptions, out.num_preemptions)
            if out.prompt_logprobs is not None and state.prompt_logprobs is None:  # the first of n samples to send them
                state.prompt_logprobs = out.prompt_logprobs.as_vllm(state.prompt_token_ids)
            if sample.add(out):
                to_abort.append(out.request_id)
            changed[state.request_id] = state
        results = []
        for state in changed.values():
            finished = state.finished
            if finished or not state.final_only:
                results.append(state.output())
            if finished:
                self.remove(state.request_id)
        return results, to_abort
