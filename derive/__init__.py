"""derive: the loaded run (RunRecord, load_run) and what is computed from it without judgement:
the time ledger, steady windows, step and GPU tables, periods, node merges, statistics and
throughput. Reads profiler/ (record) and common/; never analyzers/ (judge) or above."""
