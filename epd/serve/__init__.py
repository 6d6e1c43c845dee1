"""The request plane: the API process's side of a request, from prepared inputs to
the last token (the processes it runs on are started by epd/processes/).

orchestrator.py    a request's lifecycle: admission, the retry loop, attempts started and ended, drain
collector.py       the one reader of what workers send, and the worker faults it sees (failover)
preparer.py        a request's media and prompt made ready for the workers (`Prepared`)
placement.py       where one attempt runs, and the messages that start it there
attempt.py         one try of a request on one set of workers, and its events
attempt_stream.py  token outputs, attempt after attempt, as `Delta`s
token_order.py     token outputs put back in output order
router.py          choosing a prefill / decode worker (`--router`)
cache_aware_router.py  `--router cache_aware`: the longest cached prefix, else the least loaded; sessions
prefix_index.py    which KV blocks each engine worker holds, from its KVBlocks (cache_aware)
sent_since_stats.py  requests sent to each worker since its latest stats (the load-choosing routers)
encoder_router.py  choosing the encoder of each image or video (`--encoder-router`)
registry.py        the workers as the API sees them: addresses, roles, load, life
worker_metrics.py  Prometheus text for what the workers report
"""
