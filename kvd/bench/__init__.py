"""`kvd bench`: kvd against the in-process designs it replaces, on the same bytes, as ratios.

Every scenario runs its contenders alternately in one process tree on one machine (this
process, a P daemon, a D daemon and a raw-NIXL helper) and reports medians and ratios:

1. `dataplane`: one request's KV between two regions: memcpy, raw NIXL per-block and
   coalesced (two processes, like a connector's), kvd push and pull through two daemons.
2. `control`: 1 MiB requests one at a time (p50/p99/p99.9), and `drain_events()` cost;
   the stage trace of one push and one pull (where the time goes, from the daemons'
   stage traces), and the CPU of an idle daemon.
3. `scale`: 1,000 concurrent requests with zero loss, 10,000 live leases, one heartbeat
   renewing 1,000 ids, and the lease table at 1k/10k/100k leases.
4. `ec`: a 4.5 MB encoder output, cold (vs raw NIXL) and warm (vs memcpy).
5. `topology`: heterogeneous TP (8->4, 4->8) against equal TP on the same bytes, and a
   256 MiB NHD->HND layout conversion against a memcpy.
6. `layerwise`: a simulated 32-layer prefill; when D is ready after the last layer's
   compute, with layer-wise push and with whole-request push.
7. `tiers`: KV tiers in a daemon of their own: a 1,000-key lookup batch at 1k and 100k
   blocks held, a 64 MiB request stored and loaded through the host tier (vs memcpy),
   and loaded from the disk tier (vs buffered reads of the same files).
8. `gpu` (only where torch sees a CUDA GPU; skipped, saying why, elsewhere): device<->host
   copies (pageable, page-locked), host staging of GPU KV tensors (chunked vs plain path),
   and a kvd push into a GPU region (CUDA IPC), in absolute GB/s.

Targets are reported met or missed; nothing here asserts a timing. The entry point is
`kvd.bench.runner.run_bench`; this package imports nothing itself, so that the raw-NIXL
helper process (`python -m kvd.bench.raw`) starts light.
"""

SCENARIOS = ("dataplane", "control", "scale", "ec", "topology", "layerwise", "tiers", "gpu")
