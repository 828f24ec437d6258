"""A Hugging Face Trainer job the way its documentation shows one: a tiny Llama built from a
config, a synthetic token dataset, `TrainingArguments(max_steps=...)`, `trainer.train()`.

--slow-getitem S: every sample takes S seconds to "decode" (reading from slow storage), on the
training process (dataloader_num_workers=0, the Trainer's default).
"""
import argparse
import time

import torch
from torch.utils.data import Dataset
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments


class RandomTokens(Dataset):
    def __init__(self, n, seq_len, vocab, slow_s=0.0):
        gen = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (n, seq_len), generator=gen)
        self.slow_s = slow_s

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        if self.slow_s:
            time.sleep(self.slow_s)  # decoding the sample from slow storage
        return {"input_ids": self.ids[i], "labels": self.ids[i].clone()}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--max-steps", type=int, default=8)
    p.add_argument("--slow-getitem", type=float, default=0.0)
    p.add_argument("--output-dir", default="hf-out")
    args = p.parse_args()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(config)
    train = RandomTokens(256, 32, config.vocab_size, slow_s=args.slow_getitem)
    training_args = TrainingArguments(output_dir=args.output_dir, max_steps=args.max_steps,
                                      per_device_train_batch_size=8, logging_steps=1,
                                      learning_rate=1e-3, report_to="none", use_cpu=True,
                                      save_strategy="no", disable_tqdm=True)
    trainer = Trainer(model=model, args=training_args, train_dataset=train)
    trainer.train()


if __name__ == "__main__":
    main()
