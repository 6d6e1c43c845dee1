"""A model's positions (engine/models/positions.py): plain 1-D RoPE and M-RoPE.

On a text-only prompt M-RoPE's three rows are each the token's index, so the
1-D rule must give the same logits and tokens. The 1-D path is checked three
ways on the tiny Qwen3-VL checkpoint: its rotary layer given one row against
three, its text model against transformers' Qwen3 (a 1-D RoPE decoder with the
same weights), and whole engines (runner, chunked prefill, a draft model's
proposer) placing every token by the 1-D rule against the M-RoPE engine."""
from __future__ import annotations

import pytest
import torch
from testkit.engine_factories import cpu_llm
from unit.engine import test_cuda_graphs

from epd.engine.attention import get_backend
from epd.engine.attention.metadata import AttentionMetadata
from epd.engine.loader import load_language_model
from epd.engine.models.positions import RopePositions
from epd.families.qwen_vl.positions import MRopePositions
from epd.engine.layers.forward_batch import ForwardBatch
from epd.engine.request import Request
from epd.transport.wire.mm_span import MMSpan
from epd.transport.wire.sampling import SamplingParams

PROMPTS = [[11, 12, 13, 14, 15] * 5, list(range(500, 540)), [7, 8] * 12, [3, 901, 77, 250, 18, 640, 5]]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
graphs_on_cpu = test_cuda_graphs.graphs_on_cpu  # the fixture: CUDA graphs replayed on the CPU


def test_rope_rule_places_token_i_at_i():
    rule = RopePositions()
    positions, delta = rule.prompt_positions(5)
    assert rule.position_dims == 1 and delta == 0
    assert positions.tolist() == [[0, 1, 2, 3, 4]]
    assert rule.between(positions, delta, 5, 3, 8, "cpu").tolist() == [[3, 4, 5, 6, 7]]  # prompt, then output
    assert rule.later(torch.tensor([9, 12])).tolist() == [[9, 12]]


def test_mrope_of_a_text_prompt_is_the_1d_rule_in_every_row():
    rope, mrope = RopePositions(), MRopePositions(spatial_merge_size=2)
    positions, delta = mrope.prompt_positions(7)
    assert mrope.position_dims == 3 and delta == 0
    assert torch.equal(positions, rope.prompt_positions(7)[0].expand(3, -1))
    for start, end in ((0, 7), (2, 5), (5, 11), (8, 9)):
        assert torch.equal(mrope.between(positions, delta, 7, start, end, "cpu"),
                           rope.between(rope.prompt_positions(7)[0], 0, 7, start, end, "cpu").expand(3, -1))
    assert mrope.later(torch.tensor([9, 12])).tolist() == [[9, 12]] * 3


@pytest.fixture(scope="module")
def text_model(tiny_model):
    from transformers import AutoConfig

    return load_language_model(tiny_model, AutoConfig.from_pretrained(tiny_model), torch.float32)


def _prompt_logits(model, token_ids: list[int], positions: torch.Tensor) -> torch.Tensor:
    """One full-prompt forward on a fresh paged cache -> logits [n, vocab]."""
    n, block_size = len(token_ids), 16
    num_blocks, cfg = n // block_size + 1, model.cfg
    kv = [(torch.zeros(num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim),
           torch.zeros(num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)) for _ in range(cfg.num_layers)]
    batch = ForwardBatch(positions=positions, backend=get_backend("torch"), kv_caches=kv,
                         attn_meta=AttentionMetadata.build([n], [n], [list(range(num_blocks))], block_size))
    with torch.inference_mode():
        return model.compute_logits(model(torch.tensor(token_ids), batch))


def _qwen3_reference(tiny_model: str, cfg):
    """transformers' Qwen3ForCausalLM (plain 1-D RoPE) holding the checkpoint's language model."""
    from pathlib import Path

    from safetensors.torch import load_file
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps, max_position_embeddings=cfg.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        tie_word_embeddings=cfg.tie_word_embeddings, attention_bias=False)
    model = Qwen3ForCausalLM(config).to(torch.float32).eval()
    tensors = {}
    for path in Path(tiny_model).glob("*.safetensors"):
        for name, t in load_file(path).items():
            if name.startswith("model.language_model."):
                tensors["model." + name[len("model.language_model."):]] = t
            elif name == "lm_head.weight":
                tensors[name] = t
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    return model


def test_one_row_gives_the_three_row_logits_and_transformers_qwen3s(tiny_model, text_model):
    token_ids = PROMPTS[1] + PROMPTS[3]
    n = len(token_ids)
    one_row = _prompt_logits(text_model, token_ids, RopePositions().prompt_positions(n)[0])
    three_rows = _prompt_logits(text_model, token_ids, MRopePositions(2).prompt_positions(n)[0])
    assert torch.equal(one_row, three_rows)
    with torch.inference_mode():
        reference = _qwen3_reference(tiny_model, text_model.cfg)(torch.tensor([token_ids])).logits[0]
    torch.testing.assert_close(one_row, reference, atol=1e-4, rtol=0)
    shuffled = _prompt_logits(text_model, token_ids, RopePositions().prompt_positions(n)[0].flip(1))
    assert not torch.allclose(shuffled, one_row, atol=1e-3), "the positions must reach the rotary layer"


class _RecordingRope(RopePositions):
    """The 1-D rule, noting the rows of every positions tensor it gives."""

    def __init__(self):
        self.rows: set[int] = set()

    def between(self, *args, **kwargs) -> torch.Tensor:
        out = super().between(*args, **kwargs)
        self.rows.add(out.shape[0])
        return out

    def later(self, positions: torch.Tensor) -> torch.Tensor:
        out = super().later(positions)
        self.rows.add(out.shape[0])
        return out


@pytest.mark.parametrize("draft", [False, True])
def test_an_engine_on_1d_positions_gives_the_mrope_engines_tokens(tiny_model, tiny_draft, draft):
    """Chunked prefill (a budget of 12 tokens), decodes and, with a draft model, its catch-up
    and draft forwards: every positions tensor has one row, the tokens are M-RoPE's."""
    spec = {"method": "draft_model", "model": tiny_draft, "num_speculative_tokens": 3} if draft else None
    settings = dict(max_num_batched_tokens=12, max_num_seqs=4, speculative_config=spec)
    mrope = cpu_llm(tiny_model, **settings)
    expected = [o.outputs[0].token_ids for o in mrope.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)]
    llm = cpu_llm(tiny_model, **settings)
    rule = _RecordingRope()
    llm.engine.runner.model.positions = llm.engine.runner.positions = rule
    if draft:
        llm.engine.proposer.positions = rule
    tokens = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)]
    assert tokens == expected
    assert rule.rows == {1}
    if draft:
        assert llm.stats()["spec_decode_num_accepted_tokens"] > 0


def test_a_draft_must_place_tokens_as_its_target(tiny_model, tiny_draft):
    from epd.engine.spec.draft_model import DraftModelProposer, load_draft_model

    draft = load_draft_model(tiny_draft, tiny_model, torch.float32, "cpu")
    with pytest.raises(ValueError, match="draft model's positions have 3 rows, the target's 1"):
        DraftModelProposer(draft, 3, 8, 16, "torch", "cpu", draft.cfg.vocab_size, 2, 32, RopePositions())


def test_decode_graphs_hold_one_row_of_positions(tiny_model, graphs_on_cpu):
    """DecodeGraphs' static positions buffer has the model's rows: with the 1-D rule the
    replayed decode steps (on the CPU, as tests/unit/engine/test_cuda_graphs.py replays
    them) give the M-RoPE engine's eager tokens."""
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    expected = [o.outputs[0].token_ids for o in cpu_llm(tiny_model, max_num_seqs=4).generate(prompts, GREEDY)]
    llm = cpu_llm(tiny_model, max_num_seqs=4)
    runner = llm.engine.runner
    runner.model.positions = runner.positions = RopePositions()
    runner.capture_graphs([1, 2, 4], llm.engine.max_model_len)
    assert runner.graphs._positions.shape[0] == 1
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == expected
    assert runner.graphs.num_replays == GREEDY.max_tokens - 1  # every decode step of the four replayed


def _span(offset: int, length: int, **meta) -> MMSpan:
    return MMSpan(offset, length, "h", meta)


def test_mrope_refuses_metadata_it_cannot_place():
    """The wire checks an item's metadata by type; what it means is the family's. M-RoPE
    takes the spans the prompt builder writes and refuses, naming the span, the rest."""
    rule = MRopePositions(spatial_merge_size=2)
    chunked = [_span(3, 4, grid_thw=(1, 4, 4), second_per_grid_t=0.5),
               _span(7, 4, grid_thw=(1, 4, 4), second_per_grid_t=0.5, first_group=1)]
    rule.check_spans(chunked)
    rule.check_spans([_span(0, 8, grid_thw=(2, 4, 4))])
    for bad, why in [
        ([_span(0, 4)], "grid_thw"),  # none
        ([_span(0, 5, grid_thw=(1, 4, 4))], "grid_thw"),  # the grid is 4 tokens
        ([_span(0, 4, grid_thw=(1, 4, 4.0))], "grid_thw"),
        ([_span(0, 0, grid_thw=(0, 4, 4))], "grid_thw"),
        ([_span(0, 2, grid_thw=(1, 2, 3))], "grid_thw"),  # not a whole merged grid
        ([_span(0, 4, grid_thw=(1, 4, 4), second_per_grid_t=-0.5)], "second_per_grid_t"),
        ([_span(0, 4, grid_thw=(1, 4, 4), second_per_grid_t=float("nan"))], "second_per_grid_t"),
        ([_span(0, 4, grid_thw=(1, 4, 4), first_group=1)], "first_group"),  # continues nothing
        ([chunked[0], _span(7, 4, grid_thw=(1, 4, 4), first_group=-1)], "first_group"),
        ([chunked[0], _span(8, 4, grid_thw=(1, 4, 4), first_group=1)], "first_group"),  # a gap
    ]:
        with pytest.raises(ValueError, match=why):
            rule.check_spans(bad)
    RopePositions().check_spans([_span(0, 4)])  # 1-D RoPE reads no metadata


def test_the_engine_refuses_a_span_its_model_cannot_place(tiny_model):
    """A forged PrefillRequest's span fails that request at admission, before any step."""
    core = cpu_llm(tiny_model).engine
    with pytest.raises(ValueError, match="grid_thw"):
        core.add_request(Request("forged", [5] * 12, GREEDY, mm_spans=[_span(2, 4, grid_thw=(1, 4, 8))]), {})
    assert not core.has_unfinished()
