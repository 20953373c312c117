"""Moving KV blocks between workers.

- descriptor: PoolDescriptor (a pool's layout, transport and handle) and check_compatible.
- lease: LeaseTable, the prefill side's pins on blocks awaiting a pull.
- pool: allocate_pool -> LocalPool, this worker's shareable pool (torch; cupy for cuda_ipc).
- remote: open_remote_pool -> RemotePool, and pull_blocks (torch; cupy for cuda_ipc).
- nixl: the nixl transport (NIXL agent per process, one READ per pull; the nixl extra).

This package imports nothing itself, so that descriptor and lease stay torch-free.
"""
