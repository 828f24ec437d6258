"""A Hugging Face Trainer job whose worker count comes from its own command-line flag
(`dataloader_num_workers=a.workers`), starved by a dataset that waits on storage per sample.
`--save-strategy steps --save-steps N`: the Trainer writes a checkpoint every N steps (its own
synchronous save, inside transformers), as set in the job's TrainingArguments."""
import argparse
import time

import torch
from torch.utils.data import Dataset
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments


class SlowTokens(Dataset):
    def __init__(self, n, seq_len, vocab, read_s):
        self.ids = torch.randint(0, vocab, (n, seq_len), generator=torch.Generator().manual_seed(0))
        self.read_s = read_s

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        time.sleep(self.read_s)  # a read from slow storage
        return {"input_ids": self.ids[i], "labels": self.ids[i].clone()}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--max-steps", type=int, default=16)
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--read-s", type=float, default=0.01)
    p.add_argument("--output-dir", default="hf-out")
    p.add_argument("--save-strategy", default="no")
    p.add_argument("--save-steps", type=int, default=500)
    p.add_argument("--hidden", type=int, default=32)
    a = p.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    config = LlamaConfig(vocab_size=128, hidden_size=a.hidden, intermediate_size=2 * a.hidden, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(config)
    train = SlowTokens(512, 32, config.vocab_size, a.read_s)
    args = TrainingArguments(output_dir=a.output_dir, max_steps=a.max_steps,
                             per_device_train_batch_size=8, logging_steps=1, learning_rate=1e-3,
                             report_to="none", use_cpu=True, save_strategy=a.save_strategy,
                             save_steps=a.save_steps, save_total_limit=2,
                             disable_tqdm=True, dataloader_num_workers=a.workers)
    Trainer(model=model, args=args, train_dataset=train).train()


if __name__ == "__main__":
    main()
