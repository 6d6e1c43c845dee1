"""The process plane: starting, watching, scaling and stopping the processes of
`epd serve` (the requests they carry are epd/serve/'s).

launcher.py          `epd serve`: start the workers, wait for them, serve HTTP, drain on SIGTERM
deployment.py        one deployment builder for every front end
worker_launches.py   the workers of a local deployment, one `WorkerLaunch` each
worker_entry.py      one entry function per worker process: `run_worker(WorkerLaunch)`
supervisor.py        the interface every worker plane offers: keep the workers up
local_supervisor.py  the workers as child processes of the launcher
ray_cluster.py       `--cluster ray`: the workers in Ray actors
ray_config.py        `--cluster ray`: where the workers go (plain data, no Ray import)
autoscale.py         when to add or remove an encoder (`--encoders MIN-MAX`)
encoder_pool.py      carrying out the autoscaler's decisions
api_servers.py       `--api-servers N`: N API processes behind one port
http_server.py       the HTTP app's settings for each API process
threads.py           how many torch threads each worker runs, and how they wait
heap.py              the start-up heap, kept out of the garbage collector's way
"""
