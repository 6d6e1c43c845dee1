"""EngineCore's verbs on the tiny checkpoint: KV handed from a prefill engine to a
decode engine gives the combined engine's tokens; image embeddings live as long
as a request uses them; bad or early KV is refused without side effects."""
from __future__ import annotations

import pytest
import torch
from testkit.media import image_bytes, image_part

from epd.encoders.image_io import read_image_size
from epd.engine.config import EngineConfig
from epd.engine.engine_core import EngineCore, StepFailed
from epd.engine.request import Request
from epd.transport.embedding_cache.mm_entry import MMEntry
from epd.transport.wire.sampling import SamplingParams
from epd.inputs.prompt import ImageRef

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def llm(tiny_model):
    from epd import LLM

    return LLM(tiny_model, num_kv_blocks=64, dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def image_prompt(llm):
    """(token ids, spans, {mm_hash: MMEntry}) of a chat prompt with one image."""
    data = image_bytes(64, 48, seed=3)
    ref = ImageRef(*read_image_size(data), llm.encoder.mm_hash(data))
    prompt = llm.inputs.prompts.build([{"role": "user", "content": [image_part(data), {"type": "text", "text": "Hi"}]}],
                               [ref])
    [entry] = llm.encoder.encode([data])
    return prompt.token_ids, prompt.mm_spans, {ref.mm_hash: entry}


def make_core(tiny_model, role: str, num_kv_blocks: int = 64, block_size: int = BLOCK_SIZE) -> EngineCore:
    config = EngineConfig.from_flat(num_kv_blocks=num_kv_blocks, block_size=block_size, dtype="float32", device="cpu")
    return EngineCore(tiny_model, config, role=role)


def run_to_end(core: EngineCore) -> list:
    updates = []
    while core.has_unfinished():
        updates += core.step().updates
    return updates


def test_kv_from_a_prefill_engine_decodes_like_the_combined_engine(llm, tiny_model, image_prompt):
    token_ids, spans, embeddings = image_prompt
    [mm_hash] = embeddings
    combined = llm.engine
    combined.add_request(Request("c", list(token_ids), GREEDY, mm_spans=list(spans)), embeddings)
    expected = [t for u in run_to_end(combined) for t in u.new_token_ids]
    assert len(expected) == GREEDY.max_tokens

    prefill, decode = make_core(tiny_model, "prefill"), make_core(tiny_model, "decode")
    prefill.add_request(Request("r", list(token_ids), GREEDY, mm_spans=list(spans)), embeddings)
    [update] = run_to_end(prefill)
    assert update.is_prefilled and update.new_token_ids == expected[:1]
    k, v = prefill.export_kv("r")
    num_blocks = -(-len(token_ids) // BLOCK_SIZE)
    info = prefill.info
    assert k.shape == v.shape == (info.num_layers, num_blocks, BLOCK_SIZE, info.num_kv_heads, info.head_dim)
    assert k.device.type == "cpu" and k.abs().sum() > 0
    assert prefill.get_embedding(mm_hash) is not None  # held until the KV is acknowledged

    request = Request("r", list(token_ids), GREEDY, mm_spans=list(spans), eos_token_ids=info.eos_token_ids)
    request.output_token_ids.append(update.new_token_ids[0])
    assert decode.add_prefilled(request, k, v)
    assert decode.num_free_blocks() == decode.num_blocks - num_blocks
    decoded = [t for u in run_to_end(decode) for t in u.new_token_ids]
    assert update.new_token_ids + decoded == expected  # M-RoPE of the image carried by the spans

    assert prefill.release("r") and not prefill.release("r")
    assert prefill.num_free_blocks() == prefill.num_blocks
    prefill.step()  # the next step drops the image
    assert prefill.get_embedding(mm_hash) is None


def test_add_prefilled_refuses_bad_kv_and_waits_for_room(tiny_model):
    decode = make_core(tiny_model, "decode", num_kv_blocks=4)
    info = decode.info

    def prefilled(request_id: str, num_tokens: int, block_size: int = BLOCK_SIZE):
        request = Request(request_id, list(range(10, 10 + num_tokens)), GREEDY)
        request.output_token_ids.append(5)
        shape = (info.num_layers, -(-num_tokens // block_size), block_size, info.num_kv_heads, info.head_dim)
        return request, torch.randn(shape), torch.randn(shape)

    request, k, v = prefilled("other-block-size", 40, block_size=8)
    with pytest.raises(ValueError, match="do not fit this KV cache"):
        decode.add_prefilled(request, k, v)
    request, k, v = prefilled("short-kv", 40)
    with pytest.raises(ValueError, match="do not fit"):
        decode.add_prefilled(request, k[:, :2], v[:, :2])  # 40 tokens need 3 blocks
    assert decode.num_free_blocks() == 4 and not decode.has_unfinished()

    first, k1, v1 = prefilled("first", 40)
    assert decode.add_prefilled(first, k1, v1)
    second, k2, v2 = prefilled("second", 20)
    assert not decode.add_prefilled(second, k2, v2)  # 1 block free, needs 2: retry later
    assert second.block_ids == [] and decode.num_free_blocks() == 1
    assert decode.abort(["first"]) == ["first"]
    assert decode.add_prefilled(second, k2, v2)


def test_an_image_lives_while_a_request_uses_it(llm, image_prompt):
    token_ids, spans, embeddings = image_prompt
    [mm_hash] = embeddings
    core = llm.engine
    core.step()  # drops whatever an earlier test's requests left
    assert core.get_embedding(mm_hash) is None
    with pytest.raises(ValueError, match="no embeddings"):
        core.add_request(Request("none", list(token_ids), GREEDY, mm_spans=list(spans)))
    assert not core.has_unfinished()

    core.add_request(Request("a", list(token_ids), GREEDY, mm_spans=list(spans)), embeddings)
    core.step()
    # A second request for the same image needs no embeddings: the engine holds them.
    core.add_request(Request("b", list(token_ids), GREEDY, mm_spans=list(spans)))
    assert core.get_embedding(mm_hash) is embeddings[mm_hash]
    assert core.abort(["a"]) == ["a"]
    core.step()
    assert core.get_embedding(mm_hash) is not None  # still b's
    run_to_end(core)
    core.step()
    assert core.get_embedding(mm_hash) is None
    assert core.num_free_blocks() == core.num_blocks


def test_a_failing_step_fails_its_requests_and_the_engine_serves_on(tiny_model, image_prompt):
    """An image embedding of the wrong width (an encoder of another model sending
    its tensors inline) fails the merge inside the step: the step's request is
    aborted, its blocks freed, and the next request runs as on a fresh engine."""
    core = make_core(tiny_model, "pd")
    expected = make_core(tiny_model, "pd")
    expected.add_request(Request("ref", [1, 2, 3, 4], GREEDY))
    expected_tokens = [t for u in run_to_end(expected) for t in u.new_token_ids]

    token_ids, spans, embeddings = image_prompt
    [(mm_hash, entry)] = embeddings.items()
    wrong = MMEntry(torch.zeros(entry.embeddings.shape[0], entry.embeddings.shape[1] + 3),
                    {k: torch.zeros(entry.embeddings.shape[0], entry.embeddings.shape[1] + 3) for k in entry.extras},
                    entry.meta)
    core.add_request(Request("bad", list(token_ids), GREEDY, mm_spans=list(spans)), {mm_hash: wrong})
    with pytest.raises(StepFailed) as failed:
        core.step()
    assert failed.value.request_ids == ["bad"]
    assert not core.has_unfinished() and core.num_free_blocks() == core.num_blocks
    core.add_request(Request("good", [1, 2, 3, 4], GREEDY))
    assert [t for u in run_to_end(core) for t in u.new_token_ids] == expected_tokens


def test_the_inbox_takes_a_whole_prompts_kv_and_nothing_much_larger(tiny_model):
    """transport/wire/frame_limits.py: an engine worker's inbox cap covers the KV of a
    --max-model-len prompt exported by a real prefill core, in float32."""
    from epd.engine.worker.loop import inbox_frame_bytes
    from epd.transport.wire.frame_limits import HEADER_MAX_BYTES, MARGIN_BYTES

    core = make_core(tiny_model, "prefill")
    info = core.info
    max_len = core.config.resolved_max_model_len(info.max_model_len)
    kv_bytes = info.num_layers * -(-max_len // BLOCK_SIZE) * BLOCK_SIZE * info.num_kv_heads * info.head_dim * 4
    assert inbox_frame_bytes(core) == max(HEADER_MAX_BYTES, kv_bytes, max_len * info.hidden_size * 4) + MARGIN_BYTES
    assert inbox_frame_bytes(core) >= kv_bytes


def test_a_decode_engine_out_of_blocks_never_recomputes_an_image_request(tiny_model, image_prompt):
    """A decode engine has no embeddings for a request prefilled elsewhere. With
    KV for just the two prompts it must preempt: it gives way with the text
    request (recomputed here), and both decode exactly as on a roomy engine."""
    token_ids, spans, embeddings = image_prompt
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    block_size = 4
    prefill = make_core(tiny_model, "prefill", block_size=block_size)

    def transferred() -> list[tuple[Request, torch.Tensor, torch.Tensor]]:
        """The text request (it arrives first), then the image one, as a prefill engine hands them over."""
        requests = [Request("text", list(range(100, 120)), greedy),
                    Request("image", list(token_ids), greedy, mm_spans=list(spans))]
        prefill.add_request(requests[0])
        prefill.add_request(requests[1], embeddings)
        first = {u.request_id: u.new_token_ids[0] for u in run_to_end(prefill)}
        out = []
        for r in requests:
            k, v = prefill.export_kv(r.request_id)
            assert prefill.release(r.request_id)
            request = Request(r.request_id, r.prompt_token_ids, greedy, mm_spans=r.mm_spans,
                              eos_token_ids=prefill.info.eos_token_ids)
            request.output_token_ids.append(first[r.request_id])
            out.append((request, k, v))
        return out

    def decoded(num_kv_blocks: int) -> tuple[dict[str, list[int]], int]:
        decode = make_core(tiny_model, "decode", num_kv_blocks=num_kv_blocks, block_size=block_size)
        requests = transferred()
        for request, k, v in requests:
            assert decode.add_prefilled(request, k, v)
        run_to_end(decode)
        assert decode.num_free_blocks() == decode.num_blocks
        return {r.request_id: r.output_token_ids for r, _, _ in requests}, decode.stats()["num_preemptions"]

    expected, num_preemptions = decoded(num_kv_blocks=64)
    assert num_preemptions == 0 and all(len(t) == greedy.max_tokens for t in expected.values())
    num_prompt_blocks = -(-20 // block_size) + -(-len(token_ids) // block_size)
    tokens, num_preemptions = decoded(num_kv_blocks=num_prompt_blocks)  # full once both are in
    assert num_preemptions > 0
    assert tokens == expected
