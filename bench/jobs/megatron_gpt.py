"""A megatron-core GPTModel trained for real: its Transformer-Engine-free local layer spec, its
model-parallel state, its DistributedDataParallel wrapper, its optimizer (`get_megatron_optimizer`)
and its schedule (`get_forward_backward_func`), with one Megatron-format log line per iteration.

  python bench/jobs/megatron_gpt.py --steps 10                      # one GPU (or CPU: --device cpu)
  torchrun --nproc-per-node 2 bench/jobs/megatron_gpt.py --steps 10 # data parallel over 2 GPUs
  python bench/jobs/megatron_gpt.py --packed --max-seqlen-as tensor # the seed case, on Megatron

`--packed` trains on packed variable-length documents through megatron-core's `PackedSeqParams`
(qkv_format "thd"). megatron-core 0.19.2 calls FA4 (`flash_attn.cute.flash_attn_varlen_func`)
only in its inference path (`Attention.flash_decode_and_prefill`, and only for flash-attn-4 >=
4.0.0b20), and its local DotProductAttention refuses packed sequences, so the training core
attention here is a small module of ours in the local spec's `core_attention` slot that calls
FA4's varlen kernel with the PackedSeqParams' cu_seqlens and max_seqlen. `--max-seqlen-as tensor`
fills `max_seqlen_q/kv` the way the seed's framework did (`cu_seqlens.diff().max()`, a 0-dim
tensor on the GPU); `int` adds the `.item()` that fixes it. `--attention sdpa` runs the packed
path through PyTorch SDPA one document at a time (for checking the plumbing without FA4 / GPU).
"""
import argparse
import os
import socket
import sys
import time
import warnings
from functools import partial

import torch

warnings.filterwarnings("ignore", message=".*Apex is not installed.*")


# The defaults make a ~0.5B-parameter model whose steps (~0.1 s on an H200) are bound by its
# GEMMs, not by kernel launches: a healthy baseline for "no finding above info".
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4, help="num_query_groups (GQA)")
    p.add_argument("--ffn", type=int, default=5632)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq-len", type=int, default=4096, help="tokens per micro-batch (packed: per pack)")
    p.add_argument("--micro-batch", type=int, default=2, help="sequences per micro-batch (unpacked)")
    p.add_argument("--micro-batches", type=int, default=2, help="micro-batches per iteration")
    p.add_argument("--packed", action="store_true", help="packed documents through PackedSeqParams (thd)")
    p.add_argument("--max-seqlen-as", choices=["tensor", "int"], default="int")
    p.add_argument("--attention", choices=["fa4", "sdpa"], default="fa4",
                   help="--packed: the core attention (fa4: flash_attn.cute varlen)")
    p.add_argument("--min-doc", type=int, default=64)
    p.add_argument("--max-doc", type=int, default=1024)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    return p.parse_args(argv)


# -- distributed ------------------------------------------------------------------------------------
def init_distributed(device):
    """torchrun sets RANK/WORLD_SIZE/MASTER_*; a plain `python` run is a world of one."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
        if "MASTER_PORT" not in os.environ:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device == "cuda":
        torch.cuda.set_device(local_rank)
    torch.distributed.init_process_group(backend="nccl" if device == "cuda" else "gloo",
                                         rank=int(os.environ["RANK"]),
                                         world_size=int(os.environ["WORLD_SIZE"]))
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    return torch.distributed.get_rank(), torch.distributed.get_world_size()


# -- the packed core attention -------------------------------------------------------------------
def packed_core_attention(backend):
    """A core-attention module for megatron-core's local spec that runs packed (thd) batches."""
    from megatron.core.transformer.module import MegatronModule

    class PackedCoreAttention(MegatronModule):
        def __init__(self, config, layer_number, attn_mask_type, attention_type,
                     attention_dropout=None, softmax_scale=None, cp_comm_type=None,
                     pg_collection=None, **kwargs):
            super().__init__(config=config)
            self.softmax_scale = softmax_scale or config.kv_channels ** -0.5
            if backend == "fa4":
                from flash_attn.cute import flash_attn_varlen_func  # the job's own import

                self.varlen = flash_attn_varlen_func

        def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                    attention_bias=None, packed_seq_params=None):
            # megatron-core hands thd tensors as [tokens, heads, head_dim]
            psp = packed_seq_params
            if psp is None or psp.qkv_format != "thd":
                raise ValueError("PackedCoreAttention runs packed (thd) batches only")
            if backend == "fa4":
                kw = {"cu_seqlens_q": psp.cu_seqlens_q, "cu_seqlens_k": psp.cu_seqlens_kv, "causal": True}
                out = self.varlen(query, key, value, max_seqlen_q=psp.max_seqlen_q, max_seqlen_k=psp.max_seqlen_kv, softmax_scale=self.softmax_scale, **kw)  # noqa: E501
                out = out[0] if isinstance(out, tuple) else out
            else:
                out = _sdpa_per_document(query, key, value, psp.cu_seqlens_q, self.softmax_scale)
            return out.reshape(out.shape[0], -1)

    return PackedCoreAttention


def _sdpa_per_document(q, k, v, cu_seqlens, scale):
    rep = q.shape[1] // k.shape[1]
    bounds = cu_seqlens.tolist()
    outs = []
    for s, e in zip(bounds[:-1], bounds[1:]):
        qs, ks, vs = (t[s:e].transpose(0, 1)[None] for t in (q, k, v))
        outs.append(torch.nn.functional.scaled_dot_product_attention(
            qs, ks.repeat_interleave(rep, 1), vs.repeat_interleave(rep, 1), is_causal=True,
            scale=scale)[0].transpose(0, 1))
    return torch.cat(outs)


# -- model, optimizer ------------------------------------------------------------------------------
def build(args):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.transformer_config import TransformerConfig

    cuda = args.device == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    config = TransformerConfig(
        num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
        num_query_groups=args.kv_heads, ffn_hidden_size=args.ffn, kv_channels=args.hidden // args.heads,
        normalization="RMSNorm", gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
        bias_dropout_fusion=False, masked_softmax_fusion=False, apply_rope_fusion=False,
        bf16=cuda, params_dtype=dtype, pipeline_dtype=dtype, use_cpu_initialization=not cuda,
    )
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    if args.packed:
        spec.submodules.self_attention.submodules.core_attention = packed_core_attention(args.attention)
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=args.vocab,
                     max_sequence_length=max(args.seq_len, args.max_doc), position_embedding_type="rope")
    if not cuda:
        # megatron-core's DDP buffers and optimizer live on the GPU (torch.cuda.current_device()):
        # on a CPU the job checks model, spec, packing and schedule with a torch optimizer
        return model, torch.optim.AdamW(model.parameters(), lr=args.lr), config
    model = model.cuda()
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                               use_distributed_optimizer=False)
    model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
    config.finalize_model_grads_func = finalize_model_grads
    opt_config = OptimizerConfig(optimizer="adam", lr=args.lr, weight_decay=0.01, clip_grad=1.0,
                                 bf16=cuda, params_dtype=dtype, use_distributed_optimizer=False)
    optimizer = get_megatron_optimizer(opt_config, [model])
    return model, optimizer, config


# -- data ----------------------------------------------------------------------------------------
def batches(args, rank, device):
    """Micro-batches of a fixed synthetic corpus (deterministic per rank): a learnable next-token
    task, so the loss falls. Packed: documents of random length laid end to end in one row."""
    gen = torch.Generator().manual_seed(args.seed + 1000 * rank)
    while True:
        if args.packed:
            lengths, left = [], args.seq_len
            while left > 0:
                n = min(left, int(torch.randint(args.min_doc, args.max_doc + 1, (1,), generator=gen)))
                lengths.append(n)
                left -= n
            total = args.seq_len
            base = torch.randint(0, args.vocab, (total + 1,), generator=gen)
            tokens = (base[:-1] % 64 + torch.arange(total) % 7)[None]
            labels = torch.roll(tokens, -1, dims=1)
            position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
            cu_seqlens = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32)
            yield {"tokens": tokens.to(device), "labels": labels.to(device),
                   "position_ids": position_ids.to(device), "cu_seqlens": cu_seqlens.to(device)}
        else:
            shape = (args.micro_batch, args.seq_len)
            tokens = (torch.randint(0, 64, shape, generator=gen) + torch.arange(args.seq_len) % 7)
            labels = torch.roll(tokens, -1, dims=1)
            position_ids = torch.arange(args.seq_len)[None].expand(shape).contiguous()
            yield {"tokens": tokens.to(device), "labels": labels.to(device),
                   "position_ids": position_ids.to(device), "cu_seqlens": None}


def packed_seq_params(cu_seqlens, max_seqlen_as):
    from megatron.core.packed_seq_params import PackedSeqParams

    max_seqlen = cu_seqlens.diff().max()  # what packing collators compute: a 0-dim tensor
    if max_seqlen_as == "int":
        max_seqlen = int(max_seqlen.item())  # the fix: one host sync per micro-batch
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                           max_seqlen_q=max_seqlen, max_seqlen_kv=max_seqlen)


def forward_step(args, data_iterator, model):
    batch = next(data_iterator)
    psp = packed_seq_params(batch["cu_seqlens"], args.max_seqlen_as) if args.packed else None
    # causal masking: DotProductAttention builds its mask on the GPU from attn_mask_type (a CPU
    # run passes it: True = masked out); thd batches get it from the varlen kernel
    mask = None
    if not args.packed and args.device == "cpu":
        n = batch["tokens"].shape[1]
        mask = torch.triu(torch.ones(1, 1, n, n, dtype=torch.bool), diagonal=1)
    output = model(batch["tokens"], batch["position_ids"], mask, labels=batch["labels"],
                   packed_seq_params=psp)
    return output, partial(loss_func, torch.ones_like(batch["labels"], dtype=torch.float32))


def loss_func(loss_mask, output_tensor):
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1)
    loss = torch.sum(losses * mask)
    tokens = mask.sum().to(torch.int)
    # (loss sum, tokens, reported): megatron-core divides by the tokens itself
    return loss, tokens, {"lm loss": torch.stack([loss.detach(), mask.sum()])}


def cpu_forward_backward(args, data, model):
    reported = []
    for _ in range(args.micro_batches):
        output, finish = forward_step(args, data, model)
        loss, tokens, report = finish(output)
        (loss / tokens.clamp(min=1) / args.micro_batches).backward()
        reported.append(report)
    return reported


def main(argv=None):
    args = parse_args(argv)
    if args.packed and args.attention == "fa4" and args.device != "cuda":
        sys.exit("megatron_gpt.py: --packed with FA4 needs a GPU (use --attention sdpa on CPU)")
    torch.manual_seed(args.seed)
    if args.device == "cpu":
        # megatron-core places some buffers with torch.cuda.current_device() (RoPE's inv_freq):
        # a CPU smoke run points that at the CPU; nothing else changes
        torch.cuda.current_device = lambda: "cpu"
    rank, world = init_distributed(args.device)
    from megatron.core.tensor_parallel import random as mp_random

    if args.device == "cuda":
        mp_random.model_parallel_cuda_manual_seed(args.seed)
    else:  # its RNG tracker keeps CUDA generator states; dropout is 0 here, so fork nothing
        import contextlib

        mp_random.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    model, optimizer, config = build(args)
    from megatron.core.pipeline_parallel.schedules import get_forward_backward_func

    forward_backward = get_forward_backward_func()
    data = batches(args, rank, args.device)
    tokens_per_mb = args.seq_len * (1 if args.packed else args.micro_batch)
    global_batch = args.micro_batches * (1 if args.packed else args.micro_batch) * world
    for it in range(1, args.steps + 1):
        start = time.perf_counter()
        if hasattr(model, "zero_grad_buffer"):
            model.zero_grad_buffer()
        optimizer.zero_grad()
        if args.device == "cuda":
            reported = forward_backward(
                forward_step_func=partial(forward_step, args), data_iterator=data, model=[model],
                num_microbatches=args.micro_batches, seq_length=args.seq_len, micro_batch_size=1,
                forward_only=False)
        else:  # megatron-core's schedule allocates on the GPU: the same steps, by hand
            reported = cpu_forward_backward(args, data, model)
        if isinstance(optimizer, torch.optim.Optimizer):  # --device cpu
            grad_norm, update_ok = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)), True
            optimizer.step()
        else:
            update_ok, grad_norm, _ = optimizer.step()
        loss_sum = torch.stack([r["lm loss"] for r in reported]).sum(0)
        if world > 1:
            torch.distributed.all_reduce(loss_sum)
        loss = float(loss_sum[0] / loss_sum[1])  # syncs: the iteration is done on the GPU
        elapsed_ms = (time.perf_counter() - start) * 1000
        if rank == 0:
            try:
                lr = float(optimizer.param_groups[0]["lr"])
            except (AttributeError, IndexError, KeyError, TypeError):
                lr = args.lr
            print(f" [{time.strftime('%Y-%m-%d %H:%M:%S')}] iteration {it:8d}/{args.steps:8d} | "
                  f"consumed samples: {it * global_batch:12d} | elapsed time per iteration (ms): "
                  f"{elapsed_ms:.1f} | learning rate: {lr:.6E} | global batch size: {global_batch:5d} | "
                  f"tokens per step: {tokens_per_mb * args.micro_batches * world} | "
                  f"lm loss: {loss:.6E} | grad norm: {float(grad_norm or 0):.3f} | "
                  f"number of skipped iterations: {0 if update_ok else 1:3d} |", flush=True)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
