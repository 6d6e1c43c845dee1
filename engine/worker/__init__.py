"""The engine's process loop (vLLM's EngineCoreProc): messages in, engine steps,
messages out. The engine itself (engine/engine_core.py and below) knows no socket.

loop.py            EngineWorker: the prefill / decode / pd / aggregated worker loop
image_arrivals.py  requests waiting for their images, images waiting for their requests
kv_handover.py     KVHandover: a request's KV from the prefill to the decode worker (EngineWorker's)
"""
