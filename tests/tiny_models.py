"""Tiny randomly initialised Hugging Face models (made by transformers itself; nothing is
downloaded), saved as model folders with the default model's tokenizer."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)

ARCHITECTURES: dict[str, dict[str, Any]] = {
    "llama": {},
    "llama3-rope-scaling": {
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
    },
    "llama-linear-rope": {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
    "mistral": {"sliding_window": None},
    "mistral-sliding-window": {"sliding_window": 16},  # (Mistral-7B-v0.1's kind: every layer)
    "qwen2": {},
    "qwen2-yarn-rope": {  # as Qwen2.5 serves 128k tokens (its original 32k here 64)
        "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    },
    "qwen2-sliding-window": {  # its layers from max_window_layers on slide
        "use_sliding_window": True,
        "sliding_window": 16,
        "max_window_layers": 1,
    },
    "qwen3": {"head_dim": 32},
    "phi3": {},  # q/k/v and gate/up fused in the checkpoint
    "phi3-partial-rotary": {"partial_rotary_factor": 0.5},  # (Phi-4-mini's kind: 3/4 there)
    "granite": {  # multipliers of the embeddings, residual adds, attention scale and logits
        "embedding_multiplier": 3.0,
        "residual_multiplier": 0.5,
        "attention_multiplier": 0.1,
        "logits_scaling": 4.0,
    },
    # mixtures of experts: 8 experts, 2 a token
    "mixtral": {"num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 32},
    "qwen2_moe": {  # a shared expert; layer 0 dense (mlp_only_layers)
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48,
        "mlp_only_layers": [0],
    },
    "granitemoe": {  # experts stacked in the checkpoint; Granite's multipliers
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "intermediate_size": 32,
        "embedding_multiplier": 3.0,
        "residual_multiplier": 0.5,
        "attention_multiplier": 0.1,
        "logits_scaling": 4.0,
    },
    "qwen3_moe": {
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "norm_topk_prob": True,
        "head_dim": 32,
    },
    # Gemma: GeGLU, (1 + weight) norms, scaled embeddings; Gemma 2 and 3: sandwich norms and
    # a local layer (window 16, shorter than the tests' prompts) before a global one
    "gemma": {},
    "gemma2": {  # head size 256 (Gemma 2's default); softcaps low enough to bend these scores
        "sliding_window": 16,
        "query_pre_attn_scalar": 24,
        "attn_logit_softcapping": 2.0,
        "final_logit_softcapping": 5.0,
    },
    "gemma3": {  # the global layer's rope scaled, the local one's with its own theta
        "head_dim": 64,
        "sliding_window": 16,
        "query_pre_attn_scalar": 24,
        "layer_types": ["sliding_attention", "full_attention"],
        "rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0},
        },
    },
}


def build_model(name: str, tokenizer_dir: Path, out: Path, **overrides: Any) -> Any:
    """A tiny ``name`` (one of ``ARCHITECTURES``), its config changed by ``overrides``."""
    import transformers

    family = name.split("-")[0]
    family = {"llama3": "llama"}.get(family, family)
    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM),
        "granite": (transformers.GraniteConfig, transformers.GraniteForCausalLM),
        "granitemoe": (transformers.GraniteMoeConfig, transformers.GraniteMoeForCausalLM),
        "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
        "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
        "gemma": (transformers.GemmaConfig, transformers.GemmaForCausalLM),
        "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM),
        "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
    }[family]
    torch.manual_seed(0)
    config = config_cls(vocab_size=49152, **{**TINY, **ARCHITECTURES[name], **overrides})
    return _saved(model_cls(config).eval(), tokenizer_dir, out)


def build_gemma3_vision_language(tokenizer_dir: Path, out: Path) -> Any:
    """A tiny ``Gemma3ForConditionalGeneration`` (Gemma 3 4B's kind): the language model of
    ``ARCHITECTURES["gemma3"]`` and a one-layer vision tower."""
    import transformers

    torch.manual_seed(0)
    text = transformers.Gemma3TextConfig(vocab_size=49152, **{**TINY, **ARCHITECTURES["gemma3"]})
    vision = transformers.SiglipVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        image_size=28, patch_size=14,
    )  # fmt: skip
    config = transformers.Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4
    )
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    return _saved(model, tokenizer_dir, out)


def _saved(model: Any, tokenizer_dir: Path, out: Path) -> Any:
    """``model`` with larger weights than the default init (so the argmax is not flat),
    saved to ``out`` with the tokenizer of ``tokenizer_dir``."""
    with torch.no_grad():
        for param_name, p in model.named_parameters():
            if "norm" not in param_name:  # weights and biases (Qwen2's qkv bias) alike
                p.normal_(0, 0.2)
            elif "gemma" in type(model).__name__.lower():
                p.normal_(0, 0.3)  # (Gemma's norms scale by 1 + weight: zeros at init)
    model.save_pretrained(out)
    for f in tokenizer_dir.iterdir():
        if f.name.startswith("tokenizer") or f.name.endswith(".jinja"):
            shutil.copy(f, out / f.name)
    return model


def build_classifier(
    family: str, labels: list[str], tokenizer_dir: Path, out: Path, pad_token_id: int = 0
) -> Any:
    """A tiny ``<family>ForSequenceClassification`` ("qwen2" or "llama") with these labels,
    saved as a model folder (transformers scores a batch's last non-pad token: its pad id is
    one the tests' prompts never use)."""
    import transformers

    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForSequenceClassification),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForSequenceClassification),
    }[family]
    torch.manual_seed(1)
    config = config_cls(
        vocab_size=49152,
        num_labels=len(labels),
        id2label=dict(enumerate(labels)),
        label2id={label: i for i, label in enumerate(labels)},
        pad_token_id=pad_token_id,
        **TINY,
    )
    return _saved(model_cls(config).eval(), tokenizer_dir, out)


def greedy_tokens(
    model_dir: Path, prompts: list[list[int]], max_tokens: int, **engine_args: Any
) -> list[list[int]]:
    """Greedy output token ids of each prompt (``ignore_eos``) from an offline engine on
    ``model_dir``, in float32; the engine is shut down afterwards (its helper processes too)."""
    from baton import LLM, SamplingParams

    llm = LLM(str(model_dir), dtype="float32", max_model_len=512, **engine_args)
    try:
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
        )
        return [list(o.outputs[0].token_ids) for o in outs]
    finally:
        llm.shutdown()


def helper_dies_mid_step(model_dir: Path, **engine_args: Any) -> tuple[str, float, float]:
    """Run two prompts on a two-rank engine (float32) and, while rank 0 steps, stop rank 1
    (so that rank 0 waits for it in a collective) and kill it 0.5 s later. Returns the error
    the steps raised, the seconds from the kill to that error and the seconds the engine's
    shutdown took; raises AssertionError if the steps finished or kept going for 60 s."""
    import os
    import signal
    import threading
    import time

    from baton import LLM, SamplingParams

    llm = LLM(str(model_dir), dtype="float32", max_model_len=512, tensor_parallel_size=2,
              **engine_args)  # fmt: skip
    core = llm.engine.core
    pid = core._tp._procs[0].pid
    killed_at: list[float] = []

    def stop_then_kill() -> None:
        os.kill(pid, signal.SIGSTOP)
        time.sleep(0.5)
        killed_at.append(time.monotonic())
        os.kill(pid, signal.SIGKILL)

    try:
        params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
        for i, prompt in enumerate([[10 + j for j in range(n)] for n in (5, 23)]):
            core.add_request(f"r{i}", prompt, params)
        for _ in range(5):
            core.step()
        threading.Timer(0.2, stop_then_kill).start()
        deadline = time.monotonic() + 60
        try:
            while time.monotonic() < deadline:
                assert core.has_unfinished_requests(), "the steps finished before the kill"
                core.step()
        except RuntimeError as e:
            error, failed_at = str(e), time.monotonic()
        else:
            raise AssertionError("the steps went on for 60 s after the kill")
    finally:
        start = time.monotonic()
        llm.shutdown()
        shutdown_s = time.monotonic() - start
    return error, failed_at - killed_at[0], shutdown_s


def hf_greedy(model: torch.nn.Module, prompts: list[list[int]], n: int) -> list[list[int]]:
    """transformers' greedy tokens (``n`` of them, past any eos) of each prompt."""
    want = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            out = model.generate(  # type: ignore[operator]
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                eos_token_id=None, pad_token_id=0,
            )  # fmt: skip
            want.append(out[0, len(p) :].tolist())
    return want


def forced_logprobs(llm: Any, forced: list[list[int]], lora: Any = None) -> list[list[float]]:
    """The logprob ``llm`` gives each token of each sequence of ``forced`` after its first
    (teacher-forced: the sequences scored as prompts, through prompt logprobs), with the LoRA
    adapter ``lora`` if given."""
    from baton import SamplingParams

    scored = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    prompts = [{"prompt_token_ids": f} for f in forced]
    outs = llm.generate(prompts, scored, lora_request=lora, use_tqdm=False)
    logprobs = []
    for out, ids in zip(outs, forced, strict=True):
        plp = out.prompt_logprobs
        assert plp is not None
        logprobs.append([plp[i][ids[i]].logprob for i in range(1, len(ids))])
    return logprobs
