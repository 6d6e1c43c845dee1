"""The embedding cache: content key (mm_hash) -> embeddings, one LMDB environment
per host, written by the encoders and read by the engine workers.

mm_cache.py        MMCache (LRU over LMDB, many processes) and mm_hash()
mm_cache_env.py    opening the LMDB environment; a corrupt one set aside
mm_cache_space.py  how many bytes of entries the filesystem can hold
mm_entry.py        MMEntry: one item's embeddings (and extras) and their stored bytes
"""
