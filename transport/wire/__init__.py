"""The worker plane's wire: every message that crosses a socket, how it is framed
and where it goes.

message.py           the base of every message, its framing and shared field checks
messages.py          the table of every message type and decode_message()
request_messages.py  a request's messages: API -> encoder -> prefill -> decode -> API
control_messages.py  registration, load reports, heartbeats, shutdown
codec.py             tensor <-> (meta, bytes), msgpack headers, typed header fields
wire_values.py       the values messages carry (sampling, logprobs, worker counters)
sampling.py          SamplingParams and TokenLogprobs, torch-free
lora_request.py      LoRARequest: which adapter a request runs with
mm_span.py           an item's placeholder run in a prompt, and a family's metadata of it
histogram.py         a histogram a worker fills and sends whole
kv_events.py         vLLM's KV cache events (EventBatch, BlockStored...) and --kv-events-config
kv_event_publisher.py  an engine worker's KV events on a PUB socket, with vLLM's replay socket
flag_json.py         a flag's JSON object (text or, from LLM(...), a mapping), read in one place
addresses.py         the one place a ZeroMQ address is built
channels.py          typed channels: the only way our code touches a socket
auth.py              CURVE keys of the worker plane
roles.py             worker roles and serving modes
frame_limits.py      how large one frame may be at each receiving end
stamped_inbox.py     an inbox read by its own thread, messages stamped on arrival
worker_io.py         what every worker process holds and does alike: inbox, outboxes, Ready
"""
