"""Thin client for the kvd daemon: the wire schema and a ZMQ IPC client.

Depends on pyzmq and msgpack only; never imports the daemon.
"""

__version__ = "0.1.0"
