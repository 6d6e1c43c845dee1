"""Speculative decoding in the engine: a proposer drafts k tokens, the target
scores them in one forward, the verifier keeps a prefix.

    config.py           `SpeculativeConfig`: `--speculative-config`'s JSON (vLLM's keys), typed
    check.py            `check_speculative_model`: a head or draft model fits the target (no torch)
    decode.py           the scheduler's side: draft room per step, acceptance counters
    verify.py           `verify_drafts`: the accepted prefix + one token, greedy or sampled
    sampling.py         rejection sampling that keeps the target's distribution
    ngram.py            `NgramProposer`: prompt lookup, drafts from the sequence's own history
    draft_model.py      `DraftModelProposer`: a small model with the target's tokenizer drafts
    eagle3_config.py    `Eagle3Config`: an EAGLE-3 head's config.json, and whether it fits (no torch)
    eagle3.py           the EAGLE-3 head: loader and forward
    eagle3_proposer.py  `Eagle3Proposer`: the head's paged KV, catch-up and drafts in the engine
    mtp.py              a release's own MTP layers as the proposer's head (`load_mtp_head`)
"""
