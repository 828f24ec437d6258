"""The memory family: memory growth and leaks, the caching allocator."""
