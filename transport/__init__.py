"""What the processes share without depending on each other; imports nothing else of ours.

wire/             the worker plane: messages and their codec, sockets and their
                  addresses, keys, roles, frame limits, the values messages carry
embedding_cache/  the embedding cache: content key -> embeddings in LMDB, shared by
                  the encoders (writers) and the engine workers (readers) of a host
weights/          what the engine and the encoders both need to run weights: the
                  safetensors checkpoint reader, its one `CheckpointError`, LoRA
                  adapter files, the packed CPU linear
media/            torch-free media geometry the API counts tokens by and the
                  encoders resize by: images, videos, video chunks, video content keys
host/             what the workers of one host share besides sockets: the core lease
"""
