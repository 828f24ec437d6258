"""Packing: variable-length samples concatenated into one row, with the sequence boundaries the
varlen attention kernels need."""
import torch
import torch.nn.functional as F


def make_samples(gen, tokens, min_len, max_len, vocab):
    """Token lists whose lengths add up to `tokens`."""
    lengths = []
    while sum(lengths) < tokens:
        lengths.append(int(torch.randint(min_len, max_len + 1, (1,), generator=gen)))
    lengths[-1] -= sum(lengths) - tokens
    if lengths[-1] < 2:
        lengths[-2] += lengths.pop()
    return [torch.randint(vocab, (n + 1,), generator=gen) for n in lengths]


def collate_packed(samples):
    seqlens = torch.tensor([len(s) - 1 for s in samples], dtype=torch.int32)
    cu_seqlens = F.pad(seqlens.cumsum(0, dtype=torch.int32), (1, 0))
    max_seqlen = seqlens.max()
    return {
        "input_ids": torch.cat([s[:-1] for s in samples]),
        "labels": torch.cat([s[1:] for s in samples]),
        "position_ids": torch.cat([torch.arange(len(s) - 1) for s in samples]),
        "cu_seqlens": cu_seqlens,
        "max_seqlen": max_seqlen,
    }
