"""A Ray Train job as users write it: a driver calls ray.init() (a local cluster, or an existing
one with --address) and TorchTrainer runs the DDP loop in worker actors that Ray starts
(torch.distributed on gloo, RANK/LOCAL_RANK/WORLD_SIZE set by Ray Train)."""
import argparse
import os
import time


def train_loop(config):
    import ray.train.torch
    import torch
    import torch.distributed as dist

    model = ray.train.torch.prepare_model(
        torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(rank)
    for step in range(config["steps"]):
        x, y = torch.randn(16, 32, generator=g), torch.randn(16, 1, generator=g)
        time.sleep(config["io_wait"])
        loss = torch.nn.functional.mse_loss(model(x), y)
        logged = loss.detach().clone()
        dist.all_reduce(logged)  # blocking on gloo: clock evidence across nodes
        loss.backward()
        opt.step()
        opt.zero_grad()
        print(f"rank {rank} step {step + 1} loss {loss.item():.4f}", flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--io-wait", type=float, default=0.3)
    p.add_argument("--address", default=None, help="an existing cluster (ray start --head)")
    p.add_argument("--storage", default=None, help="Ray Train's storage_path")
    p.add_argument("--spread", action="store_true", help="one worker per node (STRICT_SPREAD)")
    args = p.parse_args()

    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    if args.address:
        ray.init(address=args.address)
    else:
        ray.init(num_cpus=args.workers + 1, include_dashboard=False)
    trainer = TorchTrainer(
        train_loop, train_loop_config={"steps": args.steps, "io_wait": args.io_wait},
        scaling_config=ScalingConfig(num_workers=args.workers, use_gpu=False,
                                     resources_per_worker={"CPU": 1},
                                     placement_strategy="STRICT_SPREAD" if args.spread else "PACK"),
        run_config=RunConfig(storage_path=args.storage or os.path.abspath("ray_results")))
    result = trainer.fit()
    print(f"driver: done, error={result.error}", flush=True)
    ray.shutdown()


if __name__ == "__main__":
    main()
