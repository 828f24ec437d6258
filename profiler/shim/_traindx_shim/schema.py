"""The shim's event schema: every event type it writes to `events/p<pid>.jsonl` (an event's `type`
field) and every compile kind (a `compile` event's `kind`), named once.

Standard library only and no imports at all: the shim reads it inside the job, the loader
(traindx.derive.run, traindx.profiler.columnar) and the report read it outside. A new event type is added
here first; tests/test_schema.py checks that the shim emits no type this module does not name.
"""

# -- a process and its role ---------------------------------------------------------------------
PROCESS_START = "process_start"  # pid, ppid, rank, argv, python, main_thread, t
RANK_KNOWN = "rank_known"  # rank, source (env | process_group), world_size
TRAINING = "training"  # the process showed training evidence (evidence=kind)
PACKAGE_LOADED = "package_loaded"  # a hooked package was imported (package, module, version)
SHIM_ERROR = "shim_error"  # a hook raised; the job ran on (where, error)

# -- steps ---------------------------------------------------------------------------------------
STEP_BEGIN = "step_begin"
STEP_END = "step_end"  # step, t, source, duration_s
STEP_MARKER = "step_marker"  # the job marks its own steps (source, step)
STEP_MARKER_INSTALLED = "step_marker_installed"
OPTIMIZER_CREATED = "optimizer_created"
STOP_REQUESTED = "stop_requested"  # --steps N reached: the job stops at its next boundary
STOP = "stop"  # the shim stopped the job (step, at)

# -- measured intervals and per-step aggregates -----------------------------------------------
SPAN = "span"  # cat, start, end, tid, caller (a DDP backward: grads_ready): the time ledger's lines
GC = "gc"  # per-step collector pauses
ALLOC = "alloc"  # per-step CUDA caching-allocator stats
CPU = "cpu"  # per-step CPU seconds of the process and training thread
MEM = "mem"  # per-step resident memory (and device memory), what is left (memwatch.py)
MEM_HUNT = "mem_hunt"  # memory kept growing: the census of graph-holding tensors began (step, grew)
MEM_HELD = "mem_held"  # the hunt's result: holders, allocation sites, the device's surviving blocks
CPU_THREADS = "cpu_threads"  # intra/inter-op threads, workers' threads, usable cores
HOST_SAMPLES = "host_samples"  # the training thread's stacks in a step (t0, dt_us, k, runq_us)
HOST_FRAME = "host_frame"  # a sampled frame named once (id, function, file, line)
GPU_TIME = "gpu_time"  # CUDA events at the step's measured boundaries
SELF_COST = "self_cost"  # the shim's own cost so far: steps, wall_ns, shim_ns, threads_ns, parts
SHED = "shed"  # the shim shed work above its budget (step, level, what, cost_pct, budget_pct)

# -- compiles ------------------------------------------------------------------------------------
COMPILE = "compile"  # kind (COMPILE_KINDS), kernel, key, key diff, caller, thread
FA4_CALL = "fa4_call"  # a call into FA4's interface (its caller and arguments)

# -- what the job's code did --------------------------------------------------------------------
DATALOADER = "dataloader"  # a DataLoader was iterated (caller, source line)
DATA_SITE = "data_site"  # where a DataLoader / TrainingArguments was built
DATA_USE = "data_use"  # a loader's batches reached N steps (site_id: which one)
DDP = "ddp"  # a DDP reducer ran (group)
EMPTY_CACHE = "empty_cache"  # torch.cuda.empty_cache() called (caller)
TENSOR_ORIGIN = "tensor_origin"  # the line that made a tensor argument (max_seqlen)
SWITCH = "switch"  # a process-wide setting that taxes every op (name, value, on, via, caller, step)
PARAM_USE = "param_use"  # parameters with a gradient that no optimizer updates (paramuse.py)
GRAD_ACCUM = "grad_accum"  # backward, optimizer steps and clips per step, the loss scale
# a run of no-grad forwards of the training thread, checked at the next grad forward: whether
# that forward trains on rows the run saw (fed) and whether the run's rows were new (fresh)
NOGRAD_PHASE = "nograd_phase"
HOOK_SITE = "hook_site"  # a hook or callback of the job timed in the step (id, kind, function, file, line)

# -- torch.profiler window ----------------------------------------------------------------------
TORCH_PROFILE_START = "torch_profile_start"
TORCH_PROFILE = "torch_profile"  # the window: first_step, last_step, path, its cost
TORCH_PROFILE_AFTER = "torch_profile_after"  # the step after the window (its excess)
TORCH_PROFILE_SKIPPED = "torch_profile_skipped"

# -- --fix runtime patches ----------------------------------------------------------------------
RUNTIME_PATCH = "runtime_patch"
RUNTIME_PATCH_INSTALLED = "runtime_patch_installed"
RUNTIME_PATCH_SUMMARY = "runtime_patch_summary"

EVENT_TYPES = frozenset(
    {
        PROCESS_START,
        RANK_KNOWN,
        TRAINING,
        PACKAGE_LOADED,
        SHIM_ERROR,
        STEP_BEGIN,
        STEP_END,
        STEP_MARKER,
        STEP_MARKER_INSTALLED,
        OPTIMIZER_CREATED,
        STOP_REQUESTED,
        STOP,
        SPAN,
        GC,
        ALLOC,
        CPU,
        MEM,
        MEM_HUNT,
        MEM_HELD,
        CPU_THREADS,
        HOST_SAMPLES,
        HOST_FRAME,
        GPU_TIME,
        SELF_COST,
        SHED,
        COMPILE,
        FA4_CALL,
        DATALOADER,
        DATA_SITE,
        DATA_USE,
        DDP,
        EMPTY_CACHE,
        TENSOR_ORIGIN,
        SWITCH,
        PARAM_USE,
        GRAD_ACCUM,
        NOGRAD_PHASE,
        HOOK_SITE,
        TORCH_PROFILE_START,
        TORCH_PROFILE,
        TORCH_PROFILE_AFTER,
        TORCH_PROFILE_SKIPPED,
        RUNTIME_PATCH,
        RUNTIME_PATCH_INSTALLED,
        RUNTIME_PATCH_SUMMARY,
    }
)

# what tells the loader a process trains, and what only tells who it is
TRAINING_EVENTS = frozenset({TRAINING, STEP_BEGIN, STEP_END, OPTIMIZER_CREATED})
IDENTITY_EVENTS = frozenset({PROCESS_START, RANK_KNOWN})

# -- compile kinds (a `compile` event's `kind`) ----------------------------------------------------
COMPILE_CUTE_DSL = "cute_dsl"  # a CuTe DSL kernel (FA4) compiled for a new key
COMPILE_TRITON = "triton"  # a Triton kernel compiled
COMPILE_TRITON_AUTOTUNE = "triton_autotune"  # a Triton autotuner benchmarked its configs
COMPILE_DYNAMO = "dynamo"  # a torch.compile graph (dynamo + inductor)
COMPILE_KINDS = (COMPILE_CUTE_DSL, COMPILE_TRITON, COMPILE_TRITON_AUTOTUNE, COMPILE_DYNAMO)

# -- in-process bus topics (traindx's shim modules tell each other; never written) ------------
STEP_ENDED = "step_ended"  # a step ended: subscribers get the step number
