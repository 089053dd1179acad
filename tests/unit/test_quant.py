"""FP8 checkpoints (shardd/weights/quant.py): both layouts load and match transformers running the dequantized weights in
float32, through several shards and every rollback mode, and through the fast step with the FP8 bytes kept; every
other quantization is refused by name; the memory budget adds up and refuses what does not fit."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from common import quantization
from common.model_config import ConfigError, config_from_dict, load_config
from common.presets import PRESETS, preset_config
from coordinator.decoding import greedy_decode, speculative_decode
from coordinator.drafting.drafters import OracleDrafter
from protocol.layout import CHECKPOINT, REPLAY, REPLAY_SSM
from shardd.weights import quant
from shardd.weights.loading import ModelSource, build_shard
from shardd.local import LocalTarget
from common.memory import GiB, parse_memory
from shardd.engine.reference.rollback import RollbackStorage
from shardd.synthetic.model import write_checkpoint
from shardd.weights.reader import WeightError, shard_shapes
from tests.support.daemons import Daemon, free_tcp_endpoint, serve_command
from tests.support.reference import hf_logits_and_hidden, hf_model

LAYOUTS = (quantization.FP8_BLOCK, quantization.FP8_CHANNEL)


def ragged_config(layers: int = 6):
    """tiny, widened so 128x128 blocks are partial at both edges: hidden 160 (a 32-wide last block column),
    intermediate 200 (a 72-row last block), GDN in_proj_qkv 96 rows (one partial block)."""
    return config_from_dict({**PRESETS["tiny"], "hidden_size": 160, "intermediate_size": 200, "num_hidden_layers": layers})


def prompt(n: int, vocab: int, seed: int = 3) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def dequantized_copy(src: Path, dst: Path) -> Path:
    """The same checkpoint with every FP8 weight multiplied out to float32 and the scales dropped: what transformers
    runs as the reference."""
    raw = json.loads((src / "config.json").read_text())
    scheme = quantization.scheme_from_config(raw)
    raw.pop("quantization_config")
    dst.mkdir()
    (dst / "config.json").write_text(json.dumps(raw))
    for path in src.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as f:
            tensors = {key: f.get_tensor(key) for key in f.keys()}
        out = {}
        for key, tensor in tensors.items():
            if key.endswith(scheme.scale_key):
                continue
            scale = tensors.get(key.removesuffix("weight") + scheme.scale_key)
            out[key] = tensor.float() if scale is None else quant.dequantize(tensor, scale, scheme.block)
        save_file(out, str(dst / path.name))
    return dst


@pytest.fixture(scope="module", params=LAYOUTS)
def fp8_model(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    quantized = write_checkpoint(root / "fp8", ragged_config(), seed=5, quantize=request.param)
    return {"layout": request.param, "dir": quantized, "dequantized": dequantized_copy(quantized, root / "dequantized")}


def test_checkpoint_holds_fp8_bytes_with_their_scales_and_ignored_modules_unquantized(fp8_model):
    raw = json.loads((fp8_model["dir"] / "config.json").read_text())
    scheme = quantization.scheme_from_config(raw)
    assert scheme.layout == fp8_model["layout"]
    with safe_open(str(next(fp8_model["dir"].glob("*.safetensors"))), framework="pt") as f:
        keys = set(f.keys())
        up = "model.language_model.layers.0.mlp.up_proj.weight"
        assert f.get_tensor(up).dtype == torch.float8_e4m3fn
        scale = f.get_tensor(up.removesuffix("weight") + scheme.scale_key)
        # [200, 160]: 2 x 2 blocks, the last row of blocks 72 rows, the last column 32 wide; or one scale per row
        assert scale.dtype == torch.float32 and tuple(scale.shape) == ((2, 2) if scheme.block else (200, 1))
        ignored = "model.language_model.layers.0.linear_attn.in_proj_a.weight"
        assert f.get_tensor(ignored).dtype == torch.float32
        assert ignored.removesuffix("weight") + scheme.scale_key not in keys
        assert f.get_tensor("lm_head.weight").dtype == torch.float32


def test_logits_through_three_shards_match_transformers_on_the_dequantized_weights(fp8_model):
    config = load_config(fp8_model["dir"])
    tokens = prompt(24, config.vocab_size)
    reference, _ = hf_logits_and_hidden(hf_model(fp8_model["dequantized"]), tokens)
    hidden = None
    for begin, end in ((0, 2), (2, 4), (4, 6)):
        shard = build_shard(ModelSource(model_dir=str(fp8_model["dir"])), begin, end)
        out = shard.forward(shard.new_state(64), 0, tokens=tokens if begin == 0 else None, hidden=hidden)
        hidden = out.hidden
    assert (out.logits - reference).abs().max().item() <= 1e-4
    # the FP8 rounding is visible: the raw float32 synthetic model differs
    unquantized = build_shard(ModelSource(synthetic="tiny"), 0, 6)  # a different shape: only a sanity anchor
    assert unquantized.config.hidden_size != config.hidden_size


def test_every_rollback_mode_gives_the_greedy_tokens_of_transformers(fp8_model):
    source = ModelSource(model_dir=str(fp8_model["dir"]))
    config = source.config()
    splits = [(0, 2), (2, 4), (4, 6)]
    tokens = prompt(10, config.vocab_size)
    targets = {mode: LocalTarget(source, splits, RollbackStorage(mode, 4)) for mode in (CHECKPOINT, REPLAY_SSM)}
    greedy = greedy_decode(targets[CHECKPOINT], 1, tokens, 8).tokens
    logits, _ = hf_logits_and_hidden(hf_model(fp8_model["dequantized"]), tokens + greedy[:-1])
    assert logits[len(tokens) - 1 :].argmax(-1).tolist() == greedy
    for mode in (CHECKPOINT, REPLAY_SSM, REPLAY):
        target = targets[CHECKPOINT if mode == REPLAY else mode]
        drafter = OracleDrafter.with_mean_commit(greedy, len(tokens), block_size=4, mean_commit=2)
        result = speculative_decode(target, 2, tokens, drafter, block_size=4, rollback=mode, max_new_tokens=8)
        assert result.tokens == greedy, mode
        assert result.rollbacks_fast + result.replays > 0


def test_synthetic_quantize_equals_the_written_checkpoint(tmp_path):
    written = write_checkpoint(tmp_path / "m", preset_config("tiny"), seed=0, quantize=quantization.FP8_CHANNEL)
    shapes = shard_shapes(preset_config("tiny"), 0, 3)
    from_disk = ModelSource(model_dir=str(written)).tensors(shapes, dtype=torch.float32, keep_fp8=True)
    in_memory = ModelSource(synthetic="tiny", quantize=quantization.FP8_CHANNEL).tensors(shapes, dtype=torch.float32,
                                                                                  keep_fp8=True)
    up = "layers.0.mlp.up_proj.weight"
    assert isinstance(from_disk[up], quant.Fp8Linear) and isinstance(in_memory[up], quant.Fp8Linear)
    assert torch.equal(from_disk[up].weight.view(torch.uint8), in_memory[up].weight.view(torch.uint8))
    assert torch.equal(from_disk[up].scale, in_memory[up].scale)
    assert not quant.is_quantized(from_disk["layers.0.linear_attn.in_proj_a.weight"])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_fast_step_keeps_the_fp8_bytes_and_matches_the_reference(layout, tmp_path):
    """The fused matrices hold FP8 bytes and per-part scales (block scales fuse into one matrix only where the parts
    before the last are whole blocks; the unquantized `a` sits beside), and the step's tokens are the reference's."""
    pytest.importorskip("triton")
    from shardd.engine.fast.shard import FastShard

    written = write_checkpoint(tmp_path / "m", ragged_config(layers=3), seed=5, quantize=layout)
    source = ModelSource(model_dir=str(written))
    storage = RollbackStorage(CHECKPOINT, 4)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # on a GPU: the FP8 kernel, graphs on
    fast = FastShard(build_shard(source, 0, 3, storage=storage, keep_fp8=True, device=device), max_sequences=2,
                     max_context=64)
    gdn, attention = fast.layers[0], fast.layers[2]
    in_proj = gdn.mixer.in_proj
    assert isinstance(in_proj, quant.StackedLinear) and not quant.is_quantized(in_proj.groups[-1])  # a: not converted
    assert all(isinstance(g, quant.Fp8Linear) for g in in_proj.groups[:-1])
    if layout == quantization.FP8_BLOCK:
        # qkv has 96 rows (a partial block), q 128 | k 32 | v 32, gate 200: each splits where a block would mix parts
        assert len(in_proj.groups) == 4  # qkv | z | b | a
        assert [g.shape[0] for g in attention.mixer.qkv.groups] == [160, 32]  # q|k, v
        assert [g.shape[0] for g in gdn.gate_up.groups] == [200, 200]
    else:  # per-channel scales always fuse: one FP8 matrix each
        assert len(in_proj.groups) == 2  # qkv|z|b, a
        assert isinstance(attention.mixer.qkv, quant.Fp8Linear) and isinstance(gdn.gate_up, quant.Fp8Linear)
        assert attention.mixer.qkv.weight.dtype == torch.float8_e4m3fn
    reference = build_shard(source, 0, 3, storage=storage, device=device)
    tokens = prompt(5, 320)
    target_fast, target_ref = LocalTarget.from_shards([fast], 64), LocalTarget.from_shards([reference], 64)
    greedy = greedy_decode(target_ref, 1, tokens, 4).tokens
    drafter = OracleDrafter.with_mean_commit(greedy, len(tokens), block_size=4, mean_commit=2)
    assert speculative_decode(target_fast, 2, tokens, drafter, block_size=4, max_new_tokens=4).tokens == greedy


def test_fusing_block_scales_is_exact_only_at_block_boundaries():
    gen = torch.Generator().manual_seed(0)
    parts = [quant.Fp8Linear(*quant.quantize(torch.randn(n, 200, generator=gen), quantization.FP8_BLOCK), (128, 128))
             for n in (256, 128, 48, 48)]
    fused, views = quant.fuse_rows(parts)
    assert isinstance(fused, quant.StackedLinear) and len(fused.groups) == 2  # 256|128|48, then 48
    x = torch.randn(3, 200, generator=gen)
    whole = torch.nn.functional.linear(x, fused)
    alone = torch.cat([torch.nn.functional.linear(x, p.dequantized()) for p in parts], dim=-1)
    assert torch.equal(whole, alone)
    for view, part in zip(views, parts):
        assert torch.equal(view.dequantized(), part.dequantized())


def test_dequantize_is_the_kernel_modules_reference():
    """shardd.weights.quant.dequantize (Triton-free, for the CPU) and the kernel's dequantize_fp8 are the same function."""
    fp8_gemm = pytest.importorskip("shardd.engine.kernels.fp8_gemm")
    gen = torch.Generator().manual_seed(1)
    for layout in LAYOUTS:
        weight, scale = quant.quantize(torch.randn(200, 160, generator=gen), layout)
        block = (128, 128) if layout == quantization.FP8_BLOCK else None
        assert torch.equal(quant.dequantize(weight, scale, block), fp8_gemm.dequantize_fp8(weight, scale, block))


# ---- refusals ---------------------------------------------------------------------------------------

_CT_FP8 = quantization.quantization_config(quantization.FP8_CHANNEL, ["lm_head"])


def _ct(**weights):
    group = {**_CT_FP8["config_groups"]["group_0"]}
    group["weights"] = {**group["weights"], **weights}
    return {**_CT_FP8, "config_groups": {"group_0": group}}


REFUSED = {
    "gptq": ({"quant_method": "gptq", "bits": 4, "group_size": 128}, "quant_method 'gptq' (GPTQ"),
    "awq": ({"quant_method": "awq", "bits": 4, "version": "gemm"}, "quant_method 'awq' (AWQ"),
    "bitsandbytes": ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method 'bitsandbytes'"),
    "nvfp4-modelopt": ({"quant_method": "modelopt", "quant_algo": "NVFP4"}, "quant_method 'modelopt'"),
    "gguf": ({"quant_method": "gguf"}, "quant_method 'gguf'"),
    "fp8-static": ({**quantization.quantization_config(quantization.FP8_BLOCK, []), "activation_scheme": "static"},
                   "activation_scheme 'static'"),
    "fp8-per-tensor": ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "without weight_block_size"),
    "fp8-e5m2": ({**quantization.quantization_config(quantization.FP8_BLOCK, []), "fmt": "e5m2"}, "fmt 'e5m2'"),
    "fp8-64-blocks": ({**quantization.quantization_config(quantization.FP8_BLOCK, []), "weight_block_size": [64, 64]},
                      "weight_block_size [64, 64]"),
    "ct-int4": ({**_ct(type="int", num_bits=4), "format": "pack-quantized"}, "format 'pack-quantized'"),
    "ct-int8": (_ct(type="int", num_bits=8), "'int' with 8 bits"),
    "ct-nvfp4": ({**_ct(num_bits=4, group_size=16, strategy="tensor_group"), "format": "nvfp4-pack-quantized"},
                 "format 'nvfp4-pack-quantized'"),
    "ct-static-activations": ({**_CT_FP8, "config_groups": {"group_0": {
        **_CT_FP8["config_groups"]["group_0"],
        "input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}}}},
        "input_activations are static"),
    "ct-fp8-kv-cache": ({**_CT_FP8, "kv_cache_scheme": {"num_bits": 8, "type": "float"}}, "kv_cache_scheme"),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_other_quantizations_are_refused_by_name(name, tmp_path):
    quantization, message = REFUSED[name]
    raw = {"model_type": "qwen3_5", "text_config": {**PRESETS["tiny"]}, "quantization_config": quantization}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(tmp_path)


def test_a_checkpoint_whose_dtypes_disagree_with_its_config_is_refused_naming_the_tensor(fp8_model, tmp_path):
    copy = tmp_path / "m"
    shutil.copytree(fp8_model["dir"], copy)
    raw = json.loads((copy / "config.json").read_text())
    quantization = raw["quantization_config"]
    quantization.pop("modules_to_not_convert", None)
    quantization["ignore"] = ["lm_head"]  # in_proj_a is stored unquantized, the config now says FP8
    (copy / "config.json").write_text(json.dumps(raw))
    with pytest.raises(WeightError, match=r"in_proj_a.weight.*stored as F32.*quantizes it"):
        build_shard(ModelSource(model_dir=str(copy)), 0, 1)


def test_serve_refuses_a_gptq_checkpoint_in_one_line(tmp_path, tiny_dir):
    gptq = tmp_path / "gptq"
    shutil.copytree(tiny_dir, gptq)
    raw = json.loads((gptq / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (gptq / "config.json").write_text(json.dumps(raw))
    run = subprocess.run([sys.executable, "-m", "shardd", "serve", "--model", str(gptq), "--bind", free_tcp_endpoint()],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "quant_method 'gptq'" in run.stderr and "Traceback" not in run.stderr


# ---- the memory budget ------------------------------------------------------------------------------

def test_memory_sizes_parse():
    assert parse_memory("24GiB", None) == 24 * GiB
    assert parse_memory("24GB", None) == 24 * 10**9
    assert parse_memory("512MiB", None) == 512 << 20
    assert parse_memory("0.9", 80 * GiB) == int(0.9 * 80 * GiB)
    for bad in ("lots", "-1GiB", "24 parsecs"):
        with pytest.raises(ValueError, match="--max-gpu-memory"):
            parse_memory(bad, 80 * GiB)


def test_the_27b_fits_two_24gib_daemons_in_fp8_and_not_in_bf16():
    """The seed's configuration as bench_seed.py starts it: 0:32 with the 5-layer DFlash drafter and 32:64, one
    sequence at 4,096 tokens with checkpoint storage for 16-token verify steps, the fast engine, bf16 activations."""
    from shardd.config import ShardConfig
    from shardd.weights.loading import daemon_memory_plan

    config = preset_config("qwen3.5-27b")
    plans = {}
    for layout in (quantization.FP8_BLOCK, None):
        source = ModelSource(synthetic="qwen3.5-27b", quantize=layout)
        for layers, draft in (((0, 32), "synthetic:5"), ((32, 64), None)):
            shard = ShardConfig(layers=layers, draft=draft, dtype="bfloat16", engine="fast", max_verify_tokens=16,
                                rollback_mode=CHECKPOINT, max_sequences=1, max_context=4096,
                                max_tokens_per_request=1024, max_gpu_memory=24 * GiB)
            plans[(layout, layers[0])] = daemon_memory_plan(source, config, shard)
    assert all(plans[(quantization.FP8_BLOCK, b)].fits() for b in (0, 32)), [plans[(quantization.FP8_BLOCK, b)].line() for b in (0, 32)]
    assert not any(plans[(None, b)].fits() for b in (0, 32))
    # FP8 weights are about half the bf16 ones (the embedding / head stay bf16)
    fp8, bf16 = plans[(quantization.FP8_BLOCK, 32)].items["weights"], plans[(None, 32)].items["weights"]
    assert 0.5 < fp8 / bf16 < 0.65
    assert plans[(quantization.FP8_BLOCK, 0)].items["checkpoint_buffers"] > GiB  # float32 states after every token
    assert plans[(quantization.FP8_BLOCK, 0)].items["drafter"] > plans[(quantization.FP8_BLOCK, 32)].items.get("drafter", 0)


def test_a_daemon_over_its_cap_refuses_to_start_naming_each_part(tmp_path):
    run = subprocess.run(serve_command(free_tcp_endpoint(), "--max-gpu-memory", "4MiB", "--quantize", "fp8-block"),
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 1
    (line,) = [line for line in run.stderr.splitlines() if "refusing to start" in line]
    for part in ("does not fit in --max-gpu-memory 4.0 MiB", "weights", "kv_cache", "gdn_states", "checkpoint_buffers"):
        assert part in line


def test_hello_reports_the_memory_plan_and_the_quantization(tmp_path):
    endpoint = free_tcp_endpoint()
    daemon = Daemon("fp8", endpoint, ["--max-gpu-memory", "1GiB", "--quantize", "fp8-channel",
                                      "--max-sequences", "2", "--max-context", "256"], tmp_path)
    try:
        hello = daemon.wait_ready()
        status = subprocess.run([sys.executable, "-m", "coordinator.cli", "status", "--shards", endpoint],
                                capture_output=True, text=True, timeout=60)
    finally:
        daemon.stop()
    assert status.returncode == 0, status.stderr
    assert f"{endpoint}: memory plan: weights " in status.stdout and "of a 1.00 GiB cap" in status.stdout
    memory = hello["memory"]
    assert memory["cap_bytes"] == GiB and memory["total_bytes"] == sum(memory["items"].values())
    config = preset_config("tiny")
    # 2 sequences x 2 attention layers x (K + V) x 256 positions x 2 kv heads x 16 dims x float32
    assert memory["items"]["kv_cache"] == 2 * 2 * 2 * 256 * 2 * 16 * 4
    assert memory["items"]["gdn_states"] == 2 * 4 * (config.recurrent_state_bytes() + config.conv_state_bytes())
    assert hello["quantization"]["layout"] == "fp8-channel"
    assert hello["model"]["fingerprint"].endswith(":fp8-channel")


def test_a_quantized_drafter_checkpoint_is_refused_by_name(tmp_path):
    from common.draft_config import load_draft_config
    from common.draft_config import synthetic_draft_config
    from shardd.draft.synthetic import write_draft_checkpoint

    draft = write_draft_checkpoint(tmp_path / "draft", synthetic_draft_config(preset_config("tiny"), num_layers=1), 0)
    raw = json.loads((draft / "config.json").read_text())
    raw["quantization_config"] = quantization.quantization_config(quantization.FP8_BLOCK, [])
    (draft / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="quantized drafter .*'fp8'"):
        load_draft_config(draft)


# ---- shardctl generate / bench / launch / serve --synthetic --quantize: FP8 daemons without make-model ----------

def shardctl(*args):
    from click.testing import CliRunner

    from coordinator.cli import cli

    return CliRunner().invoke(cli, [str(a) for a in args])


def test_shardctl_generate_launches_fp8_daemons_with_quantize():
    from shardd.engine.reference.rollback import RollbackStorage

    ids = list(range(1, 33))
    result = shardctl("generate", "--synthetic", "tiny", "--split", 2, "--quantize", quantization.FP8_BLOCK, "--prompt-ids",
                      ",".join(map(str, ids)), "--max-new-tokens", 12, "--drafter", "oracle", "--mean-commit", 3,
                      "--block-size", 4, "--json")
    assert result.exit_code == 0, result.output
    tokens = json.loads(result.stdout)["tokens"]
    local = {layout: greedy_decode(LocalTarget(ModelSource(synthetic="tiny", quantize=layout),
                                               storage=RollbackStorage(None, 0)), 1, ids, 12).tokens
             for layout in (quantization.FP8_BLOCK, None)}
    assert tokens == local[quantization.FP8_BLOCK] != local[None]  # the FP8 model's tokens, not the bf16 one's


def test_shardctl_launch_passes_quantize_to_every_daemon_including_the_drafter():
    import signal

    from coordinator.relay.client import ShardClient
    from coordinator.launch import child_env

    process = subprocess.Popen(
        [sys.executable, "-c", "from coordinator.cli import main; main()", "launch", "--synthetic", "tiny", "--split", "2",
         "--quantize", quantization.FP8_CHANNEL, "--draft", "synthetic", "--draft-placement", "own", "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env())
    try:
        launched = json.loads(process.stdout.readline())
        for endpoint in [*launched["endpoints"], launched["draft_endpoint"]]:
            with ShardClient(endpoint, timeout_s=30) as client:
                hello = client.hello()
            assert hello["quantization"]["layout"] == quantization.FP8_CHANNEL
            assert hello["model"]["fingerprint"].endswith(":fp8-channel")
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0
    finally:
        if process.poll() is None:
            process.kill()


@pytest.mark.parametrize("command", ["generate", "bench", "launch", "serve"])
def test_shardctl_quantize_refuses_unknown_layouts_and_checkpoints_by_name(command, tmp_path):
    source = ["--synthetic", "tiny", "--split", "2"]
    extra = ["--prompt-ids", "1,2"] if command == "generate" else []
    result = shardctl(command, *source, "--quantize", "gptq", *extra)
    assert result.exit_code == 2 and "'gptq' is not one of 'fp8-block', 'fp8-channel'" in result.output
    result = shardctl(command, "--model", tmp_path, "--split", "2", "--quantize", quantization.FP8_BLOCK, *extra)
    assert result.exit_code == 2 and "--quantize goes with --synthetic" in result.output
    if command != "launch":
        result = shardctl(command, "--shards", "tcp://127.0.0.1:9", "--quantize", quantization.FP8_BLOCK, *extra)
        assert result.exit_code == 2 and "--quantize goes with --synthetic" in result.output
