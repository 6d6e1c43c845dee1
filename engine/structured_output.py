"""Structured outputs: constraints compiled into token masks, with xgrammar.

    StructuredOutputsParams ──compile (a thread, cached by key)──▶ CompiledGrammar
    CompiledGrammar ──per request──▶ GrammarState (a matcher + how many output tokens it has seen)
    each step: state.advance(request.output_token_ids) ──▶ fill its row of the bitmask ──▶ sampler masks

A matcher catches up on the tokens already in the request before it fills a
mask, so the same code serves a request sampled here from its first token, a
request preempted and recomputed, and a decode worker taking over a request
whose first token the prefill worker sampled (it advances by that token).

Compiling runs off the step loop: `GrammarCompilerPool.prepare` returns a
future; the engine keeps the request out of the scheduler until it is done.
Each worker compiles a given constraint once (`key`) and keeps it.

`check_constraint` is the API edge's check: it builds the grammar without a
tokenizer (milliseconds) so a schema the engine cannot compile is a 400.
"""
from __future__ import annotations

import json
import os
import re
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

# xgrammar's FFI layer (tvm_ffi) would otherwise, at import, JIT-build and load a torch extension
# for its DLPack exchange (we hand it no tensors through DLPack): with CUDA torch that build runs
# nvcc, and it touched CUDA in the workers' forkserver, whose children then could not use the GPU
os.environ.setdefault("TVM_FFI_DISABLE_TORCH_C_DLPACK", "1")
import xgrammar as xgr  # noqa: E402

from epd.transport.wire.sampling import SamplingParams, StructuredOutputsParams

_JSON_OBJECT_SCHEMA = '{"type": "object"}'
_XGR_PREFIX = re.compile(r"^\[[^\]]*\] \S+?:\d+: (Check failed: \(.*?\) is false: )?")


def _reason(exc: Exception) -> str:
    """xgrammar's message without its "[time] file.cc:line:" prefix."""
    return _XGR_PREFIX.sub("", str(exc).strip()).strip()


def choice_grammar(choices: Sequence[str]) -> str:
    """EBNF accepting exactly one of `choices` (JSON string escaping is valid EBNF)."""
    if not choices:
        raise ValueError("structured_outputs.choice must not be empty")
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def check_constraint(so: StructuredOutputsParams) -> None:
    """ValueError naming the problem when xgrammar cannot build the grammar."""
    try:
        kind = so.kind
        if kind == "json":
            xgr.Grammar.from_json_schema(so.spec, any_whitespace=False)
        elif kind == "regex":
            xgr.Grammar.from_regex(so.regex)
        elif kind == "choice":
            xgr.Grammar.from_ebnf(choice_grammar(so.choice))
        elif kind == "grammar":
            xgr.Grammar.from_ebnf(so.grammar)
    except ValueError:
        raise
    except Exception as exc:  # xgrammar raises RuntimeError with the parser's message
        raise ValueError(f"structured_outputs.{so.kind} cannot be compiled: {_reason(exc)}") from None


def bad_words_token_ids(tokenizer, words: Sequence[str]) -> list[list[int]]:
    """Each word as token ids, with and without a leading space (vLLM's rule)."""
    out: list[list[int]] = []
    for word in words:
        for prefix in ("", " "):
            ids = tokenizer.encode(prefix + word.lstrip(), add_special_tokens=False)
            if ids and ids not in out:
                out.append(ids)
    return out


@dataclass
class CompiledConstraints:
    """What a request needs from the compiler pool before it may run."""

    grammar: xgr.CompiledGrammar | None = None
    bad_words_token_ids: list[list[int]] = field(default_factory=list)


class GrammarCompilerPool:
    """One per engine: the tokenizer, xgrammar's compiler and compiled grammars,
    built lazily in one background thread (an engine that never sees a
    constraint never loads them)."""

    def __init__(self, tokenizer_dir: str, vocab_size: int, eos_token_ids: Sequence[int]):
        self.tokenizer_dir = tokenizer_dir  # the checkpoint, or --tokenizer's directory
        self.vocab_size = vocab_size  # the logits' width, maybe padded past the tokenizer
        self.eos_token_ids = list(eos_token_ids)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        self._lock = threading.Lock()
        self._tokenizer = None
        self._compiler: xgr.GrammarCompiler | None = None
        self._grammars: dict[tuple[str, str], Future] = {}  # key -> Future[CompiledGrammar]

    @staticmethod
    def needs(params: SamplingParams) -> bool:
        return params.structured_outputs is not None or bool(params.bad_words)

    def prepare(self, params: SamplingParams) -> Future:
        """Future[CompiledConstraints]; its exception is a ValueError naming the problem."""
        so = params.structured_outputs
        grammar = None
        if so is not None:
            with self._lock:
                grammar = self._grammars.get(so.key)
                if grammar is None or (grammar.done() and grammar.exception() is not None):
                    grammar = self._grammars[so.key] = self._executor.submit(self._compile, so)
        if grammar is not None and grammar.done() and not params.bad_words:
            done: Future = Future()
            if grammar.exception() is not None:
                done.set_exception(grammar.exception())
            else:
                done.set_result(CompiledConstraints(grammar.result()))
            return done
        return self._executor.submit(self._prepare, grammar, list(params.bad_words))

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    # -- in the compiler thread ---------------------------------------------------------

    def _prepare(self, grammar: Future | None, bad_words: list[str]) -> CompiledConstraints:
        compiled = grammar.result() if grammar is not None else None  # compiled earlier in this thread
        words = bad_words_token_ids(self.tokenizer, bad_words) if bad_words else []
        return CompiledConstraints(compiled, words)

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_dir)
        return self._tokenizer

    @property
    def compiler(self) -> xgr.GrammarCompiler:
        if self._compiler is None:
            info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                      stop_token_ids=self.eos_token_ids)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        return self._compiler

    def _compile(self, so: StructuredOutputsParams) -> xgr.CompiledGrammar:
        kind = so.kind
        try:
            if kind == "json":
                return self.compiler.compile_json_schema(so.spec, any_whitespace=False)
            if kind == "json_object":
                return self.compiler.compile_json_schema(_JSON_OBJECT_SCHEMA, any_whitespace=False,
                                                         strict_mode=False)
            if kind == "regex":
                return self.compiler.compile_regex(so.regex)
            if kind == "choice":
                return self.compiler.compile_grammar(choice_grammar(so.choice))
            return self.compiler.compile_grammar(so.grammar)
        except ValueError:
            raise
        except Exception as exc:
            raise ValueError(f"structured_outputs.{kind} cannot be compiled: {_reason(exc)}") from None


class GrammarState:
    """One request's matcher; `num_seen` output tokens have been fed to it."""

    def __init__(self, grammar: xgr.CompiledGrammar, stop_token_ids: Sequence[int]):
        self.matcher = xgr.GrammarMatcher(grammar, override_stop_tokens=list(stop_token_ids) or None)
        self.num_seen = 0

    def advance(self, output_token_ids: Sequence[int]) -> None:
        """Feeds the tokens sampled since the last call (here or on another worker)."""
        for token_id in output_token_ids[self.num_seen:]:
            if not self.matcher.is_terminated():
                self.matcher.accept_token(token_id)  # a masked sample is always accepted
        self.num_seen = len(output_token_ids)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Row `row` of an [num_rows, ceil(vocab / 32)] int32 bitmask: bit t set = token t allowed.
        A grammar already ended by its stop token (the request ignores EOS) masks nothing more,
        as in vLLM; the row stays as allocated (all allowed)."""
        if not self.matcher.is_terminated():
            self.matcher.fill_next_token_bitmask(bitmask, row)

    def fill_draft_bitmasks(self, draft_token_ids: Sequence[int], bitmask: torch.Tensor, row: int) -> None:
        """Speculative decoding: rows row .. row + d of `bitmask`, the mask after
        the tokens fed so far and after each prefix of the draft, as decoding
        the draft one token at a time would fill them. The matcher is rolled
        back afterwards: a draft never advances the grammar (its accepted tokens
        are fed by `advance` at the next step, like any sampled token). A draft
        token the grammar refuses ends the walk; the rows after it stay
        all-allowed, and no verification reads them (the masked target cannot
        have chosen that token)."""
        self.fill_bitmask(bitmask, row)
        num_fed = 0
        for i, token_id in enumerate(draft_token_ids):
            if not self.matcher.is_terminated():  # ended: as `advance`, feed nothing more
                if not self.matcher.accept_token(token_id):
                    break
                num_fed += 1
            self.fill_bitmask(bitmask, row + i + 1)
        if num_fed:
            self.matcher.rollback(num_fed)


def allocate_bitmask(num_rows: int, vocab_size: int) -> torch.Tensor:
    """[num_rows, ceil(vocab / 32)] int32, every token allowed."""
    return xgr.allocate_token_bitmask(num_rows, vocab_size)
