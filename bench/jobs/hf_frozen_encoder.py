"""A tiny job driven through transformers' public API: a BertForSequenceClassification built from
a small config (synthetic tokens, no download), the optimizer given only the classifier head while
the encoder (built inside transformers) keeps requires_grad=True. --healthy: the encoder frozen
(`model.bert.requires_grad_(False)`). Issue 36 item 2: the freeze is prescribed at the job's line
that builds the model, never in site-packages.

    diagnose --fix -- python bench/jobs/hf_frozen_encoder.py
"""

import sys

import torch
from transformers import BertConfig, BertForSequenceClassification

torch.manual_seed(0)
torch.set_num_threads(1)
cfg = BertConfig(
    vocab_size=512, hidden_size=128, num_hidden_layers=3, num_attention_heads=4, intermediate_size=256
)
model = BertForSequenceClassification(cfg)
if "--healthy" in sys.argv:
    model.bert.requires_grad_(False)
opt = torch.optim.AdamW(model.classifier.parameters(), lr=1e-3)
x = torch.randint(0, 512, (16, 64))
y = torch.randint(0, 2, (16,))
for i in range(30):
    out = model(input_ids=x, labels=y)
    out.loss.backward()
    opt.step()
    opt.zero_grad()
    if i % 5 == 0:
        print(f"step {i} loss {out.loss.item():.4f}", flush=True)
