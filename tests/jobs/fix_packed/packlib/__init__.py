"""A small packed-sequence trainer laid out like a framework: data collation in one module, the
attention layer in another, the loop in a third."""
