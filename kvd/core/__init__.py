"""Sans-IO core: plain state machines and pure functions; no IO, no clocks, no event loop."""
