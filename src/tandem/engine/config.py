"""Engine settings, resolved once (device, dtype, backend) and then frozen.

Values measured at start-up (the number of KV blocks) live in `KVCacheSpec`, not here. An API
process holds these settings without importing torch (2 to 3 s of its start on a small CPU
host); the engine process resolves them.
"""

from __future__ import annotations

import glob
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from tandem import DEFAULT_MODEL

if TYPE_CHECKING:
    import torch

# A CPU core left to sleep between requests can take up to twice the host time over the next
# eager prefill step, which on a GPU is mostly host time (kernel launches).
BUSY_POLL_CUDA_S = 2.0

DTYPES = ("float32", "bfloat16", "float16")


# The device nodes of a host with NVIDIA GPUs (/dev/dxg: WSL2's, shared by every GPU)
GPU_DEVICE_NODES = ("/dev/nvidia[0-9]*", "/dev/dxg")


def cuda_available() -> bool:
    """torch.cuda.is_available(), without importing torch on a host that has none of
    GPU_DEVICE_NODES (where it would say False)."""
    if not any(glob.glob(pattern) for pattern in GPU_DEVICE_NODES):
        return False
    import torch

    return torch.cuda.is_available()


@dataclass(frozen=True)
class EngineConfig:
    model: str = DEFAULT_MODEL
    # the tokenizer to use instead of the model's: a Hugging Face directory, or a model spec
    # (a .gguf file, the default model) whose tokenizer is taken; for dummy weights in real shapes
    tokenizer: str | None = None
    # what vLLM's flag allows: a tokenizer's own code (tandem runs only its own models)
    trust_remote_code: bool = False
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto (float32 on CPU, bfloat16 on CUDA) | float32 | bfloat16 | float16
    load_format: str = "auto"  # auto | dummy
    attention_backend: str = "auto"  # auto (triton on CUDA, torch on CPU) | torch | triton
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory: int | None = None  # bytes for the KV cache
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    max_waiting: int = 1024
    scheduling_policy: str = "fcfs"  # fcfs | priority (requests' `priority`, lower first)
    enable_prefix_caching: bool = True
    enforce_eager: bool = False  # no CUDA graphs
    # Batches of up to this many tokens (capped at max_num_batched_tokens) that the decode
    # graphs do not take run in piecewise CUDA graphs (0: never).
    piecewise_cuda_graph_max_tokens: int = 2048
    # How long the engine loop (and a worker's HTTP server loop) keeps polling without sleeping
    # after it last had work (seconds); None: BUSY_POLL_CUDA_S on CUDA, 0 on CPU (where the step
    # needs every core).
    busy_poll_s: float | None = None
    # seeds the sampling of requests without a seed of their own (one generator, drawn in the
    # order requests are sampled, as vLLM's), and dummy weights
    seed: int = 0
    # ranks the model is split over, one process each (rank r on GPU device + r on CUDA)
    tensor_parallel_size: int = 1
    # a mixture-of-experts model's experts placed whole on the ranks instead of each split
    enable_expert_parallel: bool = False
    # on CUDA, every all-reduce through NCCL (not small ones over peer memory)
    disable_custom_all_reduce: bool = False
    # schedule the next step while the device runs this one (vLLM's --async-scheduling); None:
    # on CUDA, off on the CPU (where the forward pass runs on the host it would overlap with)
    async_scheduling: bool | None = None

    def resolved(self) -> EngineConfig:
        """Replace every "auto" by what it means on this machine, and check the values."""
        device = self.device
        if device == "auto":
            device = "cuda" if cuda_available() else "cpu"
        elif device.startswith("cuda") and not cuda_available():
            raise ValueError("device 'cuda' was asked for but no CUDA GPU is available")
        if device == "cuda":
            import torch

            device = f"cuda:{torch.cuda.current_device()}"
        dtype = self.dtype
        if dtype == "auto":
            dtype = "float32" if device == "cpu" else "bfloat16"
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be auto or one of {', '.join(DTYPES)}, not {dtype!r}")
        backend = self.attention_backend
        if backend == "auto":
            backend = "torch" if device == "cpu" else "triton"
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError("block_size must be a power of two")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
        if self.piecewise_cuda_graph_max_tokens < 0:
            raise ValueError("piecewise_cuda_graph_max_tokens must be 0 (off) or more")
        if self.tensor_parallel_size < 1:
            raise ValueError("tensor_parallel_size must be 1 or more")
        if device.startswith("cuda") and self.tensor_parallel_size > 1:
            import torch

            first = torch.device(device).index
            if first + self.tensor_parallel_size > torch.cuda.device_count():
                raise ValueError(
                    f"tensor_parallel_size {self.tensor_parallel_size} needs as many GPUs from "
                    f"{device} on, and this host has {torch.cuda.device_count()}: use fewer "
                    "ranks or an earlier device"
                )
        busy_poll_s = self.busy_poll_seconds(device)
        if busy_poll_s < 0:
            raise ValueError("busy_poll_s must be 0 or more")
        async_scheduling = self.async_scheduling
        if async_scheduling is None:
            async_scheduling = device.startswith("cuda")
        return replace(
            self,
            device=device,
            dtype=dtype,
            attention_backend=backend,
            busy_poll_s=busy_poll_s,
            async_scheduling=async_scheduling,
        )

    def busy_poll_seconds(self, device: str | None = None) -> float:
        """busy_poll_s with None replaced by the default of `device` (default: this config's),
        without creating a CUDA context (nor importing torch on a host without NVIDIA GPUs)."""
        if self.busy_poll_s is not None:
            return self.busy_poll_s
        device = device or self.device
        on_cpu = device == "cpu" or (device == "auto" and not cuda_available())
        return 0.0 if on_cpu else BUSY_POLL_CUDA_S

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.dtype)
