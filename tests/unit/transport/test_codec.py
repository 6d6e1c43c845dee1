import pytest
import torch

from epd.transport.wire.codec import WireError, decode_tensor, encode_tensor, pack_header, unpack_header


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int64,
                                   torch.int32, torch.uint8, torch.bool, torch.float64])
@pytest.mark.parametrize("shape", [(3, 5), (0,), (2, 0, 4), (), (1, 2, 3, 4, 5)])
def test_tensor_round_trip(dtype, shape):
    t = (torch.randn(shape) * 100).to(dtype)
    meta, buf = encode_tensor(t)
    assert meta == {"dtype": str(dtype).removeprefix("torch."), "shape": list(shape)}
    assert buf.nbytes == t.numel() * t.element_size()
    for wire in (bytes(buf), bytearray(buf), buf):
        out = decode_tensor(meta, wire)
        assert out.dtype == dtype and out.shape == t.shape and torch.equal(out, t)


def test_bf16_bits_survive_exactly():
    t = torch.tensor([1.0, -0.0, float("inf"), 3.140625, 1e-38]).to(torch.bfloat16)
    out = decode_tensor(*encode_tensor(t))
    assert torch.equal(out.view(torch.int16), t.view(torch.int16))


def test_encode_is_zero_copy_and_decode_of_writable_buffer_aliases():
    t = torch.arange(8, dtype=torch.float32)
    meta, buf = encode_tensor(t)
    t[0] = 99.0
    assert decode_tensor(meta, bytes(buf))[0] == 99.0  # the memoryview aliases the tensor
    backing = bytearray(bytes(buf))
    out = decode_tensor(meta, backing)
    backing[0:4] = torch.tensor([7.0]).numpy().tobytes()
    assert out[0] == 7.0  # the tensor aliases the received buffer


def test_non_contiguous_tensor_is_made_contiguous():
    t = torch.randn(4, 6).t()
    meta, buf = encode_tensor(t)
    assert torch.equal(decode_tensor(meta, buf), t)


@pytest.mark.parametrize("meta, nbytes", [
    ({"dtype": "float32", "shape": [2, 2]}, 15),           # truncated
    ({"dtype": "float32", "shape": [2, 2]}, 17),           # too long
    ({"dtype": "complex64", "shape": [1]}, 8),             # unknown dtype
    ({"dtype": 3, "shape": [1]}, 4),
    ({"dtype": "float32", "shape": [-1]}, 4),
    ({"dtype": "float32", "shape": [1.0]}, 4),
    ({"dtype": "float32", "shape": [True]}, 4),
    ({"dtype": "float32", "shape": "2"}, 8),
    ({"dtype": "float32", "shape": [1] * 17}, 4),
    ({"dtype": "float32", "shape": [0, 2**64]}, 0),
    ({"dtype": "float32", "shape": [2**40, 2**40]}, 4),
    ({"shape": [1]}, 4),
    ([1], 4),
])
def test_bad_tensor_meta_raises_wire_error(meta, nbytes):
    with pytest.raises(WireError):
        decode_tensor(meta, b"\0" * nbytes)


def test_non_buffer_frame_raises_wire_error():
    with pytest.raises(WireError):
        decode_tensor({"dtype": "uint8", "shape": [1]}, 5)


@pytest.mark.parametrize("data", [b"", b"\xc1", b"\x92\x01\x02", b"\x81\x01\x02", b"\xa3ab",
                                  b"\x93\x01"])
def test_bad_header_raises_wire_error(data):
    with pytest.raises(WireError):
        unpack_header(data)


def test_header_round_trip():
    header = {"type": "x", "v": 1, "nested": {"a": [1, 2.5, None, b"raw"]}}
    assert unpack_header(pack_header(header)) == header
