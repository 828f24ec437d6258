"""What the GPU-view test modules share: the recorded H200 folders and a quiet load of one."""

import os
import warnings

import traindx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "tests", "data")


def load(path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return traindx.load_run(path)
