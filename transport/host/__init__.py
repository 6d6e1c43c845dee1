"""What the worker processes of one host share besides sockets.

core_lease.py  engine workers lend their idle cores to each other (`--core-lease`)
"""
