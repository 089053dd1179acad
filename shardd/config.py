"""`ShardConfig`: everything `shardd serve` was told, built and validated once from its flags (`from_flags`) and
handed whole to the parts (the loader, the engine's choice, the daemon, its loop and relay). One name and one
meaning per knob: each field is the flag of that name, resolved (`auto` decided, sizes in bytes, the layer range
parsed)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from common.dtypes import resolve_dtype
from common.busy_poll import AUTO_BUSY_POLL_CPUS, AUTO_BUSY_POLL_MS, usable_cpus
from common.endpoints import endpoint_problem, is_loopback
from common.model_config import context_problem
from protocol.layout import CHECKPOINT
from shardd.engine.select import PREFILL_ROWS
from shardd.server.rows import WAIT_S, check_relay_to, read_relay_key


class FlagError(ValueError):
    """A flag's value cannot be served; `flag` names it (None: a combination of flags)."""

    def __init__(self, message: str, flag: str | None = None):
        super().__init__(message)
        self.flag = flag


@dataclass
class ShardConfig:
    # what the daemon serves
    model_dir: str | None = None  # a checkpoint directory (a hub id is resolved to its snapshot)
    synthetic: str | None = None  # or a synthetic preset, PRESET[:SEED]
    quantize: str | None = None  # with synthetic: its linears as FP8 in this layout
    layers: tuple[int, int] | None = None  # [begin, end) of the target's layers; None: a drafter alone
    draft: str | None = None  # a DFlash drafter to host: a directory, or synthetic[:LAYERS]
    device: str = "cpu"
    dtype: str = "float32"  # resolved: --dtype auto decided for the device and the checkpoint
    # the engine and its step
    engine: str = "reference"  # resolved: reference or fast
    max_verify_tokens: int = 16  # rollback storage: most tokens one checkpointed step may carry (0: none)
    rollback_mode: str = CHECKPOINT
    step_rows: int | None = None  # R of the fast engine's batched step (None: the reference engine)
    prefill_rows: int = PREFILL_ROWS  # P of the fast engine's GPU prefill (0: one eager call a request)
    # limits
    max_sequences: int = 8
    max_context: int = 4096
    allow_long_context: bool = False  # --max-context past the model's max_position_embeddings, asked for by name
    max_tokens_per_request: int = 4096
    max_gpu_memory: int | None = None  # bytes this daemon may allocate (None: no cap)
    prefix_cache_bytes: int | None = None  # the prefix cache's budget (None: auto, decided by the memory plan)
    device_bytes: int | None = None  # a GPU's size: without --max-gpu-memory, auto's prefix cache fits what is left
    sequence_idle_timeout: float = 300.0  # seconds without a request before a sequence is closed; 0: never
    # the network
    bind: str = "tcp://127.0.0.1:7700"
    endpoint_file: str | None = None
    curve_secret_key: str | None = None  # file written by `shardd keygen`
    curve_allow_dir: str | None = None  # directory of allowed client public keys
    busy_poll_s: float = 0.0  # after a reply, poll for the next request without sleeping this long
    relay_to: str | None = None  # the next shard, which a FORWARD's `send_rows` sends its rows to
    relay_to_file: str | None = None  # or the file the next shard writes its endpoint to
    # the shard set's secret, read from --relay-key FILE: presented to the next shard, required of the previous one
    relay_key: str | None = field(default=None, repr=False)
    rows_wait_s: float = WAIT_S  # the longest a FORWARD with `rows_ticket` waits for its rows
    # the process
    threads: int | None = None  # torch's CPU threads (None: 1 on a GPU, torch's choice on the CPU)
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    tokenizer_dir: str | None = None  # the model directory when it ships a tokenizer.json (HELLO "tokenizer")

    @property
    def draft_only(self) -> bool:
        return self.layers is None

    @property
    def on_gpu(self) -> bool:
        return self.device.startswith("cuda")

    def storage(self):
        """The rollback storage the engine is built with."""
        from shardd.engine.reference.rollback import RollbackStorage

        return RollbackStorage(self.rollback_mode if self.max_verify_tokens else None, self.max_verify_tokens)

    def source(self):
        """The weights' source (shardd.weights.loading.ModelSource)."""
        from shardd.weights.loading import ModelSource

        return ModelSource(model_dir=self.model_dir, synthetic=self.synthetic, quantize=self.quantize)

    @classmethod
    def from_flags(cls, *, model_dir=None, synthetic=None, layers=None, draft=None, engine="auto", step_rows=None,
                   max_gpu_memory=None, busy_poll_ms="auto", prefix_cache_gib="auto", relay_key_file=None,
                   **flags) -> "ShardConfig":
        """The config of `shardd serve`'s flags (the others by their field names), checked against the device
        and the model's config.json; FlagError names what cannot be served. Reads the model's config, not its
        weights."""
        from common.hub import ModelNotFound, resolve_model

        if (model_dir is None) == (synthetic is None):
            raise FlagError("give exactly one of --model DIR or --synthetic PRESET[:SEED]")
        config = cls(model_dir=model_dir, synthetic=synthetic, draft=draft, **flags)
        problem = endpoint_problem(config.bind)
        if problem is not None:
            raise FlagError(problem, "--bind")
        config.prefix_cache_bytes = prefix_cache_bytes(prefix_cache_gib)
        if model_dir is not None:
            try:  # a Hugging Face id: its snapshot in the hub cache, downloaded when missing
                config.model_dir = resolve_model(model_dir)
            except ModelNotFound as error:
                raise FlagError(str(error), "--model") from None
            if (Path(config.model_dir) / "tokenizer.json").is_file():
                config.tokenizer_dir = str(Path(config.model_dir).resolve())  # HELLO names it: nobody guesses
        if layers == "none" and draft is None:
            raise FlagError("--layers none serves only a drafter: give --draft DIR|synthetic[:LAYERS]")
        if config.curve_secret_key is None and not is_loopback(config.bind):
            raise FlagError(f"refusing to bind {config.bind} without encryption: a non-loopback bind needs "
                            "--curve-secret-key (from `shardd keygen`) and --curve-allow DIR")
        if relay_key_file is not None:
            if config.curve_secret_key is not None:
                raise FlagError("--relay-key guards the rows daemons of one host pass each other unencrypted; it does "
                                "not go with --curve-secret-key (the coordinator carries the rows then)", "--relay-key")
            try:
                config.relay_key = read_relay_key(relay_key_file)
            except ValueError as error:
                raise FlagError(str(error), "--relay-key") from None
        import torch  # after the checks that need none of it: those fail within a second

        from protocol.layout import check_layer_range, parse_layer_range
        from shardd.engine.select import resolve_engine, step_rows_for
        from shardd.obs.health import device_memory
        from common.draft_config import parse_draft
        from common.memory import parse_memory

        try:
            check_device(torch, config.device)
            config.dtype = resolve_dtype(config.dtype, config.device, config.model_dir)
            source = config.source()
            model = source.config()
            problem = context_problem(config.max_context, model.max_position_embeddings, config.allow_long_context)
            if problem is not None:
                raise FlagError(problem, "--max-context")
            if layers != "none":
                config.layers = (0, model.num_layers)
                if layers:
                    config.layers = parse_layer_range(layers)
                    check_layer_range(*config.layers, model.num_layers)
            if draft is not None:
                parse_draft(draft)
            scheme = source.scheme()
            config.engine = resolve_engine(engine, config.device)
            config.step_rows = step_rows_for(config.engine, step_rows, config.max_verify_tokens,
                                             max_sequences=config.max_sequences,
                                             fp8=scheme is not None and config.keeps_fp8)
            if config.on_gpu:
                config.device_bytes = device_memory(torch.device(config.device))["total_bytes"]
            if max_gpu_memory is not None:
                # a fraction is of the GPU; of the host's memory for a CPU shard (the accounting is the same)
                config.max_gpu_memory = parse_memory(max_gpu_memory,
                                                     device_memory(torch.device(config.device))["total_bytes"])
            config.busy_poll_s = busy_poll_seconds(busy_poll_ms, config.device)
            if config.relay_to is not None:
                check_relay_to(config.relay_to, curve=config.curve_secret_key is not None)
            if config.relay_to_file is not None and (config.relay_to is not None or config.curve_secret_key):
                raise ValueError("--relay-to-file names the next shard as --relay-to does: give one of them, and "
                                 "neither with --curve-secret-key")
        except FlagError:
            raise
        except ValueError as error:
            raise FlagError(str(error)) from None
        return config

    @property
    def keeps_fp8(self) -> bool:
        """FP8 weights stay FP8 on a GPU (and in the fast step); the CPU reference dequantizes them at load."""
        return self.engine == "fast" or self.on_gpu


def prefix_cache_bytes(value: str | float) -> int | None:
    """--prefix-cache-gib as bytes: a number of GiB >= 0 (0: off), or `auto` (None: the memory plan decides)."""
    if str(value).strip().lower() == "auto":
        return None
    try:
        gib = float(value)
    except ValueError:
        raise FlagError(f"--prefix-cache-gib must be a number of GiB or auto, got {value!r}", "--prefix-cache-gib") from None
    if not 0 <= gib <= 1 << 20:  # also refuses nan
        raise FlagError(f"--prefix-cache-gib must be within [0, 1048576], got {value!r}", "--prefix-cache-gib")
    return int(gib * (1 << 30))


def busy_poll_seconds(value: str | float, device: str) -> float:
    """--busy-poll-ms as seconds: a number of milliseconds in [0, 1000], or `auto` (AUTO_BUSY_POLL_MS on a CUDA
    device with at least AUTO_BUSY_POLL_CPUS usable CPUs, else 0)."""
    if str(value).strip().lower() == "auto":
        dedicated = str(device).startswith("cuda") and usable_cpus() >= AUTO_BUSY_POLL_CPUS
        return AUTO_BUSY_POLL_MS / 1000 if dedicated else 0.0
    try:
        ms = float(value)
    except ValueError:
        raise ValueError(f"--busy-poll-ms must be a number of milliseconds or auto, got {value!r}") from None
    if not 0 <= ms <= 1000:  # also refuses nan
        raise ValueError(f"--busy-poll-ms must be within [0, 1000], got {value!r}")
    return ms / 1000


def check_device(torch, device: str) -> None:
    """ValueError with the reason when `device` cannot be used here (before any weight is loaded)."""
    try:
        parsed = torch.device(device)
    except RuntimeError:
        raise ValueError(f"--device must be cpu or cuda:N, got {device!r}") from None
    if parsed.type == "cpu":
        return
    if parsed.type != "cuda":
        raise ValueError(f"--device must be cpu or cuda:N, got {device!r}")
    if not torch.cuda.is_available():
        raise ValueError(f"--device {device}: no CUDA device was found (torch {torch.__version__}"
                         + ("" if torch.version.cuda else ", a CPU-only build") + ")")
    count = torch.cuda.device_count()
    if parsed.index is not None and parsed.index >= count:
        raise ValueError(f"--device {device}: this machine has {count} CUDA device(s), cuda:0..cuda:{count - 1}")
