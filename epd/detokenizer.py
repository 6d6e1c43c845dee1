"""Incremental detokenizer: output token ids in, stable text chunks out.

Two offsets over the token list, as in vLLM: `prefix_offset..read_offset` is a
window already turned into text, kept as left context so that a token decodes
the same as it does inside the full sequence. After each token we decode
`[prefix_offset:read_offset]` and `[prefix_offset:]`; the difference is new
text. A byte-level BPE token can end inside a multi-byte UTF-8 character — the
decode then ends with U+FFFD — so nothing moves until the character completes.
Each decode covers a few tokens, so a request costs O(num_tokens).

Stop strings are matched on the decoded text. Characters that could still be
the start of a stop string are held back; once one matches, the text ends
before it (or after it, with `include_stop_str_in_output`) and nothing after is
ever released. The text never gets tokenizer "clean-up" of spaces: without
stops, the chunks concatenate to
`tokenizer.decode(output_ids, skip_special_tokens=..., clean_up_tokenization_spaces=False)`
for byte-level BPE (Qwen's). With a SentencePiece-style tokenizer and a prompt
given, the first output token keeps its leading space, as in vLLM.
"""
from __future__ import annotations

from collections.abc import Sequence

# Prompt tokens decoded as left context for the first output token (vLLM's value).
_NUM_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Streams one sequence's text; `push` the new token ids of each step.

    Works with any Hugging Face tokenizer (`PreTrainedTokenizerFast`). Stop
    token ids and EOS are the scheduler's business: push them or not, they are
    special tokens and vanish with `skip_special_tokens=True`.
    """

    def __init__(self, tokenizer, prompt_token_ids: Sequence[int] | None = None,
                 skip_special_tokens: bool = True, stop: Sequence[str] = (),
                 include_stop_str_in_output: bool = False, min_tokens: int = 0) -> None:
        """`min_tokens`: no stop string matches while the output has this many tokens or
        fewer (vLLM's rule: its stop strings, like its stop tokens, wait for min_tokens)."""
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = [s for s in stop if s]
        self.include_stop_str_in_output = include_stop_str_in_output
        self.min_tokens = min_tokens
        self.stop_reason: str | None = None  # the stop string that ended the text

        # The last prompt tokens lead the list as context; output tokens follow.
        context = list(prompt_token_ids or [])[-_NUM_PROMPT_CONTEXT_TOKENS:]
        self._token_ids: list[int] = context
        self._num_context = len(context)
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._decoded = ""  # stable text of the output so far (includes held-back chars)
        self._num_emitted = 0  # chars of _decoded released to the caller
        self._is_done = False  # stopped or finished: nothing more is released

    @property
    def text(self) -> str:
        """Everything released so far."""
        return self._decoded[:self._num_emitted]

    @property
    def num_tokens(self) -> int:
        """Output tokens read so far: once a stop string matched, `push` reads no further."""
        return len(self._token_ids) - self._num_context

    @property
    def is_stopped(self) -> bool:
        return self.stop_reason is not None

    def push(self, token_ids: Sequence[int]) -> str:
        """Adds output tokens; returns the newly released text (maybe "")."""
        if self._is_done:
            return ""
        for token_id in token_ids:
            self._token_ids.append(token_id)
            prefix_text, full_text = self._decode_window()
            if full_text.endswith(_REPLACEMENT_CHAR) or len(full_text) <= len(prefix_text):
                continue  # a character is still incomplete, or no text yet
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._token_ids)
            if self._append(full_text[len(prefix_text):]):
                break
        return self._release(is_final=False)

    def finish(self) -> str:
        """Flushes held-back text at the end of the request (never past a stop)."""
        if self._is_done:
            return ""
        if self._read_offset < len(self._token_ids):
            prefix_text, full_text = self._decode_window()
            self._read_offset = len(self._token_ids)
            self._append(full_text[len(prefix_text):])
        chunk = self._release(is_final=True)
        self._is_done = True
        return chunk

    def _decode_window(self) -> tuple[str, str]:
        """Text of tokens [prefix_offset:read_offset] and of [prefix_offset:]."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)  # a fast tokenizer's Rust half

        def decode(ids: list[int]) -> str:
            # the same text as tokenizer.decode(..., clean_up_tokenization_spaces=False), without
            # transformers' Python wrapper: two decodes per token are the API's heaviest per-token work
            if backend is not None:
                return backend.decode(ids, skip_special_tokens=self.skip_special_tokens)
            return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                         clean_up_tokenization_spaces=False)
        window = self._token_ids[self._prefix_offset:]
        return decode(window[:self._read_offset - self._prefix_offset]), decode(window)

    def _append(self, new_text: str) -> bool:
        """Adds stable text and looks for a stop string; True once one matched."""
        if not new_text:
            return False
        start = len(self._decoded)
        self._decoded += new_text
        if not self.stop or self.num_tokens <= self.min_tokens:
            return False
        # A match must end inside the new text; it may start up to len(stop)-1 earlier.
        best: tuple[int, str] | None = None
        for stop in self.stop:
            pos = self._decoded.find(stop, max(0, start - len(stop) + 1))
            if pos != -1 and (best is None or pos < best[0]):
                best = (pos, stop)
        if best is None:
            return False
        pos, stop = best
        self.stop_reason = stop
        self._decoded = self._decoded[:pos + len(stop) if self.include_stop_str_in_output else pos]
        return True

    def _release(self, is_final: bool) -> str:
        """Releases decoded text, keeping back a tail that may begin a stop string."""
        end = len(self._decoded)
        if not is_final and not self.is_stopped:
            end -= self._stop_prefix_len()
        chunk = self._decoded[self._num_emitted:end]
        self._num_emitted = max(self._num_emitted, end)
        if self.is_stopped:
            self._is_done = True
        return chunk

    def _stop_prefix_len(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop."""
        text = self._decoded
        longest = 0
        for stop in self.stop:
            for n in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:n]):
                    longest = n
                    break
        return longest
