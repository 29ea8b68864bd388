"""The output projection in chunks (trl_plugins.modeling.chunked_head): log-probs, entropies and gradients equal today's
full-logits path (``log_softmax(lm_head(h) / T)`` over every position, 1e-5 relative) in the three layouts, on several
architectures, with a temperature, tied embeddings, LoRA (on lm_head or not) and activation checkpointing, with chunks
of 5 positions (so chunk boundaries fall inside shared-prefix branches); positions that need no log-prob get 0; and
a head that counts the rows it is asked for never sees more than one chunk (the negative control: the full forward
asks it for every position at once).
"""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import rel_err
from support.prefix import group_datums, small_model
from trl_plugins.datum import collate
from trl_plugins.modeling import micro_batch_logprobs
from trl_plugins.modeling.chunked_head import auto_chunk_size, chunkable, logprob_chunk_size
from trl_plugins.run.settings import LongTrajectories

CHUNK = 5


def _tied():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    return Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=200,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=True,
        )
    )


def _reference(model, mb, temperature):
    """Today's path: every position's full logits, scaled, log-softmaxed; ``(B, T)`` log-probs and entropies."""
    logits = (
        model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False).logits.float() / temperature
    )
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, mb.target_ids.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def _layout(datums, layout):
    idx = list(range(len(datums)))
    return collate(
        datums, idx, pad_token_id=0, padding_free=layout == "padding_free", shared_prefix=layout == "shared_prefix"
    )


def _compare(model, layout, *, temperature=0.7, chunk=CHUNK, chunked=True):
    datums = group_datums(groups=2, size=2)
    padded, mb = _layout(datums, "padded"), _layout(datums, layout)
    reference = copy.deepcopy(model)
    act = padded.action_mask.bool()
    weights = torch.linspace(-1, 1, act.numel()).reshape(act.shape)
    lp_ref, ent_ref = _reference(reference, padded, temperature)
    lp, ent = micro_batch_logprobs(
        model, mb, "cpu", temperature=temperature, with_entropy=True, needed=mb.action_mask, chunk_size=chunk
    )
    assert rel_err(lp[act], lp_ref[act]) < 1e-5 and rel_err(ent[act], ent_ref[act]) < 1e-5
    if chunked:  # no target needed there: not computed (the full logits give every position its log-prob)
        assert lp[~act].abs().max() == 0 and ent[~act].abs().max() == 0
    ((lp_ref * weights)[act].sum() + 0.1 * ent_ref[act].sum()).backward()
    ((lp * weights)[act].sum() + 0.1 * ent[act].sum()).backward()
    pairs = [(a, b) for a, b in zip(reference.parameters(), model.parameters()) if a.requires_grad]
    assert pairs and all(b.grad is not None for _, b in pairs)
    assert max(rel_err(b.grad, a.grad) for a, b in pairs) < 1e-5


@pytest.mark.parametrize(
    "arch,layout",
    [
        ("qwen2_sdpa", "padded"),
        ("qwen2_sdpa", "padding_free"),
        ("qwen2_sdpa", "shared_prefix"),
        ("llama", "padding_free"),
        ("mistral_sliding", "shared_prefix"),
        ("tied", "padded"),
        ("tied", "shared_prefix"),
    ],
)
def test_chunked_log_probs_entropy_and_gradients_equal_the_full_logits(arch, layout):
    model = (_tied() if arch == "tied" else small_model(arch)).train()
    if arch == "tied":
        assert model.lm_head.weight is model.model.embed_tokens.weight
    _compare(model, layout)


@pytest.mark.parametrize("targets", [["q_proj", "v_proj"], ["q_proj", "lm_head"]], ids=["body", "lm_head"])
def test_lora_with_or_without_adapters_on_the_head(targets):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        small_model("qwen2_sdpa"), LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)
    ).train()
    assert chunkable(model)
    _compare(model, "shared_prefix", temperature=1.3)


def test_an_adapters_dropout_on_the_head_draws_the_same_masks_in_the_backwards_recompute():
    # lora_dropout on lm_head in training draws a mask per chunk: the backward recomputes each chunk's logits, and must
    # draw the forward's masks again, or the gradient is of another function. The reference: the same chunks through
    # the same adapter by plain autograd (no recompute), from the same random state.
    from peft import LoraConfig, get_peft_model

    from trl_plugins.modeling.chunked_head import _chunk, chunked_logprobs_and_entropy, output_head

    torch.manual_seed(0)
    model = get_peft_model(
        small_model("qwen2_sdpa"),
        LoraConfig(r=4, lora_alpha=8, target_modules=["lm_head"], lora_dropout=0.5, init_lora_weights=False),
    ).train()
    head = output_head(model)
    assert next(head.children(), None) is not None  # PEFT's wrapper: a head with submodules
    hidden = torch.randn(23, model.config.hidden_size, requires_grad=True)
    targets = torch.randint(0, model.config.vocab_size, (23,))
    weights = torch.linspace(-1, 1, 23)
    trained = [p for p in head.parameters() if p.requires_grad]

    def grads(seed: int, chunked: bool) -> list[torch.Tensor]:
        torch.manual_seed(seed)
        if chunked:
            lp, ent = chunked_logprobs_and_entropy(head, hidden, targets, temperature=1.3, chunk_size=CHUNK)
        else:
            parts = [
                _chunk(head, hidden[i : i + CHUNK], targets[i : i + CHUNK], 1.3, True) for i in range(0, 23, CHUNK)
            ]
            lp, ent = torch.cat([a for a, _ in parts]), torch.cat([b for _, b in parts])
        after_forward = torch.get_rng_state()
        out = list(torch.autograd.grad((lp * weights).sum() + 0.1 * ent.sum(), [hidden, *trained]))
        assert torch.equal(torch.get_rng_state(), after_forward)  # the recompute's draws leave the caller's state
        return out

    reference = grads(1, chunked=False)
    assert len(trained) == 2 and max(rel_err(a, b) for a, b in zip(grads(1, chunked=True), reference)) < 1e-5
    # The negative control: other masks (another seed) give other gradients.
    assert max(rel_err(a, b) for a, b in zip(grads(2, chunked=False), reference)) > 1e-2


@pytest.mark.parametrize("layout", ["padding_free", "shared_prefix"])
def test_under_activation_checkpointing(layout):
    model = small_model("qwen2_sdpa").train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    _compare(model, layout, temperature=1.0)


class CountingHead(torch.nn.Linear):
    """An output projection that records how many rows (positions) each call is asked for."""

    def __init__(self, source: torch.nn.Linear) -> None:
        super().__init__(source.in_features, source.out_features, bias=False)
        self.weight = source.weight
        self.rows: list[int] = []

    def forward(self, x):
        self.rows.append(x.shape[:-1].numel())
        return super().forward(x)


@pytest.mark.parametrize("layout", ["padded", "padding_free", "shared_prefix"])
def test_the_vocabulary_is_never_projected_for_more_than_one_chunk(layout):
    model = small_model("qwen2_sdpa").train()
    model.lm_head = CountingHead(model.lm_head)
    mb = _layout(group_datums(groups=2, size=2), layout)
    n_action = int(mb.action_mask.sum())
    # The negative control: today's forward asks the head for every position of the micro-batch at once.
    model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False)
    assert model.lm_head.rows == [mb.input_ids.numel()] and mb.input_ids.numel() > 10 * CHUNK
    model.lm_head.rows.clear()
    lp, _ = micro_batch_logprobs(model, mb, "cpu", needed=mb.action_mask, chunk_size=CHUNK)
    assert max(model.lm_head.rows) <= CHUNK and sum(model.lm_head.rows) == n_action  # action positions only
    model.lm_head.rows.clear()
    lp.sum().backward()  # each chunk's logits recomputed in the backward, one chunk at a time
    assert max(model.lm_head.rows) <= CHUNK and sum(model.lm_head.rows) == n_action


def test_the_chunk_size_comes_from_the_config_or_the_vocabulary_and_a_memory_budget():
    model = small_model("qwen2_sdpa")
    # 256 MiB / (151,936 x 4 bytes x 4 copies) = 110.4 -> 110 positions; tiny vocabularies are capped by memory only.
    assert auto_chunk_size(151_936) == 110 and auto_chunk_size(151_936, 64 * 2**20) == 27
    assert auto_chunk_size(10**9) == 16  # at least 16 positions
    assert logprob_chunk_size(model, 7) == 7
    assert logprob_chunk_size(model, None, 2**20) == 327
    assert logprob_chunk_size(model) == auto_chunk_size(200)
    # The run's settings (logprob_chunk_size, logprob_chunk_memory_mb), as the update reads them.
    assert LongTrajectories(chunk_size=7).chunk_size_for(model) == 7
    assert LongTrajectories(chunk_memory_mb=1).chunk_size_for(model) == 327
    assert (
        LongTrajectories().chunk_size_for(model) == auto_chunk_size(200) == LongTrajectories().chunk_size_for_vocab(200)
    )


def test_a_model_whose_logits_are_more_than_its_head_keeps_the_full_logits():
    model = small_model("qwen2_sdpa")
    model.config.final_logit_softcapping = 30.0  # Gemma 2's soft-capping happens after lm_head
    assert not chunkable(model)
    model.config.final_logit_softcapping = None
    assert chunkable(model)


def test_the_heads_pass_through_is_the_entering_threads_only():
    # A generation replica probes pushed weights (the chunked path: the head passes its input through) while its
    # rollout threads generate with the same model: they got hidden states for logits ("stack expects each tensor to
    # be equal size, [1, 64] and [1, 518]", seen in the suite). The pass-through is now the entering thread's only,
    # and a forward a hook library set on the head is given back after.
    import threading

    from trl_plugins.modeling.chunked_head import hidden_states_instead_of_logits, output_head
    from trl_plugins.tiny import build_tiny_model, build_tokenizer

    tok = build_tokenizer("qwen2_5")
    model = build_tiny_model(tok).eval()
    ids = torch.tensor([[1, 2, 3]])
    vocab, hidden = model.config.vocab_size, model.config.hidden_size
    seen = {}
    with torch.no_grad(), hidden_states_instead_of_logits(model):
        seen["here"] = model(input_ids=ids).logits.shape[-1]
        other = threading.Thread(target=lambda: seen.update(there=model(input_ids=ids).logits.shape[-1]))
        other.start()
        other.join()
        with hidden_states_instead_of_logits(model):  # nested, as a second thread's entry would count
            seen["nested"] = model(input_ids=ids).logits.shape[-1]
        seen["after nested"] = model(input_ids=ids).logits.shape[-1]
    with torch.no_grad():
        seen["outside"] = model(input_ids=ids).logits.shape[-1]
    assert seen == {"here": hidden, "there": vocab, "nested": hidden, "after nested": hidden, "outside": vocab}
    head = output_head(model)
    assert "forward" not in head.__dict__
    calls = []
    original = head.forward

    def hooked(x, *a, **k):
        calls.append(1)
        return original(x, *a, **k)

    head.forward = hooked
    with torch.no_grad():
        with hidden_states_instead_of_logits(model):
            assert model(input_ids=ids).logits.shape[-1] == hidden
        assert head.forward is hooked and model(input_ids=ids).logits.shape[-1] == vocab and calls == [1]


def test_a_forward_hook_on_the_head_keeps_the_full_logits_and_still_shapes_them():
    # A hook on lm_head (a logit bias a library adds, say) would meet the hidden states the chunks pass through, or
    # be skipped by the head that runs every chunk in one autograd function: such a model keeps the full logits,
    # hook and all (values and gradients as the reference's, which runs it).
    model = small_model("qwen2_sdpa")
    bias = torch.linspace(-2.0, 2.0, model.config.vocab_size)
    handle = model.lm_head.register_forward_hook(lambda module, args, out: out + bias)
    assert not chunkable(model)
    _compare(model, "padding_free", chunked=False)
    handle.remove()
    assert chunkable(model)
