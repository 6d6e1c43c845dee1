from dataclasses import fields

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from epd.transport.wire.messages import (
    MESSAGE_TYPES, Abort, EncodeDone, EncodeRequest, KVAck, KVBlocks, KVTransfer, Message, MMSpan, decode_message,
    Alive, LoRAUpdate, PrefillRequest, Ready, Shutdown, TokenOutput, TokenOutputs, WireError, WorkerExited, WorkerStats)
from epd.transport.wire.lora_request import LoRARequest
from epd.transport.media.video_geometry import VideoPlan
from epd.transport.wire.sampling import SamplingParams, StructuredOutputsParams, TokenLogprobs
from epd.transport.wire.wire_values import CacheFaults, EncoderCounters, EngineCounters, LoRAState, sampling_to_map


HASH_A = "ab" * 32
HASH_B = "cd" * 32
# every field away from its default, so a field the wire dropped would show
SAMPLING = SamplingParams(n=2, temperature=0.7, top_p=0.9, top_k=50, min_p=0.05, seed=7, presence_penalty=0.5,
                          frequency_penalty=-0.5, repetition_penalty=1.1, max_tokens=32, min_tokens=2,
                          stop=["\n"], stop_token_ids=[7], ignore_eos=True, logprobs=3,
                          skip_special_tokens=False, logit_bias={5: -2.5, 9: 100}, allowed_token_ids=[3, 5, 9],
                          bad_words=["dog"],
                          structured_outputs=StructuredOutputsParams(json={"type": "object", "properties": {}}),
                          stream_interval=4, include_stop_str_in_output=True,
                          prompt_logprobs=2)
GREEDY = SamplingParams(temperature=0)


def make_kv(num_layers=2, num_blocks=3, block_size=4, num_kv_heads=2, head_dim=8,
            dtype=torch.bfloat16) -> torch.Tensor:
    shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
    return torch.randn(shape).to(dtype)


def _busy_encoder() -> EncoderCounters:
    """Every encoder counter non-zero, histograms included."""
    c = EncoderCounters(num_images=7, num_errors=8, num_cache_skips=9, encode_seconds_sum=10.5, num_aborted=11,
                        num_requests_received=12, num_queued_patches=13, cache_hit_tokens=14, cache_evictions=15,
                        cache_entries=16, cache_bytes=17, num_inline=18, inline_bytes=19, oldest_queued_s=20.5)
    for i, name in enumerate(["queue_wait", "preprocess_seconds", "forward_seconds", "cache_write_seconds",
                              "inline_send_seconds", "batch_images"]):
        getattr(c, name).observe(0.003 * (i + 1), times=i + 1)
    c.image.num_items, c.video.num_items = 21, 22
    c.image.observe_decode(1, 0.004)
    c.video.observe_decode(23, 0.5)
    return c


def make_messages() -> list[Message]:
    """One instance of every wire type, tensors in several dtypes."""
    spans = [MMSpan(3, 16, HASH_A, {"grid_thw": (1, 8, 8)}), MMSpan(20, 4, HASH_B, {"grid_thw": (1, 4, 4)})]
    return [
        EncodeRequest("req-1", HASH_A, bytes(range(256)) * 4, reply_to="ipc:///tmp/epd-x/prefill-0.sock"),
        EncodeRequest("req-2", HASH_B, b"", reply_to="tcp://hostb:27101"),  # empty blob frame
        EncodeRequest("req-4", HASH_B, b"img", reply_to="tcp://hostb:27101", alone=True),  # a suspect, re-sent
        EncodeRequest("req-3", HASH_B, b"video", reply_to="tcp://hostb:27101",
                      video=VideoPlan((0, 2, 4, 4), 32, 64, (2, 2, 4), 4, 2, (0.5, 1.5))),
        EncodeRequest("req-5", HASH_A, b"img", reply_to="tcp://hostb:27101",
                      lora=LoRARequest("vit", 3, "/adapters/vit")),  # a tower adapter (--enable-tower-lora)
        EncodeDone("req-1", HASH_A, ok=True),
        EncodeDone("req-1", HASH_A, ok=False, error="decode failed"),
        EncodeDone("req-1", HASH_A, ok=True, embeddings=torch.randn(16, 32),
                   extras={f"deepstack.{i}": torch.randn(16, 32) for i in range(3)}, meta={"grid_thw": (1, 8, 8)}),
        EncodeDone("req-1", HASH_A, ok=True, embeddings=torch.randn(4, 8).half(), meta={"grid_thw": (1, 4, 4)}),
        EncodeDone("req-1", HASH_A, ok=True, embeddings=torch.zeros(0, 8), meta={"grid_thw": (1, 0, 0)}),
        PrefillRequest("req-1", list(range(40)), spans, SAMPLING, [151645, 151643], "ipc:///tmp/epd-x/decode-1.sock"),
        PrefillRequest("req-2", [1, 2, 3], [], SamplingParams(), [], None),
        PrefillRequest("req-3", [1], [], GREEDY, [], None, api_index=3),  # from API process 3
        PrefillRequest("req-4", [1, 2], [], GREEDY, [], None, lora=LoRARequest("sql", 2, "/adapters/sql")),
        KVTransfer("req-1", list(range(10)), 42, SAMPLING, [2], [MMSpan(2, 4, HASH_A, {"grid_thw": (1, 4, 4)})],
                   make_kv(), make_kv()),
        KVTransfer("req-1", [5], 1, GREEDY, [], [],
                   make_kv(dtype=torch.float32), make_kv(dtype=torch.float32)),
        KVTransfer("req-3", [5], 1, GREEDY, [], [], make_kv(), make_kv(), reply_to="tcp://[::1]:27101", api_index=1),
        KVTransfer("req-4", [5], 1, GREEDY, [], [], make_kv(), make_kv(), lora=LoRARequest("sql", 2, "/adapters/sql")),
        KVTransfer("req-5", [5], 1, GREEDY, [], [], make_kv(), make_kv(),  # with an EAGLE-3 head's state
                   draft_state=(make_kv(num_layers=1, head_dim=4), make_kv(num_layers=1, head_dim=4),
                                torch.randn(16).to(torch.bfloat16))),
        KVAck("req-1", ok=True),
        KVAck("req-1", ok=False, error="out of blocks"),
        TokenOutput("req-1", [5, 6], finished=True, finish_reason="stop", num_prompt_tokens=40,
                    num_cached_tokens=16, logprobs=[TokenLogprobs(5, -0.1, 1, [(5, -0.1), (9, -2.5)]),
                                                    TokenLogprobs(6, -0.2, 3, [])]),
        TokenOutput("req-1", []),
        TokenOutput("req-1", [9], index=7),
        TokenOutput("req-1", [9], num_prompt_tokens=3, prompt_logprobs=[TokenLogprobs(4, -1.5, 2, [(7, -0.5)]),
                                                                        TokenLogprobs(8, -0.25, 1, [])]),
        # one engine step's outputs: a finished one with logprobs, an error, a held batch of four tokens
        TokenOutputs([TokenOutput("req-1", [5, 6], finished=True, finish_reason="stop", num_prompt_tokens=40,
                                  num_cached_tokens=16, logprobs=[TokenLogprobs(5, -0.1, 1, [(5, -0.1)]),
                                                                  TokenLogprobs(6, -0.2, 3, [])], index=3),
                      TokenOutput("req-2", [], finished=True, finish_reason="error", error="bad image",
                                  is_internal_error=True),
                      TokenOutput("req-3", [1, 2, 3, 4], num_prompt_tokens=7, index=1),
                      TokenOutput("req-4", [2], num_prompt_tokens=2, prompt_logprobs=[TokenLogprobs(3, -2.0, 4, [])])]),
        TokenOutputs([]),
        WorkerStats("decode-0", "decode", 3, 1, 100, 512, 4, engine=EngineCounters(1, 2, 3, 4, 5, 6.5)),
        WorkerStats("prefill-0", "prefill", 3, 1, 100, 512, 4, engine=EngineCounters(),
                    lora=LoRAState(("sql",), ("chat", "sql"), ("sql", "math"), 2)),
        WorkerStats("aggregated-0", "aggregated", 0, 0, 8, 8, 0, engine=EngineCounters(),
                    encoder=_busy_encoder()),
        WorkerStats("encoder-0", "encoder", 0, 2, 0, 0, 2, encoder=EncoderCounters(),
                    cache=CacheFaults(serving=0, set_aside=1, read_errors=2, bad_entries=3, space_failures=4,
                                      skipped_puts=5)),
        WorkerStats("encoder-1", "encoder", 0, 1, 0, 0, 1, encoder=EncoderCounters(),  # --enable-tower-lora
                    lora=LoRAState(waiting=("chat",), resident=("sql", "chat"), max_lora=2)),
        Ready("prefill-0", "prefill", "ipc:///tmp/epd-x/prefill-0.sock", "a"),
        Ready("encoder-7", "encoder", "tcp://10.0.0.2:27100", "b", mm_cache_dir="/data/mm-cache"),
        Abort(["req-1", "req-2"]),
        Abort([]),
        Abort([], api_index=1),  # the launcher: API process 1 exited
        LoRAUpdate(LoRARequest("sql", 3, "/adapters/sql"), is_load=True),
        LoRAUpdate(LoRARequest("sql", 3, "/adapters/sql"), is_load=False),
        Shutdown(),
        WorkerExited("decode-0", -9),
        WorkerExited("prefill-1", None),
        Alive("encoder-0", 12.5),
        Alive("encoder-0", 0.0, working_on=["req-1", "req-2~retry1"]),  # an encoder's batch starts
        Alive("encoder-0", 0.0, working_on=[]),  # ... and ends
        KVBlocks("prefill-0", 3, [("removed", [7]), ("stored", [1, 2**64 - 1]), ("cleared", [])], session="ab"),
    ]


def assert_same(a, b) -> None:
    """Field-wise equality that compares tensors by dtype, shape and value."""
    assert type(a) is type(b)
    for f in fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, dict) and list(x) == list(y) and x and isinstance(next(iter(x.values())), torch.Tensor):
            x, y = list(x.values()), list(y.values())  # named tensors: the same names, then the tensors in order
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and torch.equal(x, y), f.name
        elif isinstance(x, (list, tuple)) and x and isinstance(x[0], torch.Tensor):
            assert len(x) == len(y), f.name
            for u, v in zip(x, y):
                assert u.dtype == v.dtype and torch.equal(u, v), f.name
        elif isinstance(x, bytes):
            assert bytes(x) == bytes(y), f.name
        else:
            assert x == y, f.name


def _pack(header: dict) -> bytes:
    return msgpack.packb(header, use_bin_type=True)


@pytest.mark.parametrize("msg", make_messages(), ids=lambda m: m.TYPE)
def test_round_trip(msg: Message):
    frames = msg.to_wire()
    # as zmq delivers them (bytes) and as handed over in-process (memoryviews)
    for wire in ([bytes(f) for f in frames], frames):
        out = decode_message(wire)
        assert_same(msg, out)
        assert_same(msg, type(msg).from_wire(wire))


def test_every_type_is_covered_and_registered():
    assert {m.TYPE for m in make_messages()} == set(MESSAGE_TYPES)


def test_tensor_frames_are_zero_copy_views():
    kv = make_kv(dtype=torch.float32)
    frames = KVTransfer("r", [1], 2, GREEDY, [], [], kv, kv.clone()).to_wire()
    assert len(frames) == 3 and isinstance(frames[1], memoryview)
    kv.view(-1)[0] = 1234.0
    assert torch.frombuffer(bytearray(frames[1]), dtype=torch.float32)[0] == 1234.0


def test_kv_transfer_counts():
    msg = decode_message(KVTransfer("r", [1] * 9, 2, GREEDY, [], [],
                                    make_kv(num_layers=5, num_blocks=3),
                                    make_kv(num_layers=5, num_blocks=3)).to_wire())
    assert (msg.num_layers, msg.num_blocks) == (5, 3)


def test_kv_transfer_refuses_a_head_state_that_does_not_fit():
    kv = make_kv(num_blocks=3)
    for state in [(make_kv(num_blocks=2), make_kv(num_blocks=2), torch.randn(8)),  # fewer blocks than the KV
                  (make_kv(), make_kv(head_dim=4), torch.randn(8)),  # k and v differ
                  (make_kv(), make_kv(), torch.randn(2, 8))]:  # features not [hidden]
        frames = KVTransfer("r", [1], 2, GREEDY, [], [], kv, kv.clone(), draft_state=state).to_wire()
        with pytest.raises(WireError, match="head's k/v"):
            decode_message(frames)
    frames = KVTransfer("r", [1], 2, GREEDY, [], [], kv, kv.clone(), draft_state=(kv.clone(),)).to_wire()
    with pytest.raises(WireError, match="needs k and v"):
        decode_message(frames)  # three tensor frames: neither form


def test_from_wire_rejects_other_type():
    with pytest.raises(WireError, match="expected kv_ack"):
        KVAck.from_wire(Shutdown().to_wire())


def _good() -> list[bytes]:
    msg = EncodeDone("r", HASH_A, True, None, torch.randn(4, 8), {"deepstack.0": torch.randn(4, 8)}, {"grid_thw": (1, 4, 4)})
    return [bytes(f) for f in msg.to_wire()]


def _header(frames) -> dict:
    return msgpack.unpackb(frames[0])


def _with(msg_frames, **changes) -> list[bytes]:
    header = _header(msg_frames)
    header.update(changes)
    return [_pack(header), *msg_frames[1:]]


def _meta_of(dtype: str, *shape: int) -> dict:
    return {"dtype": dtype, "shape": list(shape)}


def _without(frames, key) -> list[bytes]:
    header = _header(frames)
    del header[key]
    return [_pack(header), *frames[1:]]


@pytest.mark.parametrize("frames", [
    [],
    [b""],
    [b"\xff\xfe garbage"],
    [_pack([1, 2, 3])],
    [_pack({"type": "nope", "v": 1, "frames": []})],
    [_pack({"type": 7, "v": 1, "frames": []})],
    [_pack({"type": "shutdown", "v": 2, "frames": []})],
    [_pack({"type": "shutdown", "v": True, "frames": []})],
    [_pack({"type": "shutdown", "frames": []})],
    [_pack({"type": "shutdown", "v": 1})],
    [_pack({"type": "shutdown", "v": 1, "frames": []}), b"extra"],
    [_pack({"type": "shutdown", "v": 1, "frames": [3]}), b"abc"],  # payload on a no-payload type
    _good()[:-1],                                     # a frame missing
    [*_good(), b"x"],                                 # a frame too many
    [_good()[0], _good()[1][:-1], _good()[2]],        # truncated tensor frame
    [_good()[0], _good()[1] + b"\0\0\0\0", _good()[2]],
    [_good()[0][:-3], *_good()[1:]],                  # truncated header
    _with(_good(), ok="yes"),
    _with(_good(), request_id=5),
    _with(_good(), meta={"grid_thw": [1, "2"]}),
    _with(_good(), error=b"bytes"),
    _with(_good(), frames=[_meta_of("float8", 4, 8), _meta_of("float32", 4, 8)]),
    _with(_good(), frames=[_meta_of("float32", 8, 4), _meta_of("float32", 4, 8)]),
    _with(_good(), frames=[_meta_of("float32", 32), _meta_of("float32", 32)]),  # not [n, hidden]
    _with(_good(), frames="two"),
    _without(_good(), "mm_hash"),
    [_pack({"type": "token_output", "v": 1, "frames": [], "request_id": "r",
            "token_ids": [1, "2"], "finished": False, "finish_reason": None,
            "num_prompt_tokens": 0, "num_cached_tokens": 0, "logprobs": None, "error": None})],
    [_pack({"type": "abort", "v": 1, "frames": [], "request_ids": "r1"})],
    [_pack({"type": "worker_stats", "v": 2, "frames": [], "worker_id": "w", "role": "decode",
            "num_running": 1, "num_waiting": 1, "num_free_blocks": 1, "num_total_blocks": 1,
            "queue_depth": 1, "engine": {**EngineCounters().to_map(), "num_preemptions": "x"},
            "encoder": None, "session": ""})],
    [_pack({"type": "ready", "v": 2, "frames": [], "worker_id": "w", "role": "decode",
            "inbox": b"ipc:///x", "host": "h", "mm_cache_dir": None, "session": ""})],
    _with([bytes(f) for f in EncodeRequest("r", HASH_A, b"img", "ipc:///x/p.sock").to_wire()], frames=[4]),
    _with([bytes(f) for f in KVTransfer("r", [1] * 100, 1, GREEDY, [], [], make_kv(),
                                        make_kv()).to_wire()], prompt_token_ids=[1] * 100),
    _with([bytes(f) for f in KVTransfer("r", [1], 1, GREEDY, [], [], make_kv(),
                                        make_kv()).to_wire()], mm_spans=[[0, 1, HASH_A, [1, 1]]]),
    [_pack({"type": "prefill_request", "v": 1, "frames": [], "request_id": "r",
            "prompt_token_ids": [1], "mm_spans": [], "sampling": {1: 2}, "eos_token_ids": [],
            "decode_worker": None})],
    ["not bytes"],
    [None],
], ids=range(36))
def test_malformed_input_raises_wire_error(frames):
    with pytest.raises(WireError):
        decode_message(frames)


def test_wire_error_names_the_field():
    with pytest.raises(WireError, match=r"encode_done\.ok"):
        decode_message(_with(_good(), ok="yes"))


def test_mismatched_kv_blocks_rejected():
    frames = KVTransfer("r", [1], 1, GREEDY, [], [], make_kv(), make_kv()).to_wire()
    frames_other = KVTransfer("r", [1], 1, GREEDY, [], [], make_kv(num_blocks=2),
                              make_kv(num_blocks=2)).to_wire()
    header = _header(frames)
    header["frames"][1] = _header(frames_other)["frames"][1]
    with pytest.raises(WireError, match="k/v"):
        decode_message([_pack(header), frames[1], frames_other[2]])


# --- fields that decode but no worker could use: refused at decode, not later in the worker ------

def _frames(msg: Message, **changes) -> list[bytes]:
    return _with([bytes(f) for f in msg.to_wire()], **changes)


def _prefill(**changes) -> list[bytes]:
    return _frames(PrefillRequest("r", list(range(20)), [MMSpan(2, 4, HASH_A, {"grid_thw": (1, 4, 4)})], SAMPLING, [2], None),
                   **changes)


def _sampling(**changes) -> dict:
    return {**sampling_to_map(SAMPLING), **changes}


def _sampling_without(key: str) -> dict:
    return {k: v for k, v in sampling_to_map(SAMPLING).items() if k != key}


def _token_output(**changes) -> list[bytes]:
    return _frames(TokenOutput("r", [5], logprobs=[TokenLogprobs(5, -0.1, 1, [(5, -0.1)])]), **changes)


def _stats(**changes) -> list[bytes]:
    return _frames(WorkerStats("w", "aggregated", 0, 0, 1, 1, 0, EngineCounters(), EncoderCounters()), **changes)


@pytest.mark.parametrize("frames, match", [
    (_prefill(sampling=_sampling(no_such_field=1)), r"prefill_request\.sampling: unknown fields \['no_such_field'\]"),
    (_prefill(sampling=_sampling_without("max_tokens")), r"prefill_request\.sampling: missing field 'max_tokens'"),
    (_prefill(sampling=_sampling(temperature="hot")), r"prefill_request\.sampling\.temperature: expected float"),
    (_prefill(sampling=_sampling(logit_bias=[[5, "up"]])), r"prefill_request\.sampling\.logit_bias: expected"),
    (_prefill(sampling=_sampling(logit_bias=[[5, 101.0]])), r"logit_bias values must be in \[-100, 100\]"),
    (_prefill(sampling=_sampling(allowed_token_ids=[-1])), r"sampling\.allowed_token_ids: expected list of token ids"),
    (_prefill(sampling=_sampling(structured_outputs={"kind": "xml", "spec": ""})),
     r"unknown structured_outputs kind 'xml'"),
    (_prefill(sampling=_sampling(structured_outputs={"kind": "json", "spec": "{nope"})),
     r"structured_outputs\.json is not valid JSON"),
    (_prefill(sampling=_sampling(structured_outputs={"kind": "regex", "spec": "a", "x": 1})),
     r"sampling\.structured_outputs: unknown fields"),
    (_prefill(sampling=_sampling(top_k=1.5)), r"sampling\.top_k: expected int"),
    (_prefill(sampling=_sampling(seed=True)), r"sampling\.seed: expected int or None"),
    (_prefill(sampling=_sampling(stop="\n")), r"sampling\.stop: expected list\[str\]"),
    (_prefill(sampling=_sampling(stop_token_ids=[-1])), r"sampling\.stop_token_ids"),
    (_prefill(sampling=_sampling(top_p=0.0)), r"prefill_request\.sampling: top_p must be in \(0, 1\]"),
    (_prefill(sampling=_sampling(logprobs=21)), r"sampling: logprobs must be in \[0, 20\]"),
    (_prefill(sampling=[1, 2]), r"prefill_request\.sampling: expected map"),
    (_prefill(prompt_token_ids=[1, -2, *range(18)]), r"prefill_request\.prompt_token_ids: expected list of token ids"),
    (_prefill(eos_token_ids=[2.0]), r"prefill_request\.eos_token_ids"),
    (_prefill(mm_spans=[[2, 4, "zz" * 32, {"grid_thw": [1, 4, 4]}]]), r"mm_spans: mm_hash must be 64 hex chars"),
    (_prefill(mm_spans=[[2, 4, HASH_A.upper(), {"grid_thw": [1, 4, 4]}]]), r"mm_spans: mm_hash must be 64 hex chars"),
    (_prefill(mm_spans=[[2, 4, HASH_A[:-1], {"grid_thw": [1, 4, 4]}]]), r"mm_spans: mm_hash must be 64 hex chars"),
    (_prefill(mm_spans=[[18, 4, HASH_A, {"grid_thw": [1, 4, 4]}]]), r"mm_spans: span \[18, \+4\) outside the prompt of 20"),
    (_prefill(mm_spans=[[-1, 4, HASH_A, {"grid_thw": [1, 4, 4]}]]), r"outside the prompt"),
    (_frames(EncodeRequest("r", HASH_A, b"img", "p"), mm_hash="not-a-hash"),
     r"encode_request\.mm_hash: expected 64 lowercase hex chars"),
    (_with(_good(), mm_hash=HASH_A[:-2]), r"encode_done\.mm_hash: expected 64 lowercase hex chars"),
    (_frames(KVTransfer("r", [1], 1, GREEDY, [], [], make_kv(), make_kv()), sampling={"temperature": 0.0}),
     r"kv_transfer\.sampling: missing field"),
    (_frames(KVTransfer("r", [1], 1, GREEDY, [], [], make_kv(), make_kv()), first_token_id=-1),
     r"kv_transfer: first_token_id"),
    (_token_output(token_ids=[5, 6]), r"token_output: logprobs: one entry per token"),
    (_token_output(logprobs=[[5, -0.1, 0, []]]), r"token_output\.logprobs: entries must be"),
    (_token_output(logprobs=[[5, -0.1, 1, [[5, "x"]]]]), r"token_output\.logprobs: entries must be"),
    (_token_output(logprobs=[[-0.1, [[5, -0.1]]]]), r"token_output\.logprobs: entries must be"),
    (_token_output(finish_reason="done"), r"token_output\.finish_reason: expected one of"),
    (_frames(TokenOutputs([TokenOutput("r", [5])]), outputs=[["r", [5], False]]),
     r"token_outputs: outputs\[0\]: 11 items, got 3"),
    (_frames(TokenOutputs([TokenOutput("r", [5]), TokenOutput("s", [6])]),
             outputs=[["r", [5], False, None, 0, 0, None, None, 0, False, None],
                      ["s", [-6], False, None, 0, 0, None, None, 0, False, None]]),
     r"token_outputs\[1\]\.token_ids: expected list of token ids"),
    (_frames(TokenOutputs([TokenOutput("r", [5])]), outputs={"r": [5]}), r"token_outputs\.outputs: expected list"),
    (_frames(TokenOutputs([TokenOutput("r", [5])]),
             outputs=[["r", [5], False, None, 0, 0, None, None, True, False, None]]),
     r"token_outputs\[0\]\.index: expected int"),
    (_frames(TokenOutputs([TokenOutput("r", [5])]), outputs=[["r", [5], 1, None, 0, 0, None, None, 0, False, None]]),
     r"token_outputs\[0\]\.finished: expected bool"),
    (_frames(TokenOutputs([TokenOutput("r", [5])]),
             outputs=[["r", [5], False, "done", 0, 0, None, None, 0, False, None]]),
     r"token_outputs\[0\]\.finish_reason: expected one of"),
    (_frames(Ready("w", "decode", "ipc:///x", "h"), role="gpu"), r"ready\.role: expected one of"),
    # addresses a worker or the API would connect to: refused when decoded (issue 33)
    (_frames(Ready("w", "decode", "ipc:///x", "h"), inbox="not an address"), r"ready: inbox: not an address"),
    (_frames(Ready("w", "decode", "ipc:///x", "h"), inbox="tcp://*:5555"), r"ready: inbox: not an address"),
    (_frames(Ready("w", "decode", "ipc:///x", "h"), inbox="tcp://host:0"), r"ready: inbox: not an address"),
    (_frames(Ready("w", "decode", "ipc:///x", "h"), inbox="ipc://relative.sock"), r"ready: inbox: not an address"),
    (_frames(Ready("w", "decode", "ipc:///x", "h"), inbox="ipc:///" + "x" * 200), r"ready: inbox: not an address"),
    (_frames(Ready("w", "decode", "ipc:///x", "h"), session="ZZ"), r"ready: session: expected hex"),
    (_prefill(decode_worker="decode-1"), r"prefill_request: decode_worker: not an address"),
    (_frames(EncodeRequest("r", HASH_A, b"i", "ipc:///x/p.sock"), reply_to="tcp://h:99999"),
     r"encode_request: reply_to: not an address"),
    (_frames(Alive("w", 1.0), busy_s=float("nan")), r"alive: busy_s must be finite"),
    (_frames(Alive("w", 1.0), busy_s=float("inf")), r"alive: busy_s must be finite"),
    (_frames(Alive("w", 1.0), busy_s=-1.0), r"alive: busy_s must be finite"),
    (_frames(Alive("w", 1.0), working_on=["r", 7]), r"alive.working_on: expected list\[str\]"),
    (_frames(Alive("w", 1.0), working_on=["r"] * 4097), r"working_on names at most 4096"),
    (_stats(num_running=-5), r"worker_stats: counts must be in"),
    (_frames(Ready("w", "decode", "ipc:///x", "h"), mm_cache_dir=3), r"ready\.mm_cache_dir"),
    (_stats(engine={**EngineCounters().to_map(), "generation_tokens": 1}),
     r"worker_stats\.engine: unknown fields \['generation_tokens'\]"),
    (_stats(encoder={k: v for k, v in EncoderCounters().to_map().items() if k != "num_images"}),
     r"worker_stats\.encoder: missing field 'num_images'"),
    (_stats(encoder={**EncoderCounters().to_map(), "encode_seconds_sum": "1"}),
     r"worker_stats\.encoder\.encode_seconds_sum: expected float"),
    (_stats(encoder={**EncoderCounters().to_map(), "forward_seconds": [0.5, 1, 2]}),
     r"worker_stats\.encoder\.forward_seconds: expected \[sum >= 0, 17 counts >= 0\]"),
    (_stats(encoder={**EncoderCounters().to_map(), "batch_images": [1.0] + [-1] * 9}),
     r"worker_stats\.encoder\.batch_images: expected"),
    (_stats(role="combined"), r"worker_stats\.role: expected one of"),
])
def test_unusable_fields_raise_wire_error_at_decode(frames, match):
    with pytest.raises(WireError, match=match):
        decode_message(frames)


def test_every_sampling_field_crosses_the_wire():
    names = {f.name for f in fields(SamplingParams)}
    assert set(sampling_to_map(SAMPLING)) == names
    # SAMPLING differs from the defaults everywhere, so test_round_trip sees each field arrive
    assert [n for n in names if getattr(SAMPLING, n) == getattr(SamplingParams(), n)] == []
    out = decode_message(PrefillRequest("r", [1], [], SAMPLING, [], None).to_wire())
    assert out.sampling == SAMPLING and out.sampling is not SAMPLING


@pytest.mark.parametrize("lora", [["sql", 0, "/a"], ["sql", 1], ["", 1, "/a"], "sql", ["sql", 1, 2]])
def test_a_bad_adapter_on_the_wire_is_refused_naming_the_field(lora):
    frames = [bytes(f) for f in PrefillRequest("r", [1], [], SAMPLING, [], None).to_wire()]
    with pytest.raises(WireError, match="prefill_request.lora"):
        decode_message(_with(frames, lora=lora))
    update = [bytes(f) for f in LoRAUpdate(LoRARequest("sql", 1, "/a"), True).to_wire()]
    with pytest.raises(WireError, match="lora_update.lora"):
        decode_message(_with(update, lora=lora))


def test_every_counter_crosses_the_wire():
    engine, encoder = EngineCounters(1, 2, 3, 4, 5, 6.5), _busy_encoder()
    assert set(engine.to_map()) == {f.name for f in fields(EngineCounters)}
    assert set(encoder.to_map()) == {f.name for f in fields(EncoderCounters)}
    out = decode_message(WorkerStats("w", "aggregated", 0, 0, 1, 1, 0, engine, encoder).to_wire())
    assert (out.engine, out.encoder) == (engine, encoder)


# --- bounded fuzz: whatever arrives, decoding raises WireError or succeeds ------------------

_plain = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats() | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)
_tags = st.sampled_from(sorted(MESSAGE_TYPES) + ["bogus"])
_meta = st.one_of(
    st.integers(-1, 64),
    st.fixed_dictionaries({"dtype": st.sampled_from(["float32", "bfloat16", "int64", "uint8", "x"]),
                           "shape": st.lists(st.integers(-1, 8), max_size=4)}),
    _plain,
)


@st.composite
def _structured(draw):
    """Headers that look right (real tag, version, plausible fields) with random values."""
    tag = draw(_tags)
    fields = draw(st.dictionaries(st.sampled_from(
        ["request_id", "mm_hash", "reply_to", "ok", "error", "grid_thw", "token_ids", "finished",
         "prompt_token_ids", "mm_spans", "sampling", "eos_token_ids", "request_ids", "engine", "encoder",
         "first_token_id", "logprobs", "decode_worker", "inbox", "host", "mm_cache_dir", "worker_id", "role"]),
        _plain, max_size=10))
    metas = draw(st.lists(_meta, max_size=3))
    header = {"type": tag, "v": draw(st.sampled_from([1, 1, 1, 0, 2, "1"])), "frames": metas,
              **fields}
    payload = draw(st.lists(st.binary(max_size=64), min_size=len(metas), max_size=len(metas) + 1))
    return [_pack(header), *payload]


@st.composite
def _mutated(draw):
    """A valid message with one frame truncated, extended or bit-flipped, or frames dropped."""
    frames = [bytes(f) for f in draw(st.sampled_from(make_messages())).to_wire()]
    i = draw(st.integers(0, len(frames) - 1))
    op = draw(st.sampled_from(["truncate", "extend", "flip", "drop", "add"]))
    if op == "truncate":
        frames[i] = frames[i][:draw(st.integers(0, max(0, len(frames[i]) - 1)))]
    elif op == "extend":
        frames[i] += draw(st.binary(min_size=1, max_size=8))
    elif op == "flip" and frames[i]:
        j = draw(st.integers(0, len(frames[i]) - 1))
        flipped = bytes([frames[i][j] ^ draw(st.integers(1, 255))])
        frames[i] = frames[i][:j] + flipped + frames[i][j + 1:]
    elif op == "drop":
        del frames[i]
    else:
        frames.insert(i, draw(st.binary(max_size=16)))
    return frames


_frames = st.one_of(st.lists(st.binary(max_size=64), max_size=4), _structured(), _mutated())


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_frames)
def test_fuzz_decode_never_raises_anything_but_wire_error(frames):
    try:
        msg = decode_message(frames)
    except WireError:
        return
    assert isinstance(msg, Message)
    decode_message(msg.to_wire())  # what decodes re-encodes
