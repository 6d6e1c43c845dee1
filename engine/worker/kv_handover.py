"""`KVHandover`: a request's KV from the prefill worker to the decode worker, as an
engine worker (engine/worker/loop.py `EngineWorker`, which it is mixed into) does it.

    prefill role  `_send_kv`: a prefilled request's blocks (EAGLE-3's head state, the
                  model's named per-request state) in a KVTransfer to the decode worker
                  its PrefillRequest named; `_on_kv_ack`: the decode worker has them,
                  the request leaves this worker
    decode role   `_on_kv_transfer`: the KV waits in the request's state;
                  `_admit_transfers`: written into fresh blocks when they are free (the
                  per-request state into the slot of its first step), acked

It uses the worker's request records (`requests`, `_track`, `_forget`), its engine
(`core`), sockets (`inbox`, `outbox`, `_send_output`) and counters.
"""
from __future__ import annotations

import time

from epd.engine.request import Request
from epd.transport.wire.messages import KVAck, KVTransfer, TokenOutput


class KVHandover:
    def _on_kv_transfer(self, msg: KVTransfer) -> None:
        """Decode role: the KV waits in the request's state until blocks are free."""
        state = self._track(msg.request_id, msg.api_index)
        if state.transfer is None:
            self._num_incoming += 1
        state.transfer = msg

    def _admit_transfers(self) -> None:
        """Decode role: write arrived KV into fresh blocks (in arrival order), then ack."""
        if not self._num_incoming:
            return
        for state in [s for s in self.requests.values() if s.transfer is not None]:
            msg = state.transfer
            request = Request(msg.request_id, list(msg.prompt_token_ids), msg.sampling,
                              mm_spans=list(msg.mm_spans), eos_token_ids=tuple(msg.eos_token_ids),
                              lora_request=msg.lora)
            request.output_token_ids.append(msg.first_token_id)
            try:
                admitted = self.core.add_prefilled(request, msg.k_blocks, msg.v_blocks, msg.draft_state, msg.state)
            except ValueError as exc:
                self.outbox.send(msg.reply_to, KVAck(msg.request_id, ok=False, error=str(exc)))
                self._send_output(TokenOutput(msg.request_id, [], finished=True, finish_reason="error",
                                              error=str(exc)))
                continue
            if not admitted:
                continue  # no room yet; prefill keeps its copy meanwhile
            state.transfer = None
            self._num_incoming -= 1
            self.counters.kv_transfer_bytes += msg.num_bytes
            self.outbox.send(msg.reply_to, KVAck(msg.request_id, ok=True))

    def _send_kv(self, request: Request) -> None:
        """Prefill role: ship a prefilled request's blocks to its decode worker."""
        state = self.requests.get(request.request_id)
        if state is None or state.decode_target is None:
            return
        target, state.decode_target = state.decode_target, None
        k, v = self.core.export_kv(request.request_id)  # [layers, blocks, block_size, kv_heads, head_dim]
        state.transfer_start_s = time.perf_counter()
        self.outbox.send(target, KVTransfer(
            request.request_id, list(request.prompt_token_ids), request.output_token_ids[0],
            request.sampling_params, list(request.eos_token_ids), list(request.mm_spans),
            k, v, reply_to=self.inbox.address, api_index=state.api_index or 0, lora=request.lora_request,
            draft_state=self.core.export_draft_state(request.request_id),  # EAGLE-3's head, or None
            state=self.core.export_state(request.request_id)))  # named per-request state, or {}

    def _on_kv_ack(self, msg: KVAck) -> None:
        """Prefill role: the decode worker has the KV; the request leaves this worker."""
        state = self._forget(msg.request_id)
        if state is not None and state.transfer_start_s is not None:
            self.counters.kv_transfer_seconds_sum += time.perf_counter() - state.transfer_start_s
            self.counters.num_kv_transfers += 1
        self.core.release(msg.request_id)  # False: aborted meanwhile, already freed
