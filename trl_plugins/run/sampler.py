"""What generates a run's turns, chosen once: HF ``generate`` on the training model, transformers' continuous
batching, or vLLM (colocate or server), with the config's sampling settings; and the one factory of its backend."""

from __future__ import annotations

import enum
from typing import Any

from trl_plugins.rollout.backends import GenerationBackend, HFGenerationBackend, VLLMBackend
from trl_plugins.rollout.chat import ChatFormat
from trl_plugins.types import LogprobSource, SamplingSettings

__all__ = [
    "SamplerKind",
    "sampler_kind",
    "sampling_settings",
    "check_sampler_available",
    "make_backend",
    "continuous_batching_options",
    "check_continuous_batching_memory",
]


class SamplerKind(enum.StrEnum):
    """What generates the rollouts."""

    HF_GENERATE = "hf_generate"
    """HF ``generate`` on the training model (the default)."""
    CONTINUOUS_BATCHING = "continuous_batching"
    """transformers' continuous batching on the training model (``use_transformers_continuous_batching``)."""
    VLLM_COLOCATE = "vllm_colocate"
    """A vLLM engine in each training process (``use_vllm``, ``vllm_mode='colocate'``)."""
    VLLM_SERVER = "vllm_server"
    """A vLLM server on other devices (``use_vllm``, ``vllm_mode='server'``)."""

    @property
    def logprob_source(self) -> LogprobSource:
        """What its behaviour log-probs are: the trainer's own, or vLLM's processed ones."""
        return LogprobSource.PROCESSED if self.is_vllm else LogprobSource.TEMPERATURE_SCALED

    @property
    def is_vllm(self) -> bool:
        return self in (SamplerKind.VLLM_COLOCATE, SamplerKind.VLLM_SERVER)

    def describe(self, config: Any) -> str:
        """One line for the banner."""
        if self.is_vllm:
            return f"vLLM ({config.vllm_mode} mode)"
        if self is SamplerKind.CONTINUOUS_BATCHING:
            keep = "kept" if config.continuous_batching_keep_cache else "freed"
            return f"transformers continuous batching (KV cache {keep} between rollouts)"
        return "HF generate"


def sampler_kind(config: Any) -> SamplerKind:
    """The sampler ``config`` asks for (``use_vllm`` and continuous batching exclude each other: the config refuses
    both)."""
    if config.use_vllm:
        return SamplerKind.VLLM_SERVER if config.vllm_mode == "server" else SamplerKind.VLLM_COLOCATE
    if config.use_transformers_continuous_batching:
        return SamplerKind.CONTINUOUS_BATCHING
    return SamplerKind.HF_GENERATE


def sampling_settings(config: Any, *, temperature: float | None = None) -> SamplingSettings:
    """The config's sampling settings (``temperature`` overrides the config's)."""
    return SamplingSettings(
        temperature=config.temperature if temperature is None else temperature,
        top_p=config.top_p,
        top_k=config.top_k or 0,
        min_p=config.min_p or 0.0,
        repetition_penalty=config.repetition_penalty,
    )


def check_sampler_available(kind: SamplerKind, config: Any = None) -> None:
    """Refuse vLLM before any model loads when it cannot be imported (and no stand-in for TRL's ``VLLMGeneration``
    was installed, as the tests' fake does), or when ``config`` asks the real engine for what it cannot do on this
    machine: sleep mode off a CUDA device (vLLM refuses it itself, after the model loaded). Then fill the engine's
    offline, loopback environment (:data:`~trl_plugins.rollout.vllm_server.ENGINE_ENVIRONMENT`) before vLLM is
    imported. In server mode, TRL's ``VLLMGeneration`` then builds
    :class:`~trl_plugins.rollout.vllm_weights.FileVLLMClient`: TRL's client, whose weight push goes through a file
    when the server was started with ``--weight-transfer-config '{"backend": "file"}'`` (a CPU host)."""
    if not kind.is_vllm:
        return
    import trl.trainer.grpo_trainer as trl_grpo
    from trl.generation.vllm_generation import VLLMGeneration
    from trl.import_utils import is_vllm_available

    real = trl_grpo.VLLMGeneration is VLLMGeneration
    if real and not is_vllm_available():
        raise ValueError(
            "use_vllm=True, but vLLM is not installed here. Install a version TRL 1.16 supports "
            "(pip install 'vllm>=0.22,<=0.31') on the machine that generates (every training process in colocate "
            "mode; in server mode the trainer needs it too, for TRL's client), or drop --use_vllm to generate with "
            "HF generate."
        )
    if real and config is not None and kind is SamplerKind.VLLM_COLOCATE:
        import torch

        if config.use_cpu or not torch.cuda.is_available():
            if config.vllm_enable_sleep_mode:
                raise ValueError(
                    "vllm_enable_sleep_mode=True, but vLLM's sleep mode runs on CUDA devices only (its CPU platform "
                    "refuses it: 'Sleep mode is not supported on current platform'); drop it on a CPU run."
                )
            raise ValueError(
                "vllm_mode='colocate' on a CPU: vLLM's CPU engine starts in the trainer's process, but TRL's weight "
                "push (model_runner.model.load_weights) fails on it, its linear layers being packed at load "
                "(\"'Parameter' object has no attribute 'weight_loader'\"); use vllm_mode='server' against a server "
                'started with --weight-transfer-config \'{"backend": "file"}\' (docs/real_models.md), or HF generate.'
            )
    from trl_plugins.rollout.vllm_server import apply_engine_environment

    apply_engine_environment()
    if real and kind is SamplerKind.VLLM_SERVER:
        from trl_plugins.rollout.vllm_weights import install

        install()


def make_backend(
    kind: SamplerKind,
    config: Any,
    chat: ChatFormat,
    *,
    model: Any = None,
    pad_token_id: int | None = None,
    accelerator: Any = None,
    vllm_generation: Any = None,
    temperature: float | None = None,
    token_budget: int | None = None,
    trajectories: int | None = None,
) -> GenerationBackend:
    """The backend of sampler ``kind`` with the config's sampling settings (``temperature`` overrides the config's).

    Args:
        model: The policy HF generate or continuous batching samples from (possibly wrapped by Accelerate).
        pad_token_id: HF generate's left padding.
        vllm_generation: TRL's ``VLLMGeneration`` (the trainer's), for vLLM.
        token_budget: The rollout's ``token_budget`` (the most tokens of one trajectory; None: the model's context).
        trajectories: Trajectories of one rollout on this process (default: ``per_device_train_batch_size``).
            With ``token_budget`` they size the continuous-batching cache (:func:`continuous_batching_options`).
    """
    sampling = sampling_settings(config, temperature=temperature)
    if kind.is_vllm:
        client = None
        if kind is SamplerKind.VLLM_SERVER and getattr(vllm_generation, "vllm_client", None) is None:
            # TRL builds its client on the main process only; every rank sends its own turns.
            from trl.generation import vllm_client as trl_client

            base = config.vllm_server_base_url or f"http://{config.vllm_server_host}:{config.vllm_server_port}"
            client = trl_client.VLLMClient(
                base_url=base, group_port=config.vllm_group_port, connection_timeout=config.vllm_server_timeout
            )
        if kind is SamplerKind.VLLM_SERVER:
            check_server(client or vllm_generation.vllm_client, model=model, token_budget=token_budget)
        return VLLMBackend(
            vllm_generation,
            stop_token_ids=chat.stop_token_ids,
            sampling=sampling,
            client=client,
            max_concurrency=config.vllm_max_concurrent_requests,
        )
    if kind is SamplerKind.CONTINUOUS_BATCHING:
        from trl_plugins.rollout.continuous_batching import ContinuousBatchingBackend

        if token_budget is None:
            token_budget = getattr(model, "module", model).config.max_position_embeddings
        return ContinuousBatchingBackend(
            model,
            stop_token_ids=chat.stop_token_ids,
            sampling=sampling,
            config=continuous_batching_options(config, token_budget, trajectories),
            accelerator=accelerator,
            keep_cache=config.continuous_batching_keep_cache,
        )
    return HFGenerationBackend(
        model, pad_token_id=pad_token_id, stop_token_ids=chat.stop_token_ids, sampling=sampling, accelerator=accelerator
    )


def check_server(client: Any, *, model: Any = None, token_budget: int | None = None) -> None:
    """Refuse a vLLM server whose flags the trainer cannot train with (the logprobs mode, the log-prob cap, the
    context length, the served model): :func:`~trl_plugins.rollout.vllm_server.check_server_config` on what the
    server reports (``/server_info``); a client without ``get_server_info`` (another transport) is not checked."""
    if not hasattr(client, "get_server_info"):
        return
    from trl_plugins.rollout.vllm_server import check_server_config

    module = getattr(model, "module", model)
    model_config = getattr(module, "config", None)
    name = getattr(model_config, "_name_or_path", "") or ""
    check_server_config(
        client.get_server_info(), url=client.base_url, model=name, model_config=model_config, token_budget=token_budget
    )


def continuous_batching_options(config: Any, token_budget: int, trajectories: int | None = None) -> Any:
    """The run's ``ContinuousBatchingConfig``: ``transformers_continuous_batching_config``, with ``num_blocks`` and
    ``max_batch_tokens`` that it leaves unset sized for ``trajectories`` (default: ``per_device_train_batch_size``,
    one rollout on this process) of up to ``token_budget`` tokens each
    (:func:`~trl_plugins.rollout.continuous_batching.workload_cache_size`)."""
    from trl_plugins.rollout.continuous_batching import continuous_batching_config

    return continuous_batching_config(
        config.transformers_continuous_batching_config,
        trajectories=trajectories or config.per_device_train_batch_size,
        tokens_per_trajectory=token_budget,
    )


def check_continuous_batching_memory(
    run: Any, model_path: str, *, dtype: Any = None, trainable_fraction: float = 1.0
) -> str:
    """Before the weights load: will the run's continuous-batching cache (:func:`continuous_batching_options`) fit in
    the memory transformers will allow when it builds it at a rollout's start? Returns one line of figures for the
    banner.

    The model is built on the meta device from its config (nothing loads). The memory in use then is estimated as
    what is in use now plus the training state: the weights, and for the trainable ``trainable_fraction`` of them a
    gradient and AdamW's two moments (an upper bound under ZeRO, which shards them).

    Raises:
        ValueError: the cache does not fit, with the figures and settings that fit.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.generation.continuous_batching.utils import get_device_and_memory_breakdown
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    from trl_plugins.rollout.continuous_batching import check_cache_fits

    model_config = AutoConfig.from_pretrained(model_path)
    if dtype is None or dtype == "auto":  # from_pretrained's "auto": the checkpoint's own
        dtype = getattr(model_config, "dtype", None) or torch.float32
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(model_config), None)
    with torch.device("meta"):
        # The class itself, not from_config: under ZeRO-3 that builds inside deepspeed.zero.Init, which cannot
        # initialise meta tensors.
        model = (
            model_class(model_config) if model_class is not None else AutoModelForCausalLM.from_config(model_config)
        ).to(dtype)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    state = int(weights * (1 + 3 * trainable_fraction))
    _, _, reserved, allocated = get_device_and_memory_breakdown()
    cb_config = continuous_batching_options(
        run.config, run.rollout.token_budget or model.config.max_position_embeddings
    )
    footprint = check_cache_fits(
        model,
        cb_config,
        in_use=max(reserved, allocated) + state,
        error=ValueError,
        when=f", with the model and its training state (~{state / 1e9:.2f} GB, estimated) loaded",
    )
    return (
        f"continuous-batching cache {footprint.total / 1e9:.2f} GB of the {footprint.available / 1e9:.2f} GB "
        f"transformers will allow (max_batch_tokens={footprint.max_batch_tokens}, num_blocks={footprint.num_blocks})"
    )
