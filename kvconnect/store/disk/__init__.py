"""The store server's disk tier: objects demoted from DRAM, kept in a preallocated data file with
a crash-safe index beside it, every byte checked by CRC32C on the way back (docs/store.md)."""
