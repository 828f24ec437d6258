"""A Hugging Face Trainer job (a tiny BERT classifier built from a config: no download, a
synthetic dataset) with a TrainerCallback that scores the model on the whole training set the
way a job tracks a metric sklearn would compute: every --every-th step its `on_step_end`
predicts every row under no_grad and computes an accuracy and a rank AUC with a plain-Python
loop over the rows. --every 0 is the healthy twin: the same metric once, when training ends.

    python tests/jobs/fw_hf_metric_cb.py --max-steps 40 --every 5
"""
import argparse

import numpy as np
import torch
import transformers
from torch.utils.data import Dataset


class Rows(Dataset):
    def __init__(self, n, seq_len, vocab):
        gen = torch.Generator().manual_seed(0)
        self.ids = torch.randint(1, vocab, (n, seq_len), generator=gen)
        self.labels = (self.ids[:, 0] % 2).long()

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


def rank_auc(scores, labels):
    """Mann-Whitney AUC, one row at a time (what a metric library does under its API)."""
    order = sorted(range(len(scores)), key=lambda i: scores[i])
    pos = rank_sum = 0
    for rank, i in enumerate(order, start=1):
        if labels[i]:
            pos += 1
            rank_sum += rank
    neg = len(labels) - pos
    return (rank_sum - pos * (pos + 1) / 2) / max(1, pos * neg)


class WholeSetMetric(transformers.TrainerCallback):
    def __init__(self, rows, every):
        self.rows, self.every = rows, every

    def score(self, model):
        model.eval()
        with torch.no_grad():
            logits = torch.cat([model(input_ids=ids).logits for ids in self.rows.ids.split(256)])
        model.train()
        scores, labels = (logits[:, 1] - logits[:, 0]).tolist(), self.rows.labels.tolist()
        acc = float(np.mean([(s > 0) == bool(t) for s, t in zip(scores, labels)]))
        return acc, rank_auc(scores, labels)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if self.every and state.global_step % self.every == 0:
            acc, auc = self.score(model)
            print(f"step {state.global_step} train acc {acc:.3f} auc {auc:.3f}", flush=True)

    def on_train_end(self, args, state, control, model=None, **kwargs):
        if not self.every:
            acc, auc = self.score(model)
            print(f"end train acc {acc:.3f} auc {auc:.3f}", flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--max-steps", type=int, default=40)
    p.add_argument("--every", type=int, default=5, help="score the training set every N steps; 0: once at the end")
    p.add_argument("--rows", type=int, default=4096)
    p.add_argument("--output-dir", default="hf-metric-out")
    args = p.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    config = transformers.BertConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=2, max_position_embeddings=32, num_labels=2)
    model = transformers.BertForSequenceClassification(config)
    rows = Rows(args.rows, 16, config.vocab_size)
    training_args = transformers.TrainingArguments(output_dir=args.output_dir, max_steps=args.max_steps,
                                      per_device_train_batch_size=16, logging_steps=10,
                                      learning_rate=1e-3, report_to=[], use_cpu=True,
                                      save_strategy="no", disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=training_args, train_dataset=rows,
                      callbacks=[WholeSetMetric(rows, args.every)])
    trainer.train()


if __name__ == "__main__":
    main()
