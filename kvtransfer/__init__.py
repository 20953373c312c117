"""Moving KV blocks between workers.

- transports: the one list of transports (torch-free), and what a transport module provides.
- the transports, one module each, as transports.py lists them (optional packages imported
  when used).
- descriptor: PoolDescriptor (a pool's layout, transport and handle) and check_compatible.
- lease: LeaseTable, the prefill side's pins on blocks awaiting a pull.
- pool: allocate_pool -> LocalPool, this worker's shareable pool, over its transport (torch).
- remote: open_remote_pool and pull_blocks over the pool's transport; the copies between pools
  mapped as tensors (torch).

This package imports nothing itself, so that descriptor and lease stay torch-free.
"""
