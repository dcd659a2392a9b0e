"""Adapters: the few modules that touch the outside world (NIXL, shared memory, ZMQ, systemd)."""
