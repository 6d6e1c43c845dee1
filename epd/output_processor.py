"""One sequence's engine outputs turned into what its caller reads: `OutputProcessor`.

The offline `LLM` (epd/llm.py) and the server's `AttemptStream`
(epd/serve/attempt_stream.py) both hand it each engine output of a sequence
(its new token ids, their logprobs, the engine's finish reason) and read
back the same thing, as vLLM's one output processor serves its `LLM` and
its server:

    text          incremental detokenization: stable chunks only    epd/detokenizer.py
    stop strings  matched on the text; characters that may begin one are held back;
                  include_stop_str_in_output; no token after the one a stop ends in
    logprobs      one entry per token taken, cut where the text stops; the prompt's
                  from the first output that carries them
    finish        "stop" once a stop string matched, else the engine's reason;
                  stop_reason as vLLM's (the stop string, or a stop token that is not EOS)

What is only one caller's stays with it: outputs put in order over two
workers, coalescing, retries and the Delta for HTTP (AttemptStream); the
RequestOutput of a batch and aborting a sequence its stop string ended (LLM).
Importing this module loads no torch.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from epd.detokenizer import IncrementalDetokenizer
from epd.transport.wire.sampling import SamplingParams, TokenLogprobs


@dataclass
class OutputStep:
    """What one engine output added to its sequence."""

    text: str  # newly released text (maybe "")
    token_ids: list[int]  # the output's tokens up to the one a stop string ended in
    logprobs: list[TokenLogprobs] | None  # one per token of token_ids, when the output carried them
    finish_reason: str | None  # set once the sequence is over


class OutputProcessor:
    """One sequence's text, tokens, logprobs and finish reason over its engine
    outputs; `take` each output in order. A served request keeps one over its
    attempts: a retry carries on where the lost attempt stopped."""

    def __init__(self, tokenizer, prompt_token_ids: Sequence[int], sampling: SamplingParams):
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids, sampling.skip_special_tokens,
                                                  sampling.stop, sampling.include_stop_str_in_output,
                                                  sampling.min_tokens)
        # an EOS ends a sequence with stop_reason None; any other stop token names itself (vLLM)
        self.eos_token_id = None if sampling.ignore_eos else tokenizer.eos_token_id
        self.token_ids: list[int] = []  # every token taken so far
        self.logprobs: list[TokenLogprobs] | None = [] if sampling.logprobs is not None else None
        self.prompt_logprobs: list[TokenLogprobs] | None = None  # the first output's that carries them
        self.finish_reason: str | None = None

    @property
    def text(self) -> str:
        """Everything released so far."""
        return self.detokenizer.text

    def take(self, token_ids: Sequence[int], logprobs: Sequence[TokenLogprobs] | None = None,
             finish_reason: str | None = None,
             prompt_logprobs: list[TokenLogprobs] | None = None) -> OutputStep:
        """One engine output: its new tokens, their logprobs (if any), the engine's
        finish reason (None: it goes on) and the prompt's logprobs (if any)."""
        detok = self.detokenizer
        self.prompt_logprobs = self.prompt_logprobs or prompt_logprobs
        num_read = detok.num_tokens
        text = detok.push(token_ids)
        if detok.is_stopped:  # tokens after the stop string (a step or a stream interval may bring several) go
            token_ids = token_ids[:detok.num_tokens - num_read]
            logprobs = logprobs and logprobs[:len(token_ids)]
        self.token_ids += token_ids
        if self.logprobs is not None:
            self.logprobs += logprobs or ()
        finish = "stop" if detok.is_stopped else finish_reason
        if finish is not None:
            text += self.finish(finish)
        return OutputStep(text, token_ids, logprobs, finish)

    def finish(self, reason: str) -> str:
        """Ends the sequence (`take` calls it; the caller, for a reason of the engine's
        own: a grammar that failed to compile, "error"); returns the held-back text it releases."""
        self.finish_reason = reason
        return self.detokenizer.finish()

    @property
    def stop_reason(self) -> int | str | None:
        """vLLM's: the stop string matched, or the stop token that ended the sequence
        (None for an EOS, for any other finish, and while it runs)."""
        if self.finish_reason != "stop":
            return None
        if self.detokenizer.is_stopped:
            return self.detokenizer.stop_reason
        last = self.token_ids[-1] if self.token_ids else None
        return None if last is None or last == self.eos_token_id else last
