"""Write a synthetic torch.profiler (Kineto) Chrome trace of about --mb megabytes.

usage: python bench/synth_trace.py OUT.json[.gz] [--mb 1024] [--rank 0] [--seed 0]

The layout and fields are Kineto's (as torch 2.11 writes them; compare
tests/data/h200-gpu-pathologies/*/trace/0.json.gz): a header (schemaVersion,
deviceProperties, distributedInfo, baseTimeNanoseconds), then traceEvents with one
multi-line object per event: per operator a python_function event (Python id / parent id),
a cpu_op, a cudaLaunchKernel cuda_runtime event, its kernel on a GPU stream (grid, block,
correlation), and the ac2g flow pair; a ProfilerStep#N cpu_op per step; metadata ('M') and
instant ('i') events at the end, then traceName. Deterministic for a seed.
"""

import argparse
import gzip
import os
import random
import sys

BASE_NS = 1_800_000_000_000_000_000
OPS = [
    "aten::mm",
    "aten::add_",
    "aten::mul",
    "aten::_softmax",
    "aten::layer_norm",
    "aten::copy_",
    "aten::addmm",
    "aten::gelu",
    "aten::native_dropout",
    "aten::sum",
]
KERNELS = [
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1",
    "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>>",
    "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float>",
    "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::func_wrapper_t>>",
]

HEADER = """{
  "schemaVersion": 1,
  "deviceProperties": [
    {
      "id": 0, "name": "NVIDIA H200", "totalGlobalMem": 150109880320,
      "computeMajor": 9, "computeMinor": 0,
      "maxThreadsPerBlock": 1024, "maxThreadsPerMultiprocessor": 2048,
      "regsPerBlock": 65536, "warpSize": 32,
      "sharedMemPerBlock": 49152, "numSms": 132
    , "regsPerMultiprocessor": 65536, "sharedMemPerBlockOptin": 232448, "sharedMemPerMultiprocessor": 233472
    }
  ],
  "distributedInfo": {"backend": "nccl", "rank": %(rank)d, "world_size": 8, "pg_count": 1, "pg_config": [], "nccl_version": "2.28.3"},
  "record_shapes": 1,
  "with_stack": 1,
  "cuda_driver_version": 13000,
  "cuda_runtime_version": 13000,
  "cupti_version": 130001,
  "displayTimeUnit": "ms",
  "baseTimeNanoseconds": %(base)d,
  "traceEvents": [
"""

PY = """  {
    "ph": "X", "cat": "python_function", "name": "torch/nn/modules/linear.py(125): forward", "pid": %(pid)d, "tid": %(pid)d,
    "ts": %(ts).3f, "dur": %(dur).3f,
    "args": {
      "Python parent id": %(parent)d, "Python id": %(pyid)d, "Python thread": 0, "Ev Idx": %(ev)d
    }
  },
"""
OP = """  {
    "ph": "X", "cat": "cpu_op", "name": "%(op)s", "pid": %(pid)d, "tid": %(pid)d,
    "ts": %(ts).3f, "dur": %(dur).3f,
    "args": {
      "External id": %(ext)d,"Record function id": 0, "Sequence number": %(seq)d, "Fwd thread id": 0, "Ev Idx": %(ev)d, "Input Dims": [[4096, 4096], [4096, 4096]], "Input type": ["c10::BFloat16", "c10::BFloat16"]
    }
  },
"""
LAUNCH = """  {
    "ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": %(pid)d, "tid": %(pid)d,
    "ts": %(ts).3f, "dur": %(dur).3f,
    "args": {
      "External id": %(ext)d, "cbid": 211, "correlation": %(corr)d
    }
  },
  {
    "ph": "s", "id": %(corr)d, "pid": %(pid)d, "tid": %(pid)d, "ts": %(ts).3f,
    "cat": "ac2g", "name": "ac2g"
  },
"""
KERNEL = """  {
    "ph": "X", "cat": "kernel", "name": "%(kernel)s", "pid": 0, "tid": 7,
    "ts": %(ts).3f, "dur": %(dur).3f,
    "args": {
      "External id": %(ext)d,
      "queued": 0, "device": 0, "context": 1,
      "stream": 7, "correlation": %(corr)d,
      "registers per thread": 128,
      "shared memory": 65536,
      "blocks per SM": 0.969697,
      "warps per SM": 7.757576,
      "grid": [128, 1, 1],
      "block": [256, 1, 1],
      "est. achieved occupancy %%": 12
    }
  },
  {
    "ph": "f", "id": %(corr)d, "pid": 0, "tid": 7, "ts": %(ts).3f,
    "cat": "ac2g", "name": "ac2g", "bp": "e"
  },
"""
STEP = """  {
    "ph": "X", "cat": "user_annotation", "name": "ProfilerStep#%(step)d", "pid": %(pid)d, "tid": %(pid)d,
    "ts": %(ts).3f, "dur": %(dur).3f,
    "args": {
      "External id": %(ext)d,"Record function id": 0, "Ev Idx": %(ev)d
    }
  },
"""
TAIL = """  {
    "name": "process_name", "ph": "M", "ts": %(ts).3f, "pid": %(pid)d, "tid": 0,
    "args": {
      "name": "python"
    }
  },
  {
    "name": "Record Window End", "ph": "i", "s": "g",
    "pid": "", "tid": "", "ts": %(ts).3f
  }
  ],
  "traceName": "synthetic.json"
}
"""


def write_trace(path, mb=1024, rank=0, seed=0, ops_per_step=2000):
    rng = random.Random(seed)
    target = int(mb * 1e6)
    opener = gzip.open if path.endswith(".gz") else open
    pid = 4242 + rank
    written = 0
    ts = 5_137_312_600_000.0  # µs, relative to baseTimeNanoseconds as Kineto writes it
    ev = ext = corr = pyid = 0
    step = 0
    events = 0
    with opener(path, "wt", encoding="utf-8") as f:
        head = HEADER % {"rank": rank, "base": BASE_NS}
        f.write(head)
        written += len(head)
        while written < target:
            step_start = ts
            parts = []
            for i in range(ops_per_step):
                op = OPS[i % len(OPS)]
                dur = rng.uniform(8, 40)
                pyid += 1
                ev += 1
                ext += 1
                corr += 1
                v = {
                    "pid": pid,
                    "ts": ts,
                    "dur": dur + 6,
                    "parent": max(0, pyid - 1 - i % 3),
                    "pyid": pyid,
                    "ev": ev,
                    "op": op,
                    "ext": ext,
                    "seq": i,
                    "corr": corr,
                    "kernel": KERNELS[i % len(KERNELS)],
                }
                parts.append(PY % v)
                parts.append(OP % dict(v, ts=ts + 1, dur=dur + 4))
                parts.append(LAUNCH % dict(v, ts=ts + 2, dur=dur))
                parts.append(KERNEL % dict(v, ts=ts + 50, dur=dur * 3))
                ts += dur + 8
                events += 6
            parts.append(
                STEP
                % {
                    "step": step,
                    "pid": pid,
                    "ts": step_start,
                    "dur": ts - step_start,
                    "ext": ext + 1,
                    "ev": ev + 1,
                }
            )
            step += 1
            chunk = "".join(parts)
            f.write(chunk)
            written += len(chunk)
        tail = TAIL % {"ts": ts, "pid": pid}
        f.write(tail)
    return {
        "path": path,
        "bytes_uncompressed": written + len(tail),
        "events": events + 2 + step,
        "steps": step,
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--mb", type=float, default=1024)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    info = write_trace(a.out, a.mb, a.rank, a.seed)
    print(info)
    return 0


if __name__ == "__main__":
    sys.exit(main())
