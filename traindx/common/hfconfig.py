"""Reading a Hugging Face `config.json` (kernel-cache's attention shapes, recipe cards' MFU)."""

import json
from typing import Any

from traindx.common.errors import UserError


def load_hf_config(path: str) -> dict[str, Any]:
    """The config as a dict; a UserError naming the file for anything that is not one."""
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except OSError as exc:
        raise UserError(f"--model {path}: {exc.strerror}") from None
    except ValueError:
        raise UserError(f"--model {path}: not a JSON file") from None
    if not isinstance(config, dict):
        raise UserError(f"--model {path}: not an HF config.json (not a JSON object)")
    return config
