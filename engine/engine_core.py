"""The engine every worker runs: scheduler + model runner, one step at a time.

    step():  schedule() -> SchedulerOutput -> runner.execute() -> scheduler.update()

Works on token ids and image embeddings only: tokenizing, detokenizing, stop
strings and the vision tower live with the caller (the offline `LLM`, a
worker process). The same object serves prefill-only, decode-only and
combined roles (see `Scheduler`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from epd.engine.config import EngineConfig
from epd.engine.kv_cache_sizer import bytes_per_block, num_kv_blocks
from epd.engine.loader import load_language_model, resolve_dtype
from epd.engine.model_info import ModelInfo
from epd.engine.model_runner import MMEmbedding, ModelRunner
from epd.engine.request import Request
from epd.engine.sampler import TokenLogprobs
from epd.engine.scheduler import Scheduler
from epd.engine.scheduler_output import RequestUpdate


@torch.inference_mode()
def profile_forward(model, config: EngineConfig, device: str) -> torch.Tensor:
    """The largest forward an engine step runs (a full token budget, logits for
    max_num_seqs rows) on a throwaway cache, so its peak activation memory is
    measured before the KV cache takes the rest of the GPU."""
    from epd.engine.attention import get_backend
    from epd.engine.attention.metadata import AttentionMetadata
    from epd.engine.models.qwen3_vl import ForwardBatch

    cfg, n, bs = model.cfg, config.scheduler.max_num_batched_tokens, config.scheduler.block_size
    blocks = n // bs + 1
    dtype = model.lm_head.weight.dtype
    cache = torch.zeros(2, cfg.num_layers, blocks, bs, cfg.num_kv_heads, cfg.head_dim, dtype=dtype, device=device)
    batch = ForwardBatch(positions=torch.zeros(3, n, dtype=torch.long, device=device),
                         attn_meta=AttentionMetadata.build([n], [n], [list(range(blocks))], bs, device=device),
                         backend=get_backend(config.resolved_backend(device)),
                         kv_caches=[(cache[0, i], cache[1, i]) for i in range(cfg.num_layers)])
    hidden = model(torch.zeros(n, dtype=torch.long, device=device), batch)
    return model.compute_logits(hidden[-min(n, config.scheduler.max_num_seqs):])  # [rows, vocab]


@dataclass
class StepResult:
    updates: list[RequestUpdate] = field(default_factory=list)
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    num_batched_tokens: int = 0
    requests: dict[str, Request] = field(default_factory=dict)  # every request run this step


class EngineCore:
    def __init__(self, model_dir: str, config: EngineConfig, role: str = "combined",
                 hf_config=None, info: ModelInfo | None = None):
        from transformers import AutoConfig

        hf_config = hf_config or AutoConfig.from_pretrained(model_dir)
        self.info = info or ModelInfo.from_pretrained(model_dir, hf_config)
        self.config = config
        self.device = config.resolved_device()
        self.dtype = resolve_dtype(config.dtype, self.info.checkpoint_dtype)
        model = load_language_model(model_dir, hf_config, self.dtype, self.device)
        block_bytes = bytes_per_block(self.info.num_layers, self.info.num_kv_heads, self.info.head_dim,
                                      config.scheduler.block_size, self.dtype)
        num_blocks = num_kv_blocks(config, block_bytes, self.device,
                                   profile_forward=lambda: profile_forward(model, config, self.device))
        sched_cfg = dataclasses.replace(config.scheduler,
                                        max_model_len=config.resolved_max_model_len(self.info.max_model_len))
        self.scheduler = Scheduler(sched_cfg, num_blocks, role=role)
        self.runner = ModelRunner(model, num_blocks, config.scheduler.block_size, self.info.spatial_merge_size,
                                  self.info.image_token_id, config.resolved_backend(self.device), self.device)
        self.num_blocks = num_blocks
        self._mm_users: dict[str, set[str]] = {}  # mm_hash -> request ids holding it

    @property
    def max_model_len(self) -> int:
        return self.scheduler.max_model_len

    def add_request(self, request: Request, mm_embeddings: dict[str, MMEmbedding] | None = None) -> None:
        """Queues a request; `mm_embeddings` must hold every image of its spans."""
        missing = [s.mm_hash for s in request.mm_spans
                   if s.mm_hash not in (mm_embeddings or {}) and s.mm_hash not in self.runner.mm_embeddings]
        if missing:
            raise ValueError(f"request {request.request_id}: no embeddings for images {missing}")
        if not request.eos_token_ids:
            request.eos_token_ids = self.info.eos_token_ids
        if request.max_model_len is None:
            request.max_model_len = self.max_model_len
        self.scheduler.add_request(request)
        for mm_hash, emb in (mm_embeddings or {}).items():
            self.runner.mm_embeddings.setdefault(mm_hash, emb)
        for span in request.mm_spans:
            self._mm_users.setdefault(span.mm_hash, set()).add(request.request_id)

    def abort(self, request_ids) -> list[str]:
        aborted = self.scheduler.abort(request_ids)
        self._release(aborted)
        return aborted

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> StepResult:
        out = self.scheduler.schedule()
        runner_out = self.runner.execute(out)
        updates = self.scheduler.update(out, runner_out.sampled_token_ids)
        self._release([u.request_id for u in updates if u.is_finished])
        return StepResult(updates, runner_out.logprobs, out.num_batched_tokens,
                          {s.request_id: s.request for s in out.scheduled})

    def _release(self, request_ids) -> None:
        """Drops image embeddings no unfinished request needs any more."""
        done = set(request_ids)
        if not done:
            return
        self.runner.drop(done)
        for mm_hash in list(self._mm_users):
            users = self._mm_users[mm_hash]
            users -= done
            if not users:
                del self._mm_users[mm_hash]
                self.runner.mm_embeddings.pop(mm_hash, None)

    def stats(self) -> dict[str, int | float]:
        return self.scheduler.stats()

    def num_free_blocks(self) -> int:
        return self.scheduler.block_manager.num_free_blocks
