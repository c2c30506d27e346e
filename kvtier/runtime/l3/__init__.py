"""The L3 tier: page objects of the host pools written to and prefetched from a storage
backend, with TP agreement on every decision."""
