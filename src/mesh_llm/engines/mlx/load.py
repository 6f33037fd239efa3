"""Loading a model into MLX: a Hugging Face safetensors folder or a llama GGUF file, built by mlx-lm's own
model classes (config → ``ModelArgs`` → ``Model``, ``sanitize``, ``load_weights``), so every
architecture mlx-lm supports loads, then set to the precision the device serves fastest: float32 with
dequantized weights on CPU, the source dtype (or ``--quantize``) on a GPU.

A plain float folder is built here, as ``mlx_lm.utils.load_model`` builds one, without importing
``mlx_lm.utils``: that module imports transformers (the engine's import took 3.7 s on the H200 image
with it, 1.2 s without). Folders whose weights need the rest of mlx-lm's loader (quantized, AWQ/GPTQ,
a custom model file) go through ``load_model`` itself; quantized GGUF weights use its
``infer_quant_config``.
"""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.metadata
import importlib.util
import json
import logging
import os
from pathlib import Path
from typing import Any

from mesh_llm.system.blas import mlx_lm_utils, prepare_mlx

prepare_mlx()  # before mlx and mlx-lm are first imported in the process

import mlx.core as mx
from mlx import nn
from mlx.utils import tree_flatten

from mesh_llm.engines.base import EngineError, EngineOptions
from mesh_llm.engines.hf_tokenizer import HFTokenizer, first_line
from mesh_llm.engines.mlx.kernels.quantized import install as quantized_decode
from mesh_llm.engines.mlx.projections import fuse_projections
from mesh_llm.models.spec import home_dir

log = logging.getLogger(__name__)

# MLX on CPU multiplies float32 through OpenBLAS' sgemm and has no fast path for 16-bit floats or
# quantized weights. Measured on the 2-core EPYC (mlx 0.32.4, cmeel OpenBLAS): 2048³ matmul
# float32 136 GFLOP/s, bfloat16 5.1, float16 2.9; 4096² matrix-vector float32 8 ms, bfloat16 12 ms.
# So on CPU every floating weight is served as float32, quantized ones dequantized first.
CPU_DTYPE = mx.float32
QUANT_GROUP_SIZE = 64
DEFAULT_CONTEXT = 4096  # for configs that state no max_position_embeddings
# config.json keys (and files) only mlx-lm's load_model handles: quantized or packed weights, custom
# architecture code, JSON-tagged non-finite floats
_LOAD_MODEL_KEYS = ("quantization", "quantization_config", "model_file", "quantize_activations")


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    return {**config.get("text_config", {}), **config}


def load_folder(path: Path):
    config_file = path / "config.json"
    if not config_file.is_file():
        raise EngineError(f"{config_file}: missing (not a Hugging Face model folder)")
    try:
        raw = config_file.read_text(encoding="utf-8")
        config = json.loads(raw)
        model_type = config.get("model_type")
    except (OSError, ValueError, AttributeError) as e:
        raise EngineError(f"{config_file}: unreadable JSON ({first_line(e)})") from e
    if not model_type:
        raise EngineError(f"{config_file}: no model_type")
    tokenizer = HFTokenizer.from_folder(path)
    files = sorted(path.glob("model*.safetensors"))
    if not files:
        raise EngineError(f"{path}: no model*.safetensors weight files")
    plain = (not any(k in text_config(config) for k in _LOAD_MODEL_KEYS) and '"__float__"' not in raw
             and not (path / "hf_quant_config.json").exists())
    try:
        if plain:
            weights = {}
            for file in files:
                weights.update(mx.load(str(file)))
            model = build(config, weights)
        else:
            model, config = mlx_lm_utils().load_model(path, lazy=True)
    except ValueError as e:
        if "not supported" in str(e):
            raise EngineError(f"{config_file}: model_type {model_type!r} is not supported by mlx-lm "
                              f"{importlib.metadata.version('mlx-lm')}") from e
        raise EngineError(f"{path}: {first_line(e)}") from e
    except (RuntimeError, OSError, KeyError, TypeError) as e:
        raise EngineError(f"{_bad_weight_file(path) or path}: {first_line(e)}") from e
    return model, config, tokenizer, "safetensors"


def _bad_weight_file(path: Path) -> Path | None:
    """The first safetensors file MLX cannot open (its load errors do not always name it)."""
    for file in sorted(path.glob("model*.safetensors")):
        try:
            mx.load(str(file))
        except (RuntimeError, ValueError, OSError):
            return file
    return None


@functools.cache
def _remappings() -> tuple[dict, dict] | None:
    """mlx-lm's ``MODEL_REMAPPING`` and ``MODEL_ARCHITECTURE_REMAPPING`` (model types served by
    another type's module), read from ``mlx_lm/utils.py``'s source: importing it imports
    transformers. None where the source no longer has them as literals."""
    spec = importlib.util.find_spec("mlx_lm.utils")
    found: dict[str, Any] = {}
    if spec and spec.origin:
        for node in ast.parse(Path(spec.origin).read_text(encoding="utf-8")).body:
            if (isinstance(node, ast.Assign) and len(node.targets) == 1
                    and isinstance(node.targets[0], ast.Name)
                    and node.targets[0].id in ("MODEL_REMAPPING", "MODEL_ARCHITECTURE_REMAPPING")):
                found[node.targets[0].id] = ast.literal_eval(node.value)
    if len(found) < 2:
        return None
    return found["MODEL_REMAPPING"], found["MODEL_ARCHITECTURE_REMAPPING"]


def model_classes(config: dict[str, Any]):
    """The ``Model`` and ``ModelArgs`` classes ``mlx_lm.utils._get_classes`` picks for a config
    (``_get_classes`` itself where its remappings cannot be read)."""
    remappings = _remappings()
    if remappings is None:
        return mlx_lm_utils()._get_classes(config)
    by_type, by_architecture = remappings
    model_type = config["model_type"]
    architectures = config.get("architectures") or ()
    for architecture in (architectures,) if isinstance(architectures, str) else architectures:
        if (model_type, architecture) in by_architecture:
            model_type = by_architecture[(model_type, architecture)]
            break
    else:
        model_type = by_type.get(model_type, model_type)
    try:
        module = importlib.import_module(f"mlx_lm.models.{model_type}")
    except ImportError as e:
        raise ValueError(f"Model type {model_type} not supported.") from e
    return module.Model, module.ModelArgs


def build(config: dict[str, Any], weights: dict[str, mx.array]) -> nn.Module:
    """A model of ``config``'s type holding ``weights`` (still lazy), as ``load_model`` builds it:
    sanitized, quantized where ``config["quantization"]`` says (per layer, else inferred from the
    packed shapes), strict about missing or extra weights."""
    model_class, args_class = model_classes(config)
    model = model_class(args_class.from_dict(config))
    if hasattr(model, "sanitize"):
        weights = model.sanitize(weights)
    if quant := config.get("quantization"):
        infer = mlx_lm_utils().infer_quant_config

        def predicate(p, m):
            if p in quant:
                return quant[p]
            if not hasattr(m, "to_quantized") or f"{p}.scales" not in weights:
                return False
            return infer(p, m, weights)

        nn.quantize(model, group_size=quant["group_size"], bits=quant["bits"],
                    mode=quant.get("mode", "affine"), class_predicate=predicate)
    model.eval()
    model.load_weights(list(weights.items()), strict=True)
    return model


def load_gguf(path: Path):
    try:
        from mesh_llm.models.gguf_convert import read_gguf
    except ImportError as e:
        raise EngineError(f"{path}: GGUF support (mesh_llm.models.gguf_convert) is missing") from e
    try:  # quantized tensors stay quantized here; prepare dequantizes them on CPU
        gguf = read_gguf(path, dtype=None)
    except Exception as e:  # GGUFConvertError names the file; anything else gets it added
        message = first_line(e)
        raise EngineError(message if str(path) in message else f"{path}: {message}") from e
    config = dict(gguf.config)
    try:
        model = build(config, gguf.weights)
    except (ValueError, KeyError, TypeError) as e:
        raise EngineError(f"{path}: cannot build the {config.get('model_type')} model "
                          f"({first_line(e)})") from e
    eos = config.get("eos_token_id")
    eos = eos if isinstance(eos, list) else [] if eos is None else [eos]
    tokenizer = HFTokenizer.from_json(gguf.tokenizer_json, gguf.tokenizer_config, eos)
    return model, config, tokenizer, "gguf"


def on_gpu() -> bool:
    return mx.default_device().type == mx.DeviceType.gpu


def cuda_settings() -> str | None:
    """MLX's CUDA settings, made before its first kernel runs; a user's own environment wins.

    - Attention through MLX's own kernels, not cuDNN's (MLX_CUDA_USE_CUDNN_SDPA=0): mlx 0.32.4 builds
      a cuDNN graph for each new shape, and a decode step's key length is new every step. Measured on
      the H200 (2026-12-04, Qwen2.5-0.5B shape, float16): one stream decodes at
      187-233 tok/s against 114-123, and a new prompt length's TTFT is 41-93 ms against 120-445.
    - Compiled kernels kept in mesh-llm's cache rather than the temp folder, which a reboot empties
      (the first start after one would compile them all again: 9 s of load and 2.3 s of first request
      there). One folder per MLX version and GPU architecture: the files are named by kernel only and
      hold code for one architecture.

    Returns the kernel folder, or None off CUDA."""
    if not on_gpu() or mx.metal.is_available():
        return None
    os.environ.setdefault("MLX_CUDA_USE_CUDNN_SDPA", "0")
    if os.environ.get("MLX_PTX_CACHE_DIR"):
        return os.environ["MLX_PTX_CACHE_DIR"]
    arch = str(mx.device_info().get("architecture") or "unknown").replace("/", "_")
    folder = home_dir() / "mlx-kernels" / mx.__version__ / arch
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None  # MLX falls back to its temp folder
    os.environ["MLX_PTX_CACHE_DIR"] = str(folder)
    return str(folder)


def prepare(model: nn.Module, config: dict[str, Any], options: EngineOptions,
             path: Path) -> dict[str, str]:
    """Set the serving precision (lazily, before the weights are read) and describe it."""
    quant = config.get("quantization")
    source = quant_name(quant) if quant else float_dtype(model)
    if not on_gpu():
        if options.quantize:
            log.warning("%s: quantize=%s ignored: MLX has no fast quantized CPU kernel",
                        path, options.quantize)
        model.set_dtype(CPU_DTYPE)  # first, so that scales and biases dequantize in float32
        if quant:
            mlx_lm_utils().dequantize_model(model)
        return {"dtype": "float32", "quantization": f"dequantized from {source}" if quant else "none",
                "source_dtype": source}
    if options.quantize and quant:
        log.warning("%s: quantize=%s ignored: the weights are already %s", path, options.quantize, source)
    if options.quantize and not quant:
        if options.quantize not in (4, 8):
            raise EngineError(f"{path}: quantize must be 4 or 8, not {options.quantize}")
        custom = getattr(model, "quant_predicate", None)

        def predicate(p, m):
            if not hasattr(m, "to_quantized") or m.weight.shape[-1] % QUANT_GROUP_SIZE:
                return False
            return custom(p, m) if custom else True

        nn.quantize(model, QUANT_GROUP_SIZE, options.quantize, class_predicate=predicate)
        quant = {"bits": options.quantize, "group_size": QUANT_GROUP_SIZE, "mode": "affine"}
    return {"dtype": float_dtype(model), "quantization": quant_name(quant) if quant else "none",
            "source_dtype": source}


def materialize(model: nn.Module, path: Path, progress) -> None:
    """Read (and convert) the weights now, reporting progress in bytes as each tensor lands."""
    params = [v for _, v in tree_flatten(model.parameters())]
    total, done = sum(v.nbytes for v in params), 0
    try:
        for v in params:
            mx.eval(v)
            done += v.nbytes
            if progress is not None:
                progress(done, total)
    except (RuntimeError, ValueError) as e:
        raise EngineError(f"{path}: cannot read the weights ({first_line(e)})") from e


def float_dtype(model: nn.Module) -> str:
    for _, v in tree_flatten(model.parameters()):
        if mx.issubdtype(v.dtype, mx.floating):
            return str(v.dtype).removeprefix("mlx.core.")
    return "unknown"


def quant_name(quant: dict[str, Any]) -> str:
    return f"{quant.get('bits')}-bit {quant.get('mode', 'affine')} g{quant.get('group_size')}"


def load_any(path: Path, options: EngineOptions, progress=None):
    """``(model, config, tokenizer, model_format, details, context_length)`` for a folder or a GGUF
    file, its weights read and converted; :class:`EngineError` with a one-line message otherwise."""
    path = Path(path)
    if path.is_dir():
        model, config, tokenizer, fmt = load_folder(path)
    elif path.is_file() and path.suffix.lower() == ".gguf":
        model, config, tokenizer, fmt = load_gguf(path)
    elif path.exists():
        raise EngineError(f"{path}: not a model folder or a .gguf file")
    else:
        raise EngineError(f"{path}: no such file or folder")
    details = prepare(model, config, options, path)
    if on_gpu() and (fused := fuse_projections(model)):  # a CPU's step is bound by arithmetic
        details["projections"] = f"q/k/v and gate/up as one product each ({fused} layers)"
    if routed := quantized_decode(model):  # on CUDA only
        details["quantized_decode"] = (f"decode batches as one product, 2-16 rows of large weights through "
                                       f"mesh-llm's kernels, prompts through the dequantized weights "
                                       f"({routed} layers)")
    materialize(model, path, progress)
    ctx = options.ctx_size or text_config(config).get("max_position_embeddings") or DEFAULT_CONTEXT
    return model, config, tokenizer, fmt, details, int(ctx)
