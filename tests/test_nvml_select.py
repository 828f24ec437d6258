"""NVML samples the job's GPUs only: CUDA_VISIBLE_DEVICES as CUDA reads it, then the ranks'."""

import pytest

from traindx.profiler.nvml import NvmlSampler, select_gpus

# an 8 x H200 node as gpu_inventory() describes it (UUIDs in NVML's format)
NODE = [
    {
        "index": i,
        "name": "NVIDIA H200",
        "uuid": f"GPU-{i}a325467-4168-ff9e-0d8b-62d79121463{i}",
        "memory_bytes": 150754820096,
    }
    for i in range(8)
]
# a node with GPU 6 split into MIG instances
MIG_NODE = [dict(g) for g in NODE]
MIG_NODE[6]["mig_uuids"] = [
    "MIG-4f4e2c1b-9d2a-5e7f-8b3c-1a2b3c4d5e6f",
    "MIG-7a8b9c0d-1e2f-5a4b-9c8d-7e6f5a4b3c2d",
]


@pytest.mark.parametrize(
    "visible, expected",
    [
        ("2,3", [2, 3]),
        (" 5 , 1 ", [5, 1]),  # CUDA's order is the job's device order
        ("3,3", [3]),
        ("GPU-5a325467-4168-ff9e-0d8b-62d79121463" + "5", [5]),
        ("GPU-7a32", [7]),  # a unique UUID prefix, as CUDA accepts
        ("7a325467", [7]),  # ...also without the GPU- prefix
        ("0,9,1", [0]),  # 9 does not exist: CUDA hides it and what follows
        ("0,GPU-ffff,1", [0]),
        ("", []),
        ("-1", []),
        ("NoDevFiles", []),
    ],
)
def test_visible_devices_as_cuda_reads_them(visible, expected):
    chosen, why = select_gpus(NODE, visible)
    assert chosen == expected
    assert why.startswith(f"CUDA_VISIBLE_DEVICES={visible!r}")


def test_unset_means_every_gpu_of_the_node():
    chosen, why = select_gpus(NODE, None)
    assert chosen == list(range(8)) and "unset" in why


def test_ambiguous_uuid_prefix_hides_the_rest():
    chosen, why = select_gpus(NODE, "4,GPU-")  # every UUID starts with GPU-
    assert chosen == [4] and "ambiguous" in why


def test_mig_instances_sample_their_parent_gpu():
    chosen, why = select_gpus(MIG_NODE, "MIG-7a8b9c0d-1e2f-5a4b-9c8d-7e6f5a4b3c2d")
    assert chosen == [6] and "MIG instance of GPU 6" in why
    legacy = "MIG-" + NODE[2]["uuid"] + "/1/0"  # the pre-R470 form names the parent's UUID
    assert select_gpus(MIG_NODE, legacy)[0] == [2]
    assert select_gpus(MIG_NODE, "MIG-00000000-0000-0000-0000-000000000000")[0] == []


def test_ranks_devices_narrow_the_visible_set():
    # a job given GPUs 4-7 whose two ranks run on cuda:0 and cuda:2 of those
    chosen, why = select_gpus(NODE, "4,5,6,7", rank_devices=[2, 0])
    assert chosen == [4, 6] and "the ranks use devices [0, 2]" in why
    # unknown rank devices leave the visible set alone
    assert select_gpus(NODE, "4,5", rank_devices=[9])[0] == [4, 5]


def test_mixed_models_warn_about_cuda_numbering():
    node = [dict(NODE[0]), dict(NODE[1], name="NVIDIA A100-SXM4-80GB")]
    assert "CUDA_DEVICE_ORDER" in select_gpus(node, "1")[1]
    assert "CUDA_DEVICE_ORDER" not in select_gpus(node, "1", device_order="PCI_BUS_ID")[1]


def test_sampler_without_a_driver_says_why_and_runs_on(tmp_path):
    sampler = NvmlSampler(str(tmp_path / "nvml.csv"), env={"CUDA_VISIBLE_DEVICES": "0"})
    assert sampler.start() is False
    assert sampler.error.startswith("NVML unavailable") or sampler.error.startswith("NVML sampled no GPU")
    sampler.stop()
