"""A training loop whose Triton kernel (autotuned by Triton's own Autotuner, key=["n"]) sees a
new length every step from --retune-from on: Triton benchmarks every config again each step.
Runs on a CPU with TRITON_INTERPRET=1 (configs timed with a CPU clock)."""
import argparse
import time

import torch
import triton
import triton.language as tl


def cpu_timer(fn, quantiles=None, **kwargs):  # the interpreter has no device timer
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1000


@triton.autotune(configs=[triton.Config({"BLOCK": 32}), triton.Config({"BLOCK": 64})],
                 key=["n"], do_bench=cpu_timer)
@triton.jit
def scale_add(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(out_ptr + offs, 2 * tl.load(x_ptr + offs, mask=m) + tl.load(y_ptr + offs, mask=m),
             mask=m)


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(8)])

    def forward(self, x, n):
        a, b = torch.randn(n), torch.randn(n)
        out = torch.empty(n)
        scale_add[lambda meta: (triton.cdiv(n, meta["BLOCK"]),)](a, b, out, n)
        return self.layers(x).mean() + out.mean() * 0


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--retune-from", type=int, default=2)
    args = p.parse_args()
    model = Model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(256, 64)
    for step in range(args.steps):
        # a packed length: the same one until --retune-from, a new one every step after
        n = 96 if step < args.retune_from else 96 + 32 * (step - args.retune_from + 1)
        loss = model(x, n)
        loss.backward()
        opt.step()
        opt.zero_grad()
        print(f"step {step} n {n} loss {loss.item():.4f}", flush=True)


if __name__ == "__main__":
    main()
