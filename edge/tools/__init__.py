"""Measuring tools built on the runtime: edge-bench, edge-profile, the soak and load tests, the memory probe, and
the peer runtimes edge-bench compares against."""
