"""Secrets are redacted by value as well as by name, in the manifest (env, command, options), the
report's log view and command, and the report as a whole; non-secrets survive."""

import json
import os
import textwrap

import pytest
from helpers import PY, diagnose

import traindx
from traindx.common import redact

# (text, the secret part that must go) — shapes seen in real environments and command lines
SECRETS = [
    ("postgres://trainer:s3cr3t-pw@db.internal:5432/runs", "s3cr3t-pw"),
    ("mysql+pymysql://root:Hunter2!@10.0.0.5/db", "Hunter2!"),
    (
        "DefaultEndpointsProtocol=https;AccountName=mystore;AccountKey=Zm9vYmFyYmF6cXV4MTIzNDU2Nzg5MA==;"
        "EndpointSuffix=core.windows.net",
        "Zm9vYmFyYmF6cXV4MTIzNDU2Nzg5MA==",
    ),
    (
        "https://0123456789abcdef0123456789abcdef@o450123.ingest.sentry.io/1",
        "0123456789abcdef0123456789abcdef",
    ),
    ("https://mlflow-user:mlflow-pass-99@mlflow.example.com:5000", "mlflow-pass-99"),
    ("https://storage.example.com/file?sv=2021&sig=AbCdEf0123456789%2Bxyz&se=2030", "AbCdEf0123456789%2Bxyz"),
    ("ghp_" + "A1b2C3d4E5f6G7h8I9j0K1l2M3n4O5p6Q7r8", "A1b2C3d4E5f6G7h8I9j0K1l2M3n4O5p6Q7r8"),
    (
        "github_pat_11ABCDEFG0123456789_abcdefghijklmnopqrstuvwxyz0123456789",
        "11ABCDEFG0123456789_abcdefghijklmnopqrstuvwxyz0123456789",
    ),
    ("hf_aBcDeFgHiJkLmNoPqRsTuVwXyZ01234567", "aBcDeFgHiJkLmNoPqRsTuVwXyZ01234567"),
    ("sk-proj-abcdefghijklmnopqrstuvwxyz0123456789", "abcdefghijklmnopqrstuvwxyz0123456789"),
    ("xoxb-123456789012-1234567890123-AbCdEfGhIjKlMnOpQrStUvWx", "AbCdEfGhIjKlMnOpQrStUvWx"),
    ("AKIAIOSFODNN7EXAMPLE", "AKIAIOSFODNN7EXAMPLE"),
    (
        "eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0."
        "SflKxwRJSMeKKF2QT4fwpMeJf36POk6yJV_adQssw5c",
        "SflKxwRJSMeKKF2QT4fwpMeJf36POk6yJV_adQssw5c",
    ),
    ("Authorization: Bearer abcdef0123456789abcdef0123", "abcdef0123456789abcdef0123"),
    (
        "export WANDB_API_KEY=0123456789abcdef0123456789abcdef01234567",
        "0123456789abcdef0123456789abcdef01234567",
    ),
    (
        "args: --wandb_key 0123456789abcdef0123456789abcdef01234567 --lr 0.1",
        "0123456789abcdef0123456789abcdef01234567",
    ),
    (
        "-----BEGIN RSA PRIVATE KEY-----\nMIIEowIBAAKCAQEA7\n-----END RSA PRIVATE KEY-----",
        "MIIEowIBAAKCAQEA7",
    ),
]
# must survive untouched
NOT_SECRETS = [
    "https://huggingface.co/meta-llama/Llama-3.1-8B/resolve/main/config.json",
    "/data/checkpoints/run-42/model.safetensors",
    "lr=3e-4 warmup=2000 num_tokens=4096 max_tokens=8192",
    "iter 10: loss 6.9312, time 35.12ms, mfu 0.01%",
    "HEAD is now at 9fceb02d0ae598e95dc970b74767f19372d61af8",
    "ssh://git@github.com/org/repo.git",
    "{'loss': 2.31, 'grad_norm': 1.2, 'learning_rate': 5e-05, 'epoch': 0.1}",
    "Tokenizer vocab 32000; key_dim=64; attention keys cached",
]


@pytest.mark.parametrize("text,secret", SECRETS, ids=[s[0][:24] for s in SECRETS])
def test_secret_values_are_redacted_wherever_they_appear(text, secret):
    out = redact.redact_text(f"connecting with {text} now")
    assert secret not in out and redact.REDACTED in out
    assert out.startswith("connecting with ") and out.endswith(" now")


@pytest.mark.parametrize("text", NOT_SECRETS)
def test_non_secrets_survive(text):
    assert redact.redact_text(text) == text


def test_command_line_options_named_like_secrets():
    wandb = "0123456789abcdef0123456789abcdef01234567"
    argv = [
        "torchrun",
        "--nproc-per-node",
        "2",
        "train.py",
        "--wandb_key",
        wandb,
        "--api-key=abc",
        "--hf-token",
        "hf_aBcDeFgHiJkLmNoPqRsTuVwXyZ01234567",
        "--db-password",
        "hunter2",
        "--lr",
        "3e-4",
        "--key-dim",
        "64",
        "--max-tokens",
        "4096",
        "--tokenizer",
        "meta-llama/Llama-3.1-8B",
        "--data",
        "postgres://u:pw@h/db",
        "--use-auth",
        "--out",
        "/ckpt",
    ]
    out = redact.redact_argv(argv)
    assert out == [
        "torchrun",
        "--nproc-per-node",
        "2",
        "train.py",
        "--wandb_key",
        "<redacted>",
        "--api-key=<redacted>",
        "--hf-token",
        "<redacted>",
        "--db-password",
        "<redacted>",
        "--lr",
        "3e-4",
        "--key-dim",
        "64",
        "--max-tokens",
        "4096",
        "--tokenizer",
        "meta-llama/Llama-3.1-8B",
        "--data",
        "postgres://u:<redacted>@h/db",
        "--use-auth",
        "--out",
        "/ckpt",
    ]


def test_environment_by_name_and_by_value():
    env = {
        "HF_TOKEN": "x",
        "GITHUB_PAT": "y",
        "SENTRY_DSN": "https://k@o1.ingest.sentry.io/1",
        "AWS_SECRET_ACCESS_KEY": "z",
        "DATABASE_URL": "postgres://u:pw@db/x",
        "AZURE_STORAGE_CONNECTION_STRING": "AccountName=a;AccountKey=QUJDREVGR0hJSktMTU5PUA==",
        "MLFLOW_TRACKING_URI": "https://user:pass@mlflow:5000",
        "TOKENIZERS_PARALLELISM": "false",
        "PATH": "/usr/bin:/bin",
        "CUDA_VISIBLE_DEVICES": "0,1",
        "LEARNING_RATE": "3e-4",
    }
    out = redact.redact_env(env)
    assert out["HF_TOKEN"] == out["GITHUB_PAT"] == out["SENTRY_DSN"] == "<redacted>"
    assert out["AWS_SECRET_ACCESS_KEY"] == "<redacted>"
    assert out["DATABASE_URL"] == "postgres://u:<redacted>@db/x"
    assert out["AZURE_STORAGE_CONNECTION_STRING"] == "AccountName=a;AccountKey=<redacted>"
    assert out["MLFLOW_TRACKING_URI"] == "https://user:<redacted>@mlflow:5000"
    for name in ("TOKENIZERS_PARALLELISM", "PATH", "CUDA_VISIBLE_DEVICES", "LEARNING_RATE"):
        assert out[name] == env[name]


JOB = textwrap.dedent("""
    import os, sys
    import torch

    # a job that echoes its configuration, secrets included, as many do
    print("db:", os.environ["DATABASE_URL"])
    print("args:", sys.argv)  # the Python list: the key stands alone between quotes
    print("args:", " ".join(sys.argv[1:]))
    print("export WANDB_API_KEY=" + os.environ["WANDB_API_KEY"])
    print("service password is", os.environ["SERVICE_PASSWORD"])  # no shape: only its value says
    print("tracking at https://ml:ml-pass-77@mlflow.example.com")
    print("Authorization: Bearer abcdef0123456789abcdef0123")
    print("HEAD is now at 9fceb02d0ae598e95dc970b74767f19372d61af8; model meta-llama/Llama-3.1-8B")
    print("checkpoint /data/checkpoints/run-42/model.safetensors, lr=3e-4, num_tokens=4096")
    w = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.SGD([w], lr=0.1)
    for step in range(3):
        (w * w).sum().backward()
        opt.step()
        opt.zero_grad()
        print(f"step {step} loss {float((w * w).sum()):.4f}")
""")
NON_SECRETS = [
    "9fceb02d0ae598e95dc970b74767f19372d61af8",
    "meta-llama/Llama-3.1-8B",
    "/data/checkpoints/run-42/model.safetensors",
    "lr=3e-4",
    "num_tokens=4096",
    "step 2 loss",
    "--lr 0.1",
    "postgres://trainer:<redacted>@db.internal/runs",
]


def _texts_under(folder):
    """(path, text) of every file under a run folder: gzip decompressed, Parquet tables as the
    text of every value they hold."""
    import gzip

    import pyarrow.parquet as pq

    for root, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(root, name)
            if name.endswith(".parquet"):
                table = pq.read_table(path)
                yield path, json.dumps(table.to_pylist(), default=str)
            elif name.endswith(".gz"):
                with gzip.open(path, "rt", encoding="utf-8", errors="replace") as f:
                    yield path, f.read()
            else:
                with open(path, encoding="utf-8", errors="replace") as f:
                    yield path, f.read()


@pytest.mark.slow
def test_nothing_under_the_run_folder_holds_a_secret(tmp_path):
    """The job's environment and arguments hold secrets, and the job prints them (its argv as a
    Python list, a URL with a password, a bearer token, a password with no shape at all): no
    file under the run folder - log, events, Parquet tables, findings, report, Perfetto
    trace, card - holds one; what is not a secret (paths, numbers, commit hashes, model
    names) is all still there."""
    wandb = "0123456789abcdef0123456789abcdef01234567"
    env = {
        "DATABASE_URL": "postgres://trainer:pw-9f3k2@db.internal/runs",
        "AZURE_STORAGE_CONNECTION_STRING": "AccountName=st;AccountKey=c2VjcmV0a2V5c2VjcmV0a2V5MTIzNA==",
        "SENTRY_DSN": "https://0123456789abcdef0123456789abcdef@o1.ingest.sentry.io/1",
        "GITHUB_PAT": "github_pat_11ABCDEFG0123456789_abcdefghijklmnopqrst",
        "WANDB_API_KEY": "fedcba9876543210fedcba9876543210fedcba98",
        "SERVICE_PASSWORD": "opensesame-42",
        "TORCH_HOME": "/data/torch-home",
        "TRAINDX_CACHE": "1",
    }
    secrets = [
        "pw-9f3k2",
        "c2VjcmV0a2V5c2VjcmV0a2V5MTIzNA==",
        "0123456789abcdef0123456789abcdef",
        "ml-pass-77",
        "abcdefghijklmnopqrst",
        "fedcba9876543210fedcba9876543210fedcba98",
        wandb,
        "hf_aBcDeFgHiJkLmNoPqRsTuVwXyZ01234567",
        "opensesame-42",
        "abcdef0123456789abcdef0123",
    ]
    script = tmp_path / "job.py"
    script.write_text(JOB)
    run_dir = tmp_path / "run"
    proc = diagnose(
        [
            "--quiet",
            "--no-nvml",
            "--no-pyspy",
            "--torch-profile",
            "1",
            "--run-dir",
            str(run_dir),
            "--",
            PY,
            str(script),
            "--wandb_key",
            wandb,
            "--hf-token=hf_aBcDeFgHiJkLmNoPqRsTuVwXyZ01234567",
            "--lr",
            "0.1",
        ],
        cwd=tmp_path,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for extra in (
        ["report", str(run_dir), "--quiet", "--perfetto", str(run_dir / "trace.json.gz")],
        ["card", str(run_dir), "--tokens-per-step", "16", "-o", str(run_dir / "card.yaml")],
    ):
        done = diagnose(extra, cwd=tmp_path, env=env, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
    texts = dict(_texts_under(run_dir))
    assert any(p.endswith(".parquet") for p in texts) and any("events" in p for p in texts)
    assert str(run_dir / "trace" / "0.json.gz") in texts  # the torch.profiler window
    for path, text in texts.items():
        for secret in secrets:
            assert secret not in text, (secret, path)
    manifest = json.loads(texts[str(run_dir / "manifest.json")])
    assert manifest["command"] == [
        PY,
        str(script),
        "--wandb_key",
        "<redacted>",
        "--hf-token=<redacted>",
        "--lr",
        "0.1",
    ]
    assert manifest["env"]["DATABASE_URL"] == "postgres://trainer:<redacted>@db.internal/runs"
    assert manifest["env"]["TORCH_HOME"] == "/data/torch-home"
    log = texts[str(run_dir / "log.txt")]
    for kept in NON_SECRETS:
        assert kept in log, kept
    assert "args: [" in log and "'--wandb_key', '<redacted>'" in log
    assert "Bearer <redacted>" in log and "https://ml:<redacted>@mlflow.example.com" in log
    # the shim's own record of the process: its arguments without the secrets
    run = traindx.load_run(run_dir)
    (argv,) = [a for a in run.processes["argv"] if a]
    assert list(argv) == [str(script), "--wandb_key", "<redacted>", "--hf-token=<redacted>", "--lr", "0.1"]
    report_text = texts[str(run_dir / "report.html")]
    assert "step 2 loss" in report_text and "--lr 0.1" in report_text


def test_a_redactor_hides_the_jobs_own_values_and_keeps_the_rest():
    env = {
        "SERVICE_PASSWORD": "opensesame-42",
        "HF_TOKEN": "x",
        "PWD": "/work/project",
        "DATABASE_URL": "postgres://u:pw-9f3k2@db/x",
        "TOKENIZERS_PARALLELISM": "false",
    }
    argv = [
        "train.py",
        "--wandb_key",
        "0123456789abcdef0123456789abcdef01234567",
        "--db-password",
        "hunter2",
        "--lr",
        "0.1",
        "--key-dim",
        "64",
    ]
    r = redact.Redactor.for_job(env, argv)
    line = r.line(f"{argv} pw-9f3k2 opensesame-42 in /work/project, false, hunter2 at step 64")
    for secret in ("opensesame-42", "pw-9f3k2", "hunter2", "0123456789abcdef0123456789abcdef01234567"):
        assert secret not in line
    # too short to hide everywhere (HF_TOKEN=x), a path (PWD), numbers and flags stay
    assert "/work/project" in line and "false" in line and "step 64" in line and "'--lr', '0.1'" in line
    assert r.argv(argv) == [
        "train.py",
        "--wandb_key",
        "<redacted>",
        "--db-password",
        "<redacted>",
        "--lr",
        "0.1",
        "--key-dim",
        "64",
    ]
    for text in NOT_SECRETS:
        assert r.line(text) == text
