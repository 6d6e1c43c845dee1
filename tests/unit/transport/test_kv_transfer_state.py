"""KVTransfer's named per-request state (a model whose layers carry state, engine/state_cache.py):
one raw frame per name after the KV (and an EAGLE-3 head's frames), the names in the header;
they round-trip, count in the transfer's bytes, and names that do not match the frames are a
WireError."""
from __future__ import annotations

import msgpack
import pytest
import torch

from epd.transport.wire.messages import KVTransfer, WireError, decode_message
from epd.transport.wire.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0)


def _kv(num_layers: int = 2) -> torch.Tensor:
    return torch.randn(num_layers, 3, 4, 2, 8)  # [layers, blocks, block_size, kv_heads, head_dim]


def _with_header(msg: KVTransfer, **changes) -> list[bytes]:
    frames = [bytes(f) for f in msg.to_wire()]
    header = msgpack.unpackb(frames[0])
    header.update(changes)
    return [msgpack.packb(header), *frames[1:]]


@pytest.mark.parametrize("draft_state", [None, (_kv(1), _kv(1), torch.randn(16))])
def test_state_frames_follow_their_names_and_count_in_the_bytes(draft_state):
    kv = _kv()
    state = {"conv.0": torch.randn(24, 3).to(torch.bfloat16), "recurrent.0": torch.randn(2, 4, 4)}
    msg = KVTransfer("r", [1], 2, GREEDY, [], [], kv, kv.clone(), draft_state=draft_state, state=state)
    frames = msg.to_wire()
    assert len(frames) == 1 + 2 + len(draft_state or ()) + 2
    assert msgpack.unpackb(frames[0])["state"] == ["conv.0", "recurrent.0"]
    for wire in ([bytes(f) for f in frames], frames):  # as zmq delivers them, and in-process
        got = decode_message(wire)
        assert list(got.state) == ["conv.0", "recurrent.0"]
        assert all(got.state[n].dtype == t.dtype and torch.equal(got.state[n], t) for n, t in state.items())
        assert (got.draft_state is None) == (draft_state is None) and torch.equal(got.k_blocks, kv)
        assert got.num_bytes == 2 * kv.nbytes + sum(t.nbytes for t in (*(draft_state or ()), *state.values()))
    assert decode_message(KVTransfer("r", [1], 2, GREEDY, [], [], kv, kv.clone()).to_wire()).state == {}


def test_state_names_that_do_not_match_the_frames_are_a_wire_error():
    kv = _kv()
    two = KVTransfer("r", [1], 2, GREEDY, [], [], kv, kv.clone(), state={"a": torch.randn(4), "b": torch.randn(4)})
    for names in (["conv.0", "conv.0"], ["", "x"]):  # repeated, empty
        with pytest.raises(WireError, match="state: distinct non-empty names"):
            decode_message(_with_header(two, state=names))
    one = KVTransfer("r", [1], 2, GREEDY, [], [], kv, kv.clone(), state={"conv.0": torch.randn(4, 3)})
    with pytest.raises(WireError, match="then one per name of `state`"):  # a name without its frame
        decode_message(_with_header(one, state=["conv.0", "recurrent.0", "conv.1"]))
    with pytest.raises(WireError, match=r"kv_transfer\.state: expected list"):
        decode_message(_with_header(one, state="conv.0"))
