"""A framework's callback that writes a checkpoint is named at the job's line that built it, with
the arguments it was built with (its frequency), not at the framework's own torch.save caller:
the shim's `via` (the job's frame and the classes whose methods ran between it and the call)
resolved against the job's source."""

from traindx.analyzers.model.stability_causes import built_site, call_text

JOB = """import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint


def main(out, every):
    ckpt = ModelCheckpoint(
        dirpath=out, every_n_train_steps=every, save_top_k=-1
    )
    trainer = L.Trainer(max_steps=100, callbacks=[ckpt])
    trainer.fit(model, loader)
"""
VIA_OBJECTS = [
    ["lightning.fabric.plugins.io.torch_io", "TorchCheckpointIO"],
    ["lightning.pytorch.strategies.single_device", "SingleDeviceStrategy"],
    ["lightning.pytorch.trainer.trainer", "Trainer"],
    ["lightning.pytorch.callbacks.model_checkpoint", "ModelCheckpoint"],
    ["lightning.pytorch.loops.fit_loop", "_FitLoop"],
]
CALLED = ["lightning.pytorch.trainer.trainer", "Trainer"]  # trainer.fit(): the job's own call


def _via(path, objects):
    return {"job": {"file": str(path), "line": 10, "function": "main"}, "objects": objects, "called": CALLED}


def test_the_callback_the_job_built_is_named_with_its_frequency(tmp_path):
    path = tmp_path / "train.py"
    path.write_text(JOB)
    built = built_site(_via(path, VIA_OBJECTS))
    assert built is not None
    # the trainer whose fit() the job called is the framework's loop, not the writer
    assert built["class"] == "ModelCheckpoint" and built["line"] == 6
    assert built["keywords"]["every_n_train_steps"] == "every"
    text = call_text(
        {"call": "torch.save", "caller": {"file": "/site-packages/x.py", "line": 1}, "built": built}
    )
    assert "ModelCheckpoint built at" in text and ":6" in text and "every_n_train_steps=every" in text


def test_no_object_the_job_built_leaves_the_framework_caller(tmp_path):
    path = tmp_path / "train.py"
    path.write_text(JOB)
    assert built_site(_via(path, [["pkg.io", "Writer"], CALLED])) is None
    assert built_site(_via(tmp_path / "missing.py", VIA_OBJECTS)) is None
    io = {"call": "torch.save", "caller": {"file": "/site-packages/x.py", "line": 1}}
    assert call_text(io) == "torch.save at /site-packages/x.py:1"
