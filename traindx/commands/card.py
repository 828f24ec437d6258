"""Write a recipe card (the YAML format of recipes/cards/*.yaml) from a measured run:
tokens/s per GPU, $ per 1M tokens, MFU, step-time CV, GPU-hours, and the convergence check
when the run was the candidate arm of `diagnose --fix` (or of `diagnose compare --json
RUN/comparison.json`).

usage: diagnose card RUN [--active-params N | --model config.json] [--gpu H200]
                         [--price-per-gpu-hour P] [--window 5:19] [--tokens-per-step N] [-o card.yaml]
"""
import datetime
import json
import os
import shlex
import sys

from traindx.errors import UserError
from traindx.hfconfig import load_hf_config

# environment variables that shape performance and belong on a card (never secrets)
PERF_ENV_PREFIXES = ("CUDA_DEVICE_MAX_CONNECTIONS", "PYTORCH_CUDA_ALLOC_CONF", "NCCL_",
                     "TORCHINDUCTOR_", "TORCH_NCCL_", "FLASH_ATTENTION_", "CUTE_DSL_", "NVTE_",
                     "OMP_NUM_THREADS", "TRITON_", "FLA_", "CUDA_LAUNCH_BLOCKING")


def prepare_parser(parser):
    parser.add_argument("run_dir", metavar="RUN", help="a run folder written by diagnose")
    params = parser.add_mutually_exclusive_group()
    params.add_argument("--active-params", type=float, default=None, metavar="N",
                        help="active parameters per token (for MFU)")
    params.add_argument("--model", default=None, metavar="CONFIG_JSON",
                        help="the model's HuggingFace config.json: active parameters and, with "
                             "--seq-len, the attention term of MFU")
    parser.add_argument("--seq-len", type=int, default=None, metavar="T",
                        help="sequence length T of the attention term 12·L·H·Q·T (with --model)")
    parser.add_argument("--model-name", default=None, help="the card's model name")
    parser.add_argument("--gpu", default=None, metavar="TYPE",
                        help="GPU type for the peak FLOP/s (default: the run's GPUs); "
                             "A100, H100, H200, B200, B300, GB200")
    parser.add_argument("--price-per-gpu-hour", type=float, default=None, metavar="USD",
                        help="price of one GPU-hour, for $ per 1M tokens")
    parser.add_argument("--window", default=None, metavar="FIRST:LAST",
                        help="steps measured, inclusive, 0-based (default: skip the first quarter)")
    parser.add_argument("--tokens-per-step", type=float, default=None, metavar="N",
                        help="tokens of one optimizer step (all GPUs), when the job does not say")
    parser.add_argument("--author", default="traindx", help="the card's author name")
    parser.add_argument("-o", "--output", default=None, metavar="CARD_YAML",
                        help="write the card here (default: print it)")


def _significant(x, digits=4):
    return float(f"{x:.{digits}g}")


def _gpu_of(run, override):
    from traindx.recipes.throughput import normalize_gpu

    if override:
        gpu = normalize_gpu(override)
        if gpu is None:
            raise UserError(f"--gpu {override}: unknown GPU type (known: A100, H100, H200, "
                            "B200, B300, GB200)")
        return gpu, None
    names = [g.get("name") for g in run.manifest.get("gpus") or [] if isinstance(g, dict)]
    if names:
        return normalize_gpu(names[0]) or names[0], names[0]
    return None, None


def _convergence(run):
    path = os.path.join(run.path, "comparison.json")
    if not os.path.isfile(path):
        return {"result": "not run",
                "summary": "no convergence check: this run is not the candidate arm of "
                           "`diagnose --fix` (or of a saved `diagnose compare`)",
                "convergence": None}
    try:
        with open(path, encoding="utf-8") as f:
            comparison = json.load(f)
    except ValueError:
        raise UserError(f"{path} is corrupt (not JSON)") from None
    parity = comparison.get("loss_parity")
    if not parity:
        return {"result": "not run", "summary": "compared, but no losses were logged",
                "convergence": None}
    result = "pass" if parity["passed"] else "fail"
    steps = parity.get("steps") or [None, None]
    return {
        "result": result,
        "summary": f"{result}ed: {parity['points']}-point loss-parity check against the "
                   f"baseline arm ({'; '.join(parity['reasons']) or 'every threshold met'})",
        "reference": comparison.get("baseline", {}).get("run"),
        "convergence": {
            "steps": parity["points"] + parity["skipped"],
            "result": result,
            "correlation": parity["correlation"],
            "final_loss_difference": parity["final_loss_difference"],
            "pointwise_failures": parity["pointwise_failures"],
            "note": f"candidate arm: this run; reference arm: {comparison['baseline']['run']}; "
                    f"logged steps {steps[0]}-{steps[1]}, the first {parity['skipped']} skipped",
        },
        "rules": "Megatron-Bridge validate_convergence thresholds: correlation >= 0.95, "
                 "pointwise 10/5/2 % by loss level with at most 10 % of points failing, final "
                 "loss within 5 %, first 20 % skipped",
    }


def build_card(run, args):
    from traindx.recipes import throughput
    from traindx.recipes.ab import profiled_positions, step_times, tokens_per_step
    from traindx.recipes.card import Author, Gpu, RecipeCard, Result
    from traindx.recipes.stats import coefficient_of_variation, parse_window, window_values

    series, source = step_times(run)
    times = series.to_numpy(dtype=float)
    if not len(times):
        raise UserError(f"{run.path}: no completed step was recorded: nothing to measure")
    try:
        window = parse_window(args.window) if args.window else None
        window_times, (first, last) = window_values(
            times, window, profiled_positions(run, series) if source == "shim" else ())
    except ValueError as exc:
        raise UserError(str(exc)) from None
    tokens = args.tokens_per_step or tokens_per_step(run)
    if not tokens:
        raise UserError("tokens per step unknown (the job's log does not print "
                        "'tokens per step: N'): give --tokens-per-step N")
    ranks = run.steps["rank"].nunique() if len(run.steps) else 1
    n_gpus = max(int(ranks), 1)
    seconds = float(window_times.sum())
    window_tokens = int(round(tokens * len(window_times)))
    tps = throughput.tokens_per_s_per_gpu(window_tokens, seconds, n_gpus)

    gpu, gpu_name = _gpu_of(run, args.gpu)
    shape, active, source_note = None, None, None
    if args.model:
        try:
            config = load_hf_config(args.model)
            active = int(throughput.active_params_from_config(config))
            shape = throughput.model_shape(config)
        except (ValueError, KeyError) as exc:
            raise UserError(f"--model {args.model}: {exc}") from None
        source_note = os.path.abspath(args.model)
    elif args.active_params:
        active = int(args.active_params)
    mfu = mfu_note = None
    if active and gpu in throughput.PEAK_BF16_TFLOPS:
        attention = {}
        if shape and args.seq_len:
            attention = {"layers": shape["layers"], "heads": shape["heads"],
                         "head_dim": shape["head_dim"], "seq_len": args.seq_len}
            mfu_note = (f"6N + 12·L·H·Q·T with L={shape['layers']}, H={shape['heads']}, "
                        f"Q={shape['head_dim']}, T={args.seq_len}; peak "
                        f"{throughput.PEAK_BF16_TFLOPS[gpu]:g} TFLOP/s BF16 dense ({gpu})")
        else:
            mfu_note = (f"6N only (the attention term needs --model and --seq-len); peak "
                        f"{throughput.PEAK_BF16_TFLOPS[gpu]:g} TFLOP/s BF16 dense ({gpu})")
        mfu = _significant(throughput.mfu(tps, gpu, active, **attention))
    elif not active:
        mfu_note = "not computed: give --active-params N or --model config.json"
    else:
        mfu_note = (f"not computed: no peak FLOP/s for GPU {gpu or 'none (a CPU run)'}; "
                    "give --gpu")
    usd = (_significant(throughput.usd_per_million_tokens(args.price_per_gpu_hour, tps))
           if args.price_per_gpu_hour else None)
    cv = coefficient_of_variation(window_times)
    start, end = run.manifest.get("start_ns"), run.manifest.get("end_ns")
    hours = (round(throughput.gpu_hours(n_gpus, (end - start) / 1e9), 4)
             if start and end else None)
    measured = datetime.date.fromtimestamp(start / 1e9) if start else datetime.date.today()

    packages = run.manifest.get("packages") or {}
    host = run.manifest.get("host") or {}
    stack = {"pytorch": packages.get("torch"), "python": host.get("python")}
    for name in ("flash-attn-4", "nvidia-cutlass-dsl", "triton", "megatron-core",
                 "transformer-engine", "flash-linear-attention"):
        if packages.get(name):
            stack[name.replace("-", "_")] = packages[name]
    stack["source"] = f"traindx run manifest ({run.path})"
    stack = {k: v for k, v in stack.items() if v is not None}

    env = dict((run.manifest.get("options") or {}).get("extra_env") or {})
    for name, value in sorted((run.manifest.get("env") or {}).items()):
        if name.startswith(PERF_ENV_PREFIXES) and "REDACTED" not in str(value):
            env.setdefault(name, value)
    command = shlex.join(run.command)
    run_text = "".join(f"export {k}={shlex.quote(str(v))}\n" for k, v in env.items())
    run_text += ("\n" if env else "") + command + "\n"

    model_name = args.model_name
    if not model_name and args.model:
        model_name = config.get("_name_or_path") or config.get("model_type")
    if not model_name:
        script = next((t for t in run.command if t.endswith(".py")), run.command[0])
        model_name = f"the model of {os.path.basename(script)}"
    label = f"{n_gpus} rank{'s' if n_gpus > 1 else ''}"
    card = RecipeCard(
        model=str(model_name),
        gpu=Gpu(type=gpu or gpu_name or "CPU", count=n_gpus),
        author=Author(name=args.author),
        status="measured",
        stack=stack,
        workload={"tokens_per_step": int(tokens) if float(tokens).is_integer() else tokens,
                  "steps": int(len(times)), "step_times_from": source},
        layout={"label": label, "summary": f"{label} (from the run's step events); "
                                           "parallel layout as set by the command"},
        result=Result(
            tokens_per_s_per_gpu=round(tps, 2),
            usd_per_million_tokens=usd,
            step_time_cv_percent=None if cv is None else round(cv * 100, 2),
            mfu=mfu, mfu_note=mfu_note,
            active_params=({"count": active, "source": source_note or "--active-params"}
                           if active else None),
            measured=measured, steps_per_run=int(len(times)), window=[int(first), int(last)],
            window_tokens=window_tokens, runs=1,
            profiler=bool((run.manifest.get("options") or {}).get("pyspy")),
            gpu_hours=hours,
            gpu_hours_note="GPUs x wall time of the recorded run, including startup",
        ),
        correctness=_convergence(run),
        env=env or None,
        run=run_text,
        notes=f"Generated by traindx from {run.path}; tokens/s over steps {first}-{last} "
              f"({len(window_times)} steps, {seconds:.3f} s"
              + (f"; {last - first + 1 - len(window_times)} step(s) inside the torch.profiler "
                 "window left out" if last - first + 1 > len(window_times) else "") + ")."
              + ("" if usd is not None else " $ per 1M tokens: give --price-per-gpu-hour."),
    )
    return card


def run(args, parser):
    from traindx.record import load_run

    path = args.run_dir
    candidate = os.path.join(path, "candidate")
    if not os.path.isfile(os.path.join(path, "manifest.json")) and os.path.isfile(
            os.path.join(candidate, "manifest.json")):
        path = candidate  # a `diagnose --fix` folder: the card is the candidate's
    record = load_run(path)
    card = build_card(record, args)
    if args.output:
        card.save(args.output)
        print(f"card: {args.output}", file=sys.stderr)
    else:
        sys.stdout.write(card.to_yaml())
    return 0
