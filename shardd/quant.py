"""Quantized checkpoints: which `quantization_config`s we load exactly (FP8 weights), and one object per quantized
linear holding its bytes and scales.

Loaded (weights only; activations stay in the model's dtype):
- `quant_method: "fp8"` (transformers' FineGrainedFP8, DeepSeek/Qwen `-FP8` releases): `fmt: "e4m3"`,
  `weight_block_size: [128, 128]`, each linear `weight` float8_e4m3fn with a float32 `weight_scale_inv`
  [ceil(N/128), ceil(K/128)] (partial blocks at the edges); `modules_to_not_convert` stay unquantized;
  `activation_scheme: "dynamic"` only.
- `quant_method: "compressed-tensors"` FP8 (llm-compressor's FP8 / FP8_DYNAMIC / FP8_BLOCK): float 8-bit weights with
  a `weight_scale` per output channel [N, 1], per tensor [1] or per 128x128 block; input activations dynamic or
  none; an `ignore` list (names, or `re:` patterns).
Everything else (GPTQ, AWQ, bitsandbytes, NVFP4/modelopt, GGUF, int4/int8 compressed-tensors, static activation
scales, FP8 KV caches) is refused by name: loading it with its scales ignored would compute garbage.

dequantized weight = float32(weight) * scale (the scale broadcast over its block or row), as transformers and vLLM
compute it. The CPU reference path dequantizes at load; the GPU step keeps `Fp8Linear`s and runs them through the
weight-only FP8 GEMM (`shardd/kernels/fp8_gemm.py`), chosen once when the object is built.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F

FP8_BLOCK = "fp8-block"      # quant_method "fp8", weight_scale_inv per [128, 128] block
FP8_CHANNEL = "fp8-channel"  # compressed-tensors FP8, weight_scale per output channel
LAYOUTS = (FP8_BLOCK, FP8_CHANNEL)
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(float8_e4m3fn).max

# the linear layers of a Qwen3.5 decoder layer: the only modules a quantization_config can quantize here
LINEAR_LEAVES = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj", "q_proj", "k_proj", "v_proj",
                 "o_proj", "gate_proj", "up_proj", "down_proj")

_KNOWN_REFUSED = {  # quant_method -> what it is, for the refusal message
    "gptq": "GPTQ int4/int8", "awq": "AWQ int4", "bitsandbytes": "bitsandbytes int8/nf4", "modelopt": "NVIDIA modelopt",
    "gguf": "GGUF", "hqq": "HQQ", "eetq": "EETQ int8", "aqlm": "AQLM", "quanto": "optimum-quanto",
    "torchao": "torchao", "fbgemm_fp8": "FBGEMM FP8 (per-row activations)", "mxfp4": "MXFP4", "bitnet": "BitNet",
    "higgs": "HIGGS", "vptq": "VPTQ", "spqr": "SpQR", "auto-round": "AutoRound", "compressed_tensors": "compressed-tensors",
}


class QuantizationError(ValueError):
    """A quantization_config we cannot load exactly; the message names the method and the field."""


@dataclass(frozen=True)
class Fp8Scheme:
    """How a checkpoint's FP8 linears are stored: the method, the scale key and granularity, what stays unquantized."""

    method: str                          # "fp8" or "compressed-tensors"
    scale_key: str                       # "weight_scale_inv" (fp8) or "weight_scale" (compressed-tensors)
    block: tuple[int, int] | None        # (128, 128), or None: one scale per output channel (or per tensor)
    not_converted: tuple[str, ...] = ()  # fp8: modules_to_not_convert (substrings of the module name)
    ignore: tuple[str, ...] = ()         # compressed-tensors: module names, or `re:` patterns

    @property
    def layout(self) -> str:
        return FP8_BLOCK if self.block is not None else FP8_CHANNEL

    def quantizes(self, module: str) -> bool:
        """Whether the linear `module` (the checkpoint's name, `model.language_model.layers.0.mlp.up_proj`) is FP8."""
        leaf = module.rsplit(".", 1)[-1]
        if leaf not in LINEAR_LEAVES or ".layers." not in f".{module}":
            return False  # embeddings, norms, conv1d, lm_head: never quantized (transformers keeps lm_head out too)
        if any(entry in module for entry in self.not_converted):
            return False
        for entry in self.ignore:
            if entry.startswith("re:"):
                if re.match(entry[3:], module):
                    return False
            elif entry == module or module.endswith("." + entry):
                return False
        return True

    def describe(self) -> dict:
        """HELLO's `quantization` field."""
        return {"method": self.method, "layout": self.layout, "weight_dtype": "float8_e4m3fn",
                "block": list(self.block) if self.block else None, "activations": "unquantized (weight-only)"}


def scheme_from_config(raw: dict, where: str = "checkpoint") -> Fp8Scheme | None:
    """The FP8 scheme of a config.json (its `quantization_config`, top level or in `text_config`), None if it has
    none; QuantizationError naming the method otherwise."""
    quant = None
    for section in (raw, raw.get("text_config") or {}):
        if isinstance(section, dict) and section.get("quantization_config") is not None:
            quant = section["quantization_config"]
            break
    if quant is None:
        return None
    if not isinstance(quant, dict):
        raise QuantizationError(f"{where}: quantization_config must be a mapping, got {type(quant).__name__}")
    method = quant.get("quant_method")
    if method == "fp8":
        return _fp8_method(quant, where)
    if method == "compressed-tensors":
        return _compressed_tensors(quant, where)
    what = _KNOWN_REFUSED.get(str(method).lower(), "not a method shardd knows")
    raise QuantizationError(
        f"{where} is quantized with quant_method {method!r} ({what}), which shardd does not load: only FP8 "
        f"checkpoints (quant_method 'fp8' with 128x128 blocks, or compressed-tensors FP8) are supported; use the "
        f"unquantized or an FP8 checkpoint"
    )


def _fp8_method(quant: dict, where: str) -> Fp8Scheme:
    fmt = quant.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise QuantizationError(f"{where}: quant_method 'fp8' with fmt {fmt!r} is not supported (only 'e4m3')")
    scheme = quant.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise QuantizationError(
            f"{where}: quant_method 'fp8' with activation_scheme {scheme!r} (static input_scale) is not supported: "
            f"shardd runs FP8 weights with unquantized activations, which a static-activation checkpoint was not "
            f"calibrated for (only 'dynamic')"
        )
    block = quant.get("weight_block_size")
    if block is None:
        raise QuantizationError(
            f"{where}: quant_method 'fp8' without weight_block_size (one scale per tensor) is not supported "
            f"(only weight_block_size [128, 128])")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise QuantizationError(f"{where}: weight_block_size must be two positive integers, got {block!r}")
    if tuple(block) != (128, 128):
        raise QuantizationError(f"{where}: weight_block_size {block} is not supported (only [128, 128])")
    skip = quant.get("modules_to_not_convert") or []
    if not isinstance(skip, list) or not all(isinstance(s, str) for s in skip):
        raise QuantizationError(f"{where}: modules_to_not_convert must be a list of module names, got {skip!r}")
    return Fp8Scheme("fp8", "weight_scale_inv", (128, 128), not_converted=tuple(skip))


def _compressed_tensors(quant: dict, where: str) -> Fp8Scheme:
    name = f"{where}: compressed-tensors"
    fmt = quant.get("format")
    if fmt not in ("float-quantized", "naive-quantized"):
        raise QuantizationError(
            f"{name} format {fmt!r} is not supported (only FP8 weights, format 'float-quantized'; int4/int8 "
            f"'pack-quantized'/'int-quantized', NVFP4 and sparse formats are refused)")
    if quant.get("kv_cache_scheme") is not None:
        raise QuantizationError(f"{name} with a kv_cache_scheme (quantized KV cache) is not supported")
    groups = quant.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise QuantizationError(f"{name} has no config_groups")
    blocks = set()
    for group_name, group in groups.items():
        where_group = f"{name} config_groups.{group_name}"
        if not isinstance(group, dict):
            raise QuantizationError(f"{where_group} must be a mapping")
        targets = group.get("targets")
        if targets != ["Linear"]:
            raise QuantizationError(f"{where_group}.targets {targets!r} is not supported (only ['Linear'])")
        weights = group.get("weights") or {}
        if weights.get("type") != "float" or weights.get("num_bits") != 8:
            raise QuantizationError(
                f"{where_group}.weights is {weights.get('type')!r} with {weights.get('num_bits')!r} bits: only FP8 "
                f"weights (type 'float', num_bits 8) are supported (int4/int8/NVFP4 are refused)")
        if weights.get("dynamic") or not weights.get("symmetric", True):
            raise QuantizationError(f"{where_group}.weights must be static and symmetric")
        strategy = weights.get("strategy")
        if strategy in ("channel", "tensor"):
            blocks.add(None)
        elif strategy == "block" and weights.get("block_structure") == [128, 128]:
            blocks.add((128, 128))
        else:
            raise QuantizationError(
                f"{where_group}.weights.strategy {strategy!r} is not supported (only 'channel', 'tensor' or "
                f"'block' with block_structure [128, 128])")
        acts = group.get("input_activations")
        if acts is not None and not (acts.get("dynamic") is True and acts.get("type") == "float"):
            raise QuantizationError(
                f"{where_group}.input_activations are static (input_scale): not supported (only dynamic or none; "
                f"shardd keeps activations unquantized)")
        if group.get("output_activations") is not None:
            raise QuantizationError(f"{where_group}.output_activations are not supported")
    if len(blocks) != 1:
        raise QuantizationError(f"{name}: config_groups mix scale layouts {sorted(map(str, blocks))}")
    ignore = quant.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(s, str) for s in ignore):
        raise QuantizationError(f"{name} ignore must be a list of module names, got {ignore!r}")
    return Fp8Scheme("compressed-tensors", "weight_scale", blocks.pop(), ignore=tuple(ignore))


# ---- scales and dequantization ----------------------------------------------------------------------

def scale_shape(scheme: Fp8Scheme, shape: tuple[int, int]) -> tuple[int, ...]:
    """The scale tensor's shape for a [N, K] weight."""
    n, k = shape
    if scheme.block is not None:
        return (math.ceil(n / scheme.block[0]), math.ceil(k / scheme.block[1]))
    return (n, 1)


def dequantize(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    """float32 [N, K]: weight * its scale (per block, partial at the edges; or per row, or one per tensor).
    The same function as shardd/kernels/fp8_gemm.py's `dequantize_fp8`, kept here so the CPU never needs Triton."""
    w = weight.to(torch.float32)
    n, k = w.shape
    scale = scale.to(device=w.device, dtype=torch.float32)
    if block is None:
        return w * scale.reshape(-1, 1) if scale.numel() > 1 else w * scale.reshape(())
    bn, bk = block
    expanded = scale.repeat_interleave(bn, dim=0)[:n].repeat_interleave(bk, dim=1)[:, :k]
    return w * expanded


def quantize(weight: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, float32 scale) of a float weight [N, K], as llm-compressor / DeepSeek's tools write
    them: scale = amax / 448 per 128x128 block (fp8-block) or per output row (fp8-channel)."""
    w = weight.to(torch.float32)
    n, k = w.shape
    if layout == FP8_CHANNEL:
        scale = (w.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=1e-12)  # [N, 1]
        return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale
    if layout != FP8_BLOCK:
        raise ValueError(f"unknown FP8 layout {layout!r}; choose one of {', '.join(LAYOUTS)}")
    bn, bk = 128, 128
    rows, cols = math.ceil(n / bn), math.ceil(k / bk)
    padded = F.pad(w, (0, cols * bk - k, 0, rows * bn - n))
    amax = padded.abs().reshape(rows, bn, cols, bk).amax(dim=(1, 3))
    scale = (amax / FP8_MAX).clamp(min=1e-12)  # [rows, cols]
    expanded = scale.repeat_interleave(bn, dim=0)[:n].repeat_interleave(bk, dim=1)[:, :k]
    return (w / expanded).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def quantization_config(layout: str, ignore: list[str]) -> dict:
    """The config.json `quantization_config` of `layout`, as the tools that write real checkpoints write it."""
    if layout == FP8_BLOCK:
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
                "modules_to_not_convert": ignore}
    if layout == FP8_CHANNEL:
        return {
            "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False},
                "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True,
                                      "dynamic": True},
                "output_activations": None,
            }},
            "ignore": ignore, "kv_cache_scheme": None,
        }
    raise ValueError(f"unknown FP8 layout {layout!r}; choose one of {', '.join(LAYOUTS)}")


# What synthetic FP8 models leave unquantized, in each method's own syntax: the head (as every FP8 release does) and
# the GDN `a` projection (so a fused in_proj mixes FP8 and bf16 parts, as checkpoints that skip small layers do).
SYNTHETIC_IGNORE = {FP8_BLOCK: ["lm_head", "linear_attn.in_proj_a"],
                    FP8_CHANNEL: ["lm_head", r"re:.*linear_attn\.in_proj_a$"]}


def synthetic_scheme(layout: str) -> Fp8Scheme:
    return scheme_from_config({"quantization_config": quantization_config(layout, SYNTHETIC_IGNORE[layout])})


# ---- one quantized linear ---------------------------------------------------------------------------

def _kernel(device: torch.device):
    """The GEMM for FP8 weights on `device`, chosen once: the Triton weight-only kernel where it is installed and
    the device is a GPU, else dequantize-then-matmul (correct everywhere, as slow as a bf16 GEMM plus a dequant)."""
    if device.type == "cuda":
        try:
            from shardd.kernels.fp8_gemm import fp8_linear
            return fp8_linear
        except ImportError:
            pass
    return dequantize_linear


def dequantize_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block) -> torch.Tensor:
    return F.linear(x, dequantize(weight, scale, block).to(x.dtype))


class Fp8Linear:
    """One FP8 linear: weight [N, K] float8_e4m3fn, its float32 scale, and the kernel that multiplies by it.

    `F.linear(x, fp8_linear)` works (through `__torch_function__`), so the model code and the fast step call it
    exactly as they call a bf16 matrix."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None, kernel=None):
        if weight.dtype != FP8_DTYPE or weight.dim() != 2:
            raise ValueError(f"an Fp8Linear holds a 2-D float8_e4m3fn weight, got {weight.dtype} {list(weight.shape)}")
        self.weight, self.block = weight, block
        self.scale = scale.to(torch.float32)
        self.kernel = kernel or _kernel(weight.device)

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + self.scale.nbytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:
            return self.kernel(x, self.weight, self.scale, self.block)
        rows = x.reshape(-1, x.shape[-1])
        return self.kernel(rows, self.weight, self.scale, self.block).reshape(*x.shape[:-1], self.shape[0])

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is F.linear and len(args) >= 2 and isinstance(args[1], Fp8Linear):
            bias = args[2] if len(args) > 2 else (kwargs or {}).get("bias")
            if bias is not None:
                raise NotImplementedError("FP8 linears of Qwen3.5 have no bias")
            return args[1](args[0])
        return NotImplemented

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self.weight, self.scale, self.block).to(dtype)

    def rows(self, start: int, stop: int) -> "Fp8Linear":
        """Rows [start, stop) as a view (a block-scaled matrix splits only at a block boundary, or its end)."""
        if self.block is None:
            return Fp8Linear(self.weight[start:stop], self.scale.reshape(-1, 1)[start:stop], None, self.kernel)
        bn = self.block[0]
        if start % bn:
            raise ValueError(f"a block-scaled FP8 matrix splits at multiples of {bn} rows, not at {start}")
        return Fp8Linear(self.weight[start:stop], self.scale[start // bn : math.ceil(stop / bn)], self.block, self.kernel)


def fuses_exactly(parts: list[Fp8Linear]) -> bool:
    """Whether these FP8 matrices concatenate along the output dim into one with the same scales: per-channel
    always; per-block when every part but the last has a multiple of the block's rows (else one block would mix
    two parts' scales)."""
    blocks = {p.block for p in parts}
    if len(blocks) != 1:
        return False
    block = blocks.pop()
    return block is None or all(p.shape[0] % block[0] == 0 for p in parts[:-1])


def cat_rows(parts: list[Fp8Linear]) -> Fp8Linear:
    """One FP8 matrix of `parts` stacked along the output dim (fuses_exactly(parts) must hold)."""
    block = parts[0].block
    weight = torch.cat([p.weight for p in parts], dim=0)
    if block is None:
        scale = torch.cat([p.scale.reshape(-1, 1) for p in parts], dim=0)
    else:
        scale = torch.cat([p.scale for p in parts], dim=0)
    return Fp8Linear(weight, scale, block, parts[0].kernel)


class StackedLinear:
    """Several matrices applied to one input, outputs concatenated: the fused form of parts that cannot share one
    matrix (a block-scaled part whose rows are not a multiple of 128, or FP8 beside an unquantized part).
    Exact: each part is computed as on its own."""

    def __init__(self, groups: list):
        self.groups = groups  # Fp8Linear or torch.Tensor, each one or more fused parts

    @property
    def shape(self) -> torch.Size:
        return torch.Size((sum(g.shape[0] for g in self.groups), self.groups[0].shape[1]))

    @property
    def nbytes(self) -> int:
        return sum(g.nbytes for g in self.groups)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is F.linear and len(args) >= 2 and isinstance(args[1], StackedLinear):
            return args[1](args[0])
        return NotImplemented

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The groups' outputs side by side. On a GPU each group writes its own columns of one output (the FP8
        kernel and the narrow bf16 kernel take an output view): no torch.cat of the parts, and a narrow bf16 part
        (the GDN `a` a checkpoint leaves unquantized) in one small kernel instead of cuBLAS's split-K pair."""
        if x.dim() != 2 or not all(_writes_into(g, x) for g in self.groups):
            return torch.cat([F.linear(x, g) for g in self.groups], dim=-1)
        from shardd.kernels.narrow_gemm import narrow_linear

        out = torch.empty(x.shape[0], self.shape[0], dtype=x.dtype, device=x.device)
        start = 0
        for group in self.groups:
            stop = start + group.shape[0]
            if isinstance(group, Fp8Linear):
                group.kernel(x, group.weight, group.scale, group.block, out=out[:, start:stop])
            else:
                narrow_linear(x, group, out[:, start:stop])
            start = stop
        return out


def _writes_into(group, x: torch.Tensor) -> bool:
    """Whether a StackedLinear group computes x's product into a view of the output: an FP8 matrix with the
    Triton kernel, or a narrow unquantized matrix of x's dtype and device (shardd.kernels.narrow_gemm), where the
    kernels run (a GPU, or Triton's interpreter)."""
    from shardd.kernels import interpreted

    if x.device.type != "cuda" and not interpreted():
        return False
    if isinstance(group, Fp8Linear):
        return group.kernel is not dequantize_linear
    from shardd.kernels.narrow_gemm import MAX_N

    return (isinstance(group, torch.Tensor) and group.device == x.device and group.dtype == x.dtype
            and group.dim() == 2 and group.shape[0] <= MAX_N and group.stride(1) == 1)


def is_quantized(matrix) -> bool:
    return isinstance(matrix, (Fp8Linear, StackedLinear))


def fuse_rows(parts: list) -> tuple[object, list]:
    """(the fused matrix, a view of each part in it) for matrices stacked along the output dim: one bf16 tensor
    (torch.cat) when none is FP8, one Fp8Linear when the FP8 parts fuse exactly, else a StackedLinear of the
    longest runs that do."""
    if not any(isinstance(p, Fp8Linear) for p in parts):
        fused = torch.cat(parts, dim=0)
        views, start = [], 0
        for p in parts:
            views.append(fused[start : start + p.shape[0]])
            start += p.shape[0]
        return fused, views
    if all(isinstance(p, Fp8Linear) for p in parts) and fuses_exactly(parts):
        fused = cat_rows(parts)
        views, start = [], 0
        for p in parts:
            views.append(fused.rows(start, start + p.shape[0]))
            start += p.shape[0]
        return fused, views
    groups: list[list] = []
    for p in parts:  # greedy runs: FP8 parts that fuse exactly with the run so far
        run = groups[-1] if groups else None
        if run and isinstance(p, Fp8Linear) and all(isinstance(q, Fp8Linear) for q in run) and fuses_exactly(run + [p]):
            run.append(p)
        else:
            groups.append([p])
    fused_groups, views = [], []
    for run in groups:
        fused, run_views = fuse_rows(run)
        fused_groups.append(fused)
        views.extend(run_views)
    return StackedLinear(fused_groups), views
