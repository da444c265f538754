"""Build vLLM 0.34's real scheduler on the CPU, offline, for the tests in tests/vllm.

No weights and no hub: the model is a directory holding only a config.json
for a tiny Llama, which vLLM's ModelConfig reads as it would a downloaded
checkpoint's (it inspects the architecture's class in a child process, about
five seconds). The KV cache spec is the smallest full-attention one: the
scheduler only counts blocks, no tensor is allocated.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

BLOCK_SIZE = 16
MAX_MODEL_LEN = 256
EOS_TOKEN_ID = 2

# a Llama small enough to describe, never to run: vLLM reads only the config
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 512,
    "max_position_embeddings": 2048,
    "bos_token_id": 1,
    "eos_token_id": EOS_TOKEN_ID,
    "torch_dtype": "float32",
}


def write_tiny_model(directory: Path) -> Path:
    """A model directory vLLM accepts in place of a hub name: config.json alone."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(TINY_LLAMA))
    return directory


def make_vllm_config(
    model_dir: Path,
    connector: str,
    module_path: str | None,
    extra: dict[str, Any] | None = None,
    kv_role: str = "kv_both",
    tensor_parallel_size: int = 1,
) -> VllmConfig:
    """A CPU VllmConfig naming `connector`, loaded from `module_path` when given,
    for an engine of `tensor_parallel_size` workers.

    The hybrid KV cache manager is off: a connector that does not implement
    vLLM's SupportsHMA is refused while it is on.
    """
    model = ModelConfig(
        model=str(model_dir),
        skip_tokenizer_init=True,
        dtype="float32",
        seed=0,
        max_model_len=MAX_MODEL_LEN,
    )
    scheduler = SchedulerConfig(
        max_num_seqs=8,
        max_num_batched_tokens=128,
        max_model_len=MAX_MODEL_LEN,
        is_encoder_decoder=False,
        disable_hybrid_kv_cache_manager=True,
    )
    transfer = KVTransferConfig(
        kv_connector=connector,
        kv_connector_module_path=module_path,
        kv_role=kv_role,
        kv_connector_extra_config=extra or {},
    )
    return VllmConfig(
        model_config=model,
        scheduler_config=scheduler,
        cache_config=CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True),
        kv_transfer_config=transfer,
        device_config=DeviceConfig("cpu"),
        parallel_config=ParallelConfig(tensor_parallel_size=tensor_parallel_size),
    )


def make_kv_cache_config(vllm_config: VllmConfig, num_blocks: int = 64) -> KVCacheConfig:
    """`num_blocks` blocks of one full-attention group (what the scheduler and
    a worker's connector are built with)."""
    spec = FullAttentionSpec(
        block_size=vllm_config.cache_config.block_size,
        num_kv_heads=1,
        head_size=1,
        dtype=torch.float32,
    )
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)],
    )


def make_scheduler(vllm_config: VllmConfig, num_blocks: int = 64) -> Scheduler:
    """vLLM's Scheduler over `num_blocks` blocks of one full-attention group."""
    block_size = vllm_config.cache_config.block_size
    kv_cache = make_kv_cache_config(vllm_config, num_blocks)
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    return Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache,
        log_stats=False,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=block_size,
    )


def make_request(
    request_id: str,
    num_tokens: int,
    max_tokens: int = 4,
    kv_transfer_params: dict[str, Any] | None = None,
) -> Request:
    """A request of `num_tokens` prompt tokens, hashed per block as vLLM's engine does."""
    init_none_hash(sha256)
    params = SamplingParams(max_tokens=max_tokens)
    params.update_from_generation_config({}, EOS_TOKEN_ID)
    request = Request(
        request_id=request_id,
        prompt_token_ids=[10 + i for i in range(num_tokens)],
        sampling_params=params,
        pooling_params=None,
        block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256),
    )
    request.kv_transfer_params = kv_transfer_params
    return request


def transfer_output(
    finished_recving: set[str] | None = None, finished_sending: set[str] | None = None
) -> ModelRunnerOutput:
    """A step's output carrying only what the workers' connectors reported."""
    return ModelRunnerOutput.with_kv_conn_output_only(
        KVConnectorOutput(finished_recving=finished_recving, finished_sending=finished_sending)
    )


def model_output(scheduler_output: Any, kv: KVConnectorOutput | None = None) -> ModelRunnerOutput:
    """The model runner's output for every request a step scheduled (one sampled
    token each), with what the workers' connectors reported."""
    ids = list(scheduler_output.num_scheduled_tokens)
    return ModelRunnerOutput(
        req_ids=ids, sampled_token_ids=[[7] for _ in ids], kv_connector_output=kv
    )
