"""CUDA graphs for decode steps (engine/cuda_graphs.py): which sizes are captured,
and on a GPU the same greedy tokens as eager steps, with the graphs really replayed."""
from __future__ import annotations

import pytest
import torch

from epd.engine.config import EngineConfig
from epd.engine.cuda_graphs import capture_sizes
from epd.transport.wire.sampling import SamplingParams


def test_capture_sizes_are_vllms_up_to_max_num_seqs():
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(6) == [1, 2, 4, 6]  # max_num_seqs itself: every decode step fits a graph
    assert capture_sizes(256) == [1, 2, 4, *range(8, 256, 8), 256]
    assert capture_sizes(512)[-3:] == [480, 496, 512]  # multiples of 16 from 256
    assert capture_sizes(1024) == capture_sizes(512)  # 512: vLLM's default cap
    assert capture_sizes(256, max_capture_size=20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(256, max_capture_size=0) == []


def test_the_flags_are_vllms():
    from epd.cli.engine_flags import engine_config_of

    assert engine_config_of([]) == EngineConfig()
    config = engine_config_of(["--enforce-eager", "--max-cudagraph-capture-size", "64"])
    assert (config.enforce_eager, config.max_cudagraph_capture_size) == (True, 64)
    with pytest.raises(ValueError, match="max_cudagraph_capture_size must be non-negative"):
        EngineConfig(max_cudagraph_capture_size=-1)


PROMPTS = ["Hello there, how are you?", "Count: one two three four five six", "The sky is",
           "A longer prompt about the sea, the sand and the sun, " * 6, "Why?"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("num_prompts", [3, 5])  # 3: padded to the graph of 4; 5: padded to 8
def test_graphs_give_eager_tokens(tiny_model, num_prompts):
    """float32: the graphs' fixed split counts sum in another order than eager steps, a
    difference far below any gap between two logits (bfloat16 could round it into one)."""
    from epd import LLM

    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = PROMPTS[:num_prompts]
    outputs = {}
    for eager in (True, False):
        llm = LLM(tiny_model, num_kv_blocks=64, max_num_seqs=8, dtype="float32", device="cuda", enforce_eager=eager)
        graphs = llm.engine.runner.graphs
        assert (graphs is None) == eager
        outputs[eager] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        if not eager:
            assert graphs.sizes == [1, 2, 4, 8]
            assert graphs.num_replays >= 20, "decode steps were meant to replay graphs"
        assert llm.engine.num_free_blocks() == llm.engine.num_blocks
        del llm
    assert outputs[False] == outputs[True]


class _ReplayOnCPU:
    """A stand-in for a CUDA graph where there is no GPU: capture records the forward
    call, replay runs it again on the same static buffers and writes into the captured
    output, as a replayed graph does. What it checks is ours: the static buffers, the
    padding rows, the choice of size; the graph itself is checked on a GPU."""

    capturing = None

    def __init__(self):
        self.forward, self.out = None, None

    def pool(self):
        return None

    def replay(self):
        self.out.copy_(self.forward())


@pytest.fixture
def graphs_on_cpu(monkeypatch):
    import contextlib

    from epd.engine import cuda_graphs

    @contextlib.contextmanager
    def graph(g, pool=None, stream=None):
        _ReplayOnCPU.capturing = g
        yield
        _ReplayOnCPU.capturing = None

    class Stream:
        def __init__(self, device=None):
            pass

        def synchronize(self):
            pass

    monkeypatch.setattr(torch.cuda, "CUDAGraph", _ReplayOnCPU)
    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    capture = cuda_graphs.DecodeGraphs.capture

    def recording_capture(self, sizes):
        forward = self._forward

        def record(input_ids, positions, meta):
            out = forward(input_ids, positions, meta)
            g = _ReplayOnCPU.capturing
            if g is not None:
                g.forward, g.out = (lambda: forward(input_ids, positions, meta)), out
            return out

        self._forward = record
        return capture(self, sizes)

    monkeypatch.setattr(cuda_graphs.DecodeGraphs, "capture", recording_capture)


def test_the_static_buffers_and_padding_give_eager_tokens(tiny_model, graphs_on_cpu):
    """On the CPU (the torch backend): decode steps through DecodeGraphs' buffers (3 and 5
    sequences padded to 4 and 8; 9, more than the largest size, eagerly) give the eager tokens."""
    from epd import LLM

    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = PROMPTS + ["One more line to read", "And the last one here", "Nine, in all", "Ten"]
    tokens = {}
    for graphs in (False, True):
        llm = LLM(tiny_model, num_kv_blocks=96, max_num_seqs=16, dtype="float32", device="cpu")
        if graphs:
            llm.engine.runner.capture_graphs([1, 2, 4, 8], llm.engine.max_model_len)
        tokens[graphs] = [[o.outputs[0].token_ids for o in llm.generate(prompts[:n], params)] for n in (3, 5, 9)]
        if graphs:
            assert llm.engine.runner.graphs.num_replays == 2 * 11  # 11 decode steps each for 3 and 5
    assert tokens[True] == tokens[False]
