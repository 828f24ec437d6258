"""traindx installed the way users install it: a built wheel, not an editable checkout.

CI installs editable, which serves the shim straight from the source tree; a wheel must carry
the `_traindx_shim` package itself or `diagnose` records nothing. The fresh venv borrows the
test venv's site-packages (torch, pandas, py-spy ...) through a .pth file, so nothing is
downloaded; traindx itself comes only from the wheel.
"""

import os
import subprocess
import sysconfig
import textwrap

import pytest
from helpers import PY, ROOT

JOB = textwrap.dedent("""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    step = torch.compile(model, backend="eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for i in range(5):
        loss = step(torch.randn(8, 16)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        print(f"step {i + 1} loss {loss.item():.4f}")
""")


def _run(cmd, **kwargs):
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, **kwargs)
    assert proc.returncode == 0, f"{cmd}\n{proc.stdout}\n{proc.stderr}"
    return proc


@pytest.mark.slow
def test_a_wheel_install_records_steps_and_compiles(tmp_path):
    wheels = tmp_path / "wheels"
    _run([PY, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels), ROOT])
    (wheel,) = wheels.glob("traindx-*.whl")

    venv = tmp_path / "venv"
    _run([PY, "-m", "venv", "--without-pip", str(venv)])
    vpy = str(venv / "bin" / "python")
    site = _run([vpy, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip()
    # torch and traindx's dependencies from the test venv; its editable traindx is not
    # activated (.pth files in a folder named by a .pth line are not executed)
    with open(os.path.join(site, "borrowed.pth"), "w") as f:
        f.write(sysconfig.get_paths()["purelib"] + "\n")
    _run([PY, "-m", "pip", "--python", vpy, "install", "-q", "--no-deps", "--no-index", str(wheel)])

    where = _run([vpy, "-c", "import traindx; print(traindx.__file__)"], cwd=tmp_path).stdout
    assert where.startswith(site), where  # the installed copy, not the source tree

    job = tmp_path / "job.py"
    job.write_text(JOB)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINDX_")}
    env["OMP_NUM_THREADS"] = "1"
    # py-spy from the test venv (a wheel install may put it elsewhere): TRAINDX_PYSPY names it
    env["TRAINDX_PYSPY"] = os.path.join(os.path.dirname(PY), "py-spy")
    proc = subprocess.run(
        [str(venv / "bin" / "diagnose"), "--out", "runs", "--", vpy, str(job)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "shim disabled" not in proc.stderr
    assert "5 steps recorded" in proc.stderr, proc.stderr

    load = _run(
        [
            vpy,
            "-c",
            textwrap.dedent("""
        import glob, sys, traindx
        run = traindx.load_run(glob.glob("runs/*")[0])
        print(len(run.steps), len(run.compiles[run.compiles["kind"] == "dynamo"]), run.ranks)
    """),
        ],
        cwd=tmp_path,
    ).stdout.split(maxsplit=2)
    assert load[0] == "5"
    assert int(load[1]) >= 1  # the torch.compile of the model
    assert load[2].strip() == "['0']"
