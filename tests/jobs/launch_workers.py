"""A hand-written launcher: starts one worker Python per rank and waits for them."""
import os
import subprocess
import sys

script, port, n = sys.argv[1], sys.argv[2], 2
procs = []
for rank in range(n):
    env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(n), LOCAL_RANK=str(rank),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    procs.append(subprocess.Popen([sys.executable, script, *sys.argv[3:]], env=env))
sys.exit(max(p.wait() for p in procs))
