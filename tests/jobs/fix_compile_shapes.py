"""A user's job that compiles its model with torch.compile(dynamic=False) (static-shape kernels)
and feeds it batches whose sequence length changes every step (unpadded data): every new length
fails dynamo's size guard and compiles the model again (inductor, the CPU's C compiler)."""
import argparse
import os

os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")  # no compile worker pool on 2 cores

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=8)
p.add_argument("--vocab", type=int, default=64)
p.add_argument("--backend", default="inductor", help="torch.compile backend (aot_eager: no C compile)")
args = p.parse_args()


class TokenModel(nn.Module):
    def __init__(self, vocab, d=32):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.mix = nn.Linear(d, d)
        self.head = nn.Linear(d, vocab)

    def forward(self, x):
        h = self.tok(x)
        h = h + torch.tanh(self.mix(h.cumsum(1) / x.shape[1]))
        return self.head(h)


torch.manual_seed(0)
torch.set_num_threads(1)
model = TokenModel(args.vocab)
compiled = torch.compile(model, backend=args.backend, dynamic=False)
opt = torch.optim.SGD(model.parameters(), lr=0.05)
gen = torch.Generator().manual_seed(1)
for step in range(args.steps):
    length = 16 + 4 * step                      # a new sequence length every step
    x = torch.randint(args.vocab, (4, length + 1), generator=gen)
    x[:, 1:] = (x[:, :-1] * 5 + 1) % args.vocab
    logits = compiled(x[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, args.vocab), x[:, 1:].reshape(-1))
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step {step} loss {loss.item():.4f}", flush=True)
