"""The host family: host work in the loop, the GIL, threads, GC pauses, module hooks."""
