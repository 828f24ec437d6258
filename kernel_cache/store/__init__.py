"""record: FA4's persistent kernel cache on disk (entries, their metadata, pack/unpack)."""
