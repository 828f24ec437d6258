"""present: the `diagnose` command line (argument adapters in commands/), the terminal and file
outputs, and the --fix runner, which runs arms and decides nothing (analyzers/ decides)."""
