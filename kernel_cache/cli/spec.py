"""What to compile: attention shapes from `--spec`, an HF `config.json`, or the FA4 compiles of a run.

A *work item* is a plain dict (it crosses a process boundary):
- `{"kind": "shape", ...}`: one attention shape; the worker runs FA4's forward and backward the
  way `flash_attn_func` / `flash_attn_varlen_func` call them in training.
- `{"kind": "replay", "function": ..., "args": {...}, "expect_key": ...}`: one compile recorded
  by the shim, called again with the recorded arguments (tensors rebuilt from shape and dtype).

Which sequence lengths to compile: FA4's compile keys do not hold the sequence length itself,
only whether it fits in one tile (`single_q_block`/`single_k_block` in backward; forward's
`is_static_persistent` and, on sm_100, `q_stage`), compared after multiplying by the GQA ratio.
So one long length covers every length above 256 tokens, and a few short ones the rest. Fixed-length
batches: give the job's length (default 4096). Packed (varlen) batches: max_seqlen changes from
batch to batch, so the default is the range 8-4096, which compiles each distinct key of the range
once (items whose keys are already compiled cost milliseconds). `--seqlens 16-2048` takes a range.
With varlen, a pack of more than 256 sequences switches FA4 to another scheduler hint
(`BIN_BATCH_SEARCH_THRESH`): set `batch=` above 256 if the job packs that many.
A `max_seqlen` passed as a tensor instead of a Python int selects other keys (and in FA4 ≤ b21
a new key per call, which no cache can fix); `--spec ...,tensor_maxseqlen` warms that variant.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from traindx.common.errors import UserError
from traindx.common.hfconfig import load_hf_config
from traindx.kernel_cache.store import cache as store

DTYPES = {
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp16": "float16",
    "float16": "float16",
    "half": "float16",
}
CONFIG_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "bf16"}  # fp32 models train in bf16 attn
DEFAULT_SEQLENS = (4096,)
DEFAULT_BATCH = 2
# SMs of the GPUs a job is likely to run on; FA4 only uses the count for heuristics (splits, 2CTA)
NUM_SMS_BY_GPU = (
    ("H100 PCIe", 114),
    ("H100 NVL", 132),
    ("H100", 132),
    ("H200", 132),
    ("H800", 132),
    ("H20", 78),
    ("GH200", 132),
    ("B200", 148),
    ("GB200", 152),
    ("B300", 148),
    ("GB300", 152),
    ("RTX PRO 6000", 188),
    ("A100", 108),
)
NUM_SMS_BY_ARCH = {80: 108, 90: 132, 100: 148, 103: 148, 110: 148, 120: 188}

SPEC_HELP = """\
--spec FIELDS   comma-separated; repeatable. Fields:
  hd=128        head dim of q/k (required); hdv=.. head dim of v (default: hd)
  hq=16         query heads (default 16);  hkv=4  key/value heads (default: hq)
  dtype=bf16    bf16 | fp16
  causal        causal mask;  window=L:R  sliding window (left:right tokens, -1 = unbounded)
  varlen        packed sequences (flash_attn_varlen_func, cu_seqlens + int max_seqlen)
  batch=N       sequences per batch / pack (default 2; > 256 selects FA4's other varlen scheduler)
  deterministic deterministic backward;  softcap=X  logit soft-capping
  fwd           forward only (inference: no backward kernels)
  tensor_maxseqlen  varlen with max_seqlen passed as a 0-dim tensor (as some frameworks do)
example: --spec hd=128,hq=16,hkv=4,dtype=bf16,causal,varlen --seqlens 2048,4096"""

SPEC_DEFAULTS: dict[str, Any] = {
    "hd": None,
    "hdv": None,
    "hq": 16,
    "hkv": None,
    "dtype": "bf16",
    "causal": False,
    "window": None,
    "varlen": False,
    "batch": DEFAULT_BATCH,
    "deterministic": False,
    "softcap": 0.0,
    "fwd": False,
    "tensor_maxseqlen": False,
}
_FLAGS = {"causal", "varlen", "deterministic", "fwd", "tensor_maxseqlen"}
_INTS = {"hd", "hdv", "hq", "hkv", "batch"}


def arch_number(arch: str | int) -> int:
    """'sm_90' / 'sm90a' / '90' / 90 -> 90."""
    if isinstance(arch, int):
        return arch
    m = re.fullmatch(r"(?:sm_?)?(\d+)([af]?)", str(arch).strip().lower())
    if not m:
        raise UserError(f"--arch {arch!r}: expected sm_80, sm_90, sm_100, sm_103, sm_110 or sm_120")
    n = int(m.group(1))
    if n < 80 or n // 10 not in (8, 9, 10, 11, 12):
        raise UserError(f"--arch {arch}: FA4 supports sm_80 and sm_90 to sm_12x")
    return n


def arch_env(arch: str | int, num_sms: int | None = None) -> dict[str, str]:
    """The variables that make FA4 pick and CuTe DSL target an arch without that GPU."""
    n = arch_number(arch)
    suffix = "" if n // 10 == 8 else "a"
    return {
        "FLASH_ATTENTION_ARCH": f"sm_{n}",
        "CUTE_DSL_ARCH": f"sm_{n}{suffix}",
        "FLASH_ATTENTION_NUM_SMS": str(num_sms or NUM_SMS_BY_ARCH.get(n, 132)),
    }


# -- --spec ----------------------------------------------------------------------------------------
def parse_spec(text: str) -> dict[str, Any]:
    spec = dict(SPEC_DEFAULTS)
    for raw in (p.strip() for p in text.split(",")):
        if not raw:
            continue
        name, eq, value = raw.partition("=")
        name = name.strip().lower().replace("-", "_")
        if not eq:
            if name not in _FLAGS:
                raise UserError(
                    f"--spec {text!r}: unknown flag {name!r} (flags: {', '.join(sorted(_FLAGS))})"
                )
            spec[name] = True
            continue
        value = value.strip()
        try:
            if name in _INTS:
                spec[name] = int(value)
            elif name in _FLAGS:
                spec[name] = value.lower() in ("1", "true", "yes", "on")
            elif name == "dtype":
                if value.lower() not in DTYPES:
                    raise ValueError
                spec["dtype"] = "bf16" if DTYPES[value.lower()] == "bfloat16" else "fp16"
            elif name == "softcap":
                spec["softcap"] = float(value)
            elif name == "window":
                left, _, right = value.partition(":")
                spec["window"] = [
                    None if int(left) < 0 else int(left),
                    None if int(right or 0) < 0 else int(right or 0),
                ]
            else:
                raise UserError(f"--spec {text!r}: unknown field {name!r}")
        except ValueError:
            raise UserError(f"--spec {text!r}: bad value for {name}: {value!r}") from None
    if spec["hd"] is None:
        raise UserError(f"--spec {text!r}: hd= (head dim) is required")
    spec["hdv"] = spec["hdv"] or spec["hd"]
    spec["hkv"] = spec["hkv"] or spec["hq"]
    for key in ("hd", "hdv", "hq", "hkv", "batch"):
        if spec[key] <= 0:
            raise UserError(f"--spec {text!r}: {key} must be positive")
    if spec["hq"] % spec["hkv"]:
        raise UserError(f"--spec {text!r}: hq={spec['hq']} is not a multiple of hkv={spec['hkv']}")
    if spec["tensor_maxseqlen"] and not spec["varlen"]:
        raise UserError(f"--spec {text!r}: tensor_maxseqlen needs varlen")
    return spec


def expand_range(lo: int, hi: int) -> set[int]:
    """The lengths that stand for every length in [lo, hi]: FA4's keys change only where a length
    crosses a tile size (<= 256 rows, divided by the GQA ratio), so every multiple of 8 up to 256
    plus the powers of two above it and `hi` itself hit each distinct key of the range."""
    values = {v for v in range(8, min(hi, 256) + 1, 8) if v >= lo} | {lo, hi}
    p = 512
    while p < hi:
        values.add(p)
        p *= 2
    return {v for v in values if lo <= v <= hi}


def parse_seqlens(text: str | None, varlen: bool = False) -> list[int]:
    """'2048,4096' or a range '16-4096' (see expand_range). Default: 4096; for varlen the range
    8-4096, since a pack's max_seqlen changes from batch to batch."""
    if text is None:
        return sorted(expand_range(8, DEFAULT_SEQLENS[0])) if varlen else list(DEFAULT_SEQLENS)
    values: set[int] = set()
    try:
        for part in str(text).replace(" ", "").split(","):
            if not part:
                continue
            low, dash, high = part.partition("-")
            if dash:
                lo, hi = int(low), int(high)
                if lo <= 0 or hi < lo:
                    raise ValueError
                values |= expand_range(lo, hi)
            else:
                values.add(int(part))
    except ValueError:
        raise UserError(
            f"--seqlens {text!r}: expected comma-separated lengths or ranges (e.g. 4096 or 16-4096)"
        ) from None
    if not values or any(v <= 0 for v in values):
        raise UserError(f"--seqlens {text!r}: expected positive integers")
    return sorted(values)


def spec_label(spec: Mapping[str, Any], seqlen: int) -> str:
    parts = [
        f"hd={spec['hd']}" + (f"/{spec['hdv']}" if spec["hdv"] != spec["hd"] else ""),
        f"hq={spec['hq']}",
        f"hkv={spec['hkv']}",
        spec["dtype"],
    ]
    parts += [f for f in ("causal", "varlen", "deterministic") if spec[f]]
    if spec["window"]:
        parts.append("window={}:{}".format(*[-1 if w is None else w for w in spec["window"]]))
    if spec["softcap"]:
        parts.append(f"softcap={spec['softcap']:g}")
    if spec["tensor_maxseqlen"]:
        parts.append("tensor_maxseqlen")
    parts.append(f"seq={seqlen}" + (f"x{spec['batch']}" if spec["batch"] != DEFAULT_BATCH else ""))
    if spec["fwd"]:
        parts.append("fwd only")
    return ",".join(parts)


def spread_order(values: Iterable[int]) -> list[int]:
    """Longest, shortest, then midpoints: lengths likely to need different kernels come first, so
    parallel processes rarely compile the same key at the same time."""
    ordered = sorted(values)
    if len(ordered) <= 2:
        return ordered[::-1]
    out, spans = [ordered[-1], ordered[0]], [(0, len(ordered) - 1)]
    while spans:
        lo, hi = spans.pop(0)
        if hi - lo < 2:
            continue
        mid = (lo + hi) // 2
        out.append(ordered[mid])
        spans += [(lo, mid), (mid, hi)]
    return out


def shape_items(specs: Iterable[Mapping[str, Any]], seqlens_text: str | None = None) -> list[dict[str, Any]]:
    """One work item per (spec, sequence length); duplicates dropped."""
    items: list[dict[str, Any]] = []
    seen: set[str] = set()
    for spec in specs:
        for seqlen in spread_order(parse_seqlens(seqlens_text, varlen=spec["varlen"])):
            item = dict(spec, kind="shape", seqlen=seqlen)
            item["label"] = spec_label(spec, seqlen)
            if item["label"] not in seen:
                seen.add(item["label"])
                items.append(item)
    return items


# -- --model config.json -----------------------------------------------------------------------------
def _text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """Multimodal configs (Qwen3.5, Qwen3-VL, Llama 4, ...) keep the language model in text_config."""
    for key in ("text_config", "llm_config", "language_config"):
        if isinstance(config.get(key), dict) and "num_attention_heads" in config[key]:
            text_config: Mapping[str, Any] = config[key]
            return text_config
    return config


def attention_layers(config: Mapping[str, Any]) -> tuple[list[tuple[str, dict[str, Any]]], Mapping[str, Any]]:
    """[(description, attention fields)] of the softmax-attention layers FA4 runs for a model.

    Hybrid models (Qwen3-Next, Qwen3.5 family) interleave linear-attention layers (Gated DeltaNet,
    not FA4) with full-attention layers: `layer_types` lists each layer, or `full_attention_interval`
    says every n-th layer is full attention. Sliding-window layers (`sliding_attention` in
    layer_types, Mistral/Qwen2 `sliding_window`) get a window; FA4's key only records that a window
    is set, not its size.
    """
    text = _text_config(config)
    heads = text.get("num_attention_heads")
    if not isinstance(heads, int) or heads <= 0:
        raise UserError("config has no num_attention_heads (not a transformer LM config?)")
    kv_heads = text.get("num_key_value_heads") or heads
    head_dim = text.get("head_dim")
    if not head_dim:
        hidden = text.get("hidden_size")
        if not hidden:
            raise UserError("config has neither head_dim nor hidden_size")
        head_dim = hidden // heads
    v_head_dim = text.get("v_head_dim") if text.get("kv_lora_rank") is None else None
    n_layers = text.get("num_hidden_layers") or 0
    layer_types = text.get("layer_types")
    if not layer_types and text.get("full_attention_interval"):
        interval = int(text["full_attention_interval"])
        layer_types = [
            "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n_layers)
        ]
    if text.get("kv_lora_rank") is not None:
        raise UserError(
            "MLA models (DeepSeek-style kv_lora_rank) are not supported by --model yet; "
            "use --spec hd=192,hdv=128,... for their prefill shapes"
        )
    base = {
        "hd": int(head_dim),
        "hdv": int(v_head_dim or head_dim),
        "hq": int(heads),
        "hkv": int(kv_heads),
        "window": None,
    }
    sliding = text.get("sliding_window")
    if text.get("use_sliding_window") is False:
        sliding = None
    kinds: dict[str, list[int]] = {}
    if layer_types:
        for i, kind in enumerate(layer_types):
            kinds.setdefault(kind, []).append(i)
    else:
        kinds["full_attention" if not sliding else "sliding_attention"] = list(range(n_layers))
    out: list[tuple[str, dict[str, Any]]] = []
    for kind, layers in kinds.items():
        if kind in ("full_attention", "attention", "global_attention"):
            out.append((f"{kind} ({len(layers)} layers)", dict(base)))
        elif kind in ("sliding_attention", "local_attention", "chunked_attention"):
            window = int(sliding or text.get("attention_chunk_size") or 4096)
            out.append((f"{kind} ({len(layers)} layers, window {window})", dict(base, window=[window, 0])))
        # linear_attention / mamba / ...: not FA4
    if not out:
        raise UserError(
            f"config has no softmax-attention layers FA4 would run (layer types: {', '.join(sorted(kinds))})"
        )
    return out, text


def model_specs(
    path: str,
    varlen: bool = False,
    causal: bool = True,
    dtype: str | None = None,
    deterministic: bool = False,
    batch: int | None = None,
    tp: int = 1,
    fwd_only: bool = False,
) -> tuple[list[dict[str, Any]], list[str]]:
    config = load_hf_config(path)
    layers, text = attention_layers(config)
    if dtype is None:
        dtype = CONFIG_DTYPES.get(
            str(text.get("torch_dtype") or text.get("dtype") or config.get("torch_dtype") or "bfloat16"),
            "bf16",
        )
    specs: list[dict[str, Any]] = []
    notes: list[str] = []
    for desc, attn in layers:
        hq, hkv = attn["hq"], attn["hkv"]
        if tp > 1:
            # tensor parallelism splits the heads; kv heads are replicated when fewer than tp
            if hq % tp:
                raise UserError(f"--tp {tp} does not divide the {hq} query heads")
            hq, hkv = hq // tp, max(1, hkv // tp)
        spec = {
            **SPEC_DEFAULTS,
            **attn,
            "hq": hq,
            "hkv": hkv,
            "dtype": dtype,
            "causal": causal,
            "varlen": varlen,
            "batch": batch or DEFAULT_BATCH,
            "deterministic": deterministic,
            "fwd": fwd_only,
        }
        specs.append(spec)
        notes.append(desc)
    return specs, notes


# -- --from-run ----------------------------------------------------------------------------------------
REPLAY_FIRST = ("_flash_attn_fwd", "_flash_attn_bwd")
# a tensor inside a compile key (FA4 <= 4.0.0b21 with max_seqlen passed as a tensor): the key is new
# on every call, so no cache can serve it
TENSOR_IN_KEY = re.compile(r"\b(?:Fake)?Tensor\(|\btensor\(")


def run_items(run_path: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The distinct FA4 compiles of a run, as replay items (forward and backward first: they also
    compile the backward pre/post kernels, whose own events are then replayed only if missed).
    Returns (items, info) with info: arch, num_sms and FA4 environment variables of the run."""
    from traindx.derive.run import load_run  # lazy: pandas, only for --from-run

    run = load_run(run_path)
    compiles = run.compiles
    if not len(compiles) or "fa4" not in compiles.columns:
        raise UserError(f"{run.path}: the run recorded no FA4 (CuTe DSL) compiles to replay")
    fa4 = compiles[(compiles["kind"] == "cute_dsl") & compiles["fa4"].map(lambda v: isinstance(v, dict))]
    if not len(fa4):
        raise UserError(f"{run.path}: the run recorded no FA4 (CuTe DSL) compiles to replay")
    items: list[dict[str, Any]] = []
    seen: dict[tuple[Any, Any], dict[str, Any]] = {}
    archs: set[int] = set()
    for row in fa4.itertuples():
        info = row.fa4
        function = info.get("function")
        key = row.key if isinstance(row.key, str) else None
        fields = row.key_fields if isinstance(row.key_fields, dict) else {}
        if fields.get("arch") not in (None, "None"):
            try:
                archs.add(int(fields["arch"]))
            except ValueError:
                pass
        ident = (function, key)
        if not function:
            continue
        if ident in seen:
            seen[ident]["times_compiled"] += 1
            continue
        tensor_fields = [name for name, value in fields.items() if TENSOR_IN_KEY.search(str(value))]
        item = {
            "kind": "replay",
            "function": function,
            "args": info.get("args") or {},
            "expect_key": key,
            "expect_fields": fields,
            "step": _int_or_none(row.step),
            "times_compiled": 1,
            "tensor_fields": tensor_fields,
            "label": f"{function} #{len([i for i in items if i['function'] == function]) + 1}"
            + (f" (step {int(row.step)})" if _int_or_none(row.step) is not None else ""),
        }
        seen[ident] = item
        items.append(item)
    items.sort(key=lambda it: 0 if it["function"] in REPLAY_FIRST else 1)
    env = run.manifest.get("environment") or run.manifest.get("env") or {}
    fa4_env = {
        k: v
        for k, v in env.items()
        if isinstance(v, str)
        and v != "<redacted>"
        and (k.startswith("FLASH_ATTENTION_") or k.startswith("FA_") or k == "CUTE_DSL_ARCH")
        and k not in (store.DIR_VAR, store.ENABLE_VAR)
    }
    num_sms = None
    for gpu in run.manifest.get("gpus") or []:
        name = str(gpu.get("name", ""))
        for marker, sms in NUM_SMS_BY_GPU:
            if marker.lower() in name.lower():
                num_sms = sms
                break
        if num_sms:
            break
    return items, {
        "archs": sorted(archs),
        "num_sms": num_sms,
        "env": fa4_env,
        "run": run.path,
        "versions": run.manifest.get("packages") or {},
    }


def _int_or_none(v: Any) -> int | None:
    try:
        return None if v is None or v != v else int(v)
    except (TypeError, ValueError):
        return None
