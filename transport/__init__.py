"""Wire format and embedding cache; imports nothing else of ours.

codec.py       WireError, tensor <-> (meta, bytes), msgpack headers, typed header fields
messages.py    every wire message (dataclasses) and decode_message()
wire_values.py the values messages carry (sampling, logprobs, worker counters) and their msgpack forms
sampling.py    SamplingParams and TokenLogprobs, torch-free (the scheduler and the API use them)
mm_span.py     MMSpan, an image's placeholder run in a prompt (torch-free: the scheduler reads it)
addresses.py   the one place zmq addresses are derived from config
channels.py    typed PUSH/PULL wrappers, sync and asyncio
mm_entry.py    MMEntry and its LMDB value format
mm_cache.py    MMCache (LMDB, LRU, multi-process) and mm_hash()
checkpoint_error.py  CheckpointError, torch-free: the API's file checks and the workers' weight loading raise it
"""
