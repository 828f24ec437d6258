import os, sys, time
import torch
w = torch.nn.Parameter(torch.ones(64, 64)); opt = torch.optim.SGD([w], lr=0.01)
x = torch.randn(16, 64)
for step in range(int(sys.argv[1])):
    loss = (x @ w).pow(2).mean(); opt.zero_grad(); loss.backward(); opt.step()
    time.sleep(0.02)
    print("step", step, flush=True)
if sys.argv[2] == "exec":
    os.execv(sys.executable, [sys.executable, __file__, "8", "stop"])
