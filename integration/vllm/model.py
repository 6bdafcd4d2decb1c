"""A tiny random-weight Llama for real vLLM, built at test time: no model hub is reachable.

Written here: ``config.json``, a byte-level BPE ``tokenizer.json`` trained with
``tokenizers``, a ChatML chat template that renders tools the way Hermes-style models
expect (vLLM's ``hermes`` tool parser looks for the ``<tool_call>`` tokens, the
``deepseek_r1`` reasoning parser for ``<think>``), and seeded random weights.

Why weights rather than ``--load-format dummy``: vLLM's dummy weights are uniform in
±1e-3, so every logit is a near-tie; the order of top logprobs and the sampled token
then flip with the order of float reductions across CPU threads, and the same request
sent twice differs. Weights with a spread of logits make the engine reproducible, which
side-by-side comparison needs. They are written with the engine's own torch
(``python model.py DIR --weights`` under vLLM's interpreter).
"""

from __future__ import annotations

import json
from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>",
                  "<think>", "</think>"]
VOCAB_SIZE = 4096
MAX_MODEL_LEN = 2048
# Shapes: "tiny" for the tier (a request in milliseconds: wire fidelity is what it tests);
# "small" where the engine's time must be seconds, not noise: the real-vLLM admission
# benchmark and the test that holds a backlog on it (measured on the 2-core machine, one
# thread: ~0.9 ms a prompt token, ~14 ms an output token alone; ~44 M parameters).
SIZES = {
    "tiny": {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32},
    "small": {"hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 6,
              "num_attention_heads": 12, "num_key_value_heads": 4, "head_dim": 64},
}

# ChatML with Hermes-style tool rendering (the shape of Qwen 2.5's template, shortened).
CHAT_TEMPLATE = """\
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools

You may call one or more functions. Function signatures are within <tools></tools>:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>

For each call return a JSON object within <tool_call></tool_call> tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' %}
{%- elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% elif message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant
{% if message.content %}{{ message.content }}
{% endif %}
{%- for call in message.tool_calls %}<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments }}}
</tool_call>
{% endfor %}<|im_end|>
{% else %}<|im_start|>{{ message.role }}
{% if message.content is string %}{{ message.content }}{% else %}\
{% for part in message.content %}{% if part.type == 'text' %}{{ part.text }}{% endif %}{% endfor %}\
{% endif %}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def _corpus() -> list[str]:
    """Training text: English-ish words, JSON and code punctuation, digits, Unicode."""
    words = ("the quick brown fox jumps over lazy dog narwhal tusk ocean arctic ice whale pod "
             "swim deep cold water light wave router engine token prefill decode budget queue "
             "admit place stream chunk event model pool latency fast slow calm blue green red "
             "north south east west sun moon star cloud rain snow wind river stone tree leaf "
             "weather city name location unit celsius fahrenheit search query result value").split()
    lines = []
    for i in range(4000):
        picked = [words[(i * 7 + j * 13) % len(words)] for j in range(12)]
        lines.append(" ".join(picked))
        lines.append(json.dumps({"name": picked[0], "arguments": {picked[1]: picked[2], "n": i}}))
        lines.append(f"def {picked[3]}_{i}(x): return x * {i} + {i % 97}  # {picked[4]}")
    lines.append("héllo wörld ünïcode 日本語 中文 emoji 🐋🦄 ±×÷ ß ø å")
    return lines


def build(directory: Path, size: str = "tiny") -> Path:
    """Write the model's files (of shape ``size``, one of ``SIZES``) into ``directory``
    (created); return it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    directory.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_corpus(), trainer)
    tok.save(str(directory / "tokenizer.json"))
    vocab = tok.get_vocab_size()
    eos = tok.token_to_id("<|im_end|>")
    pad = tok.token_to_id("<|endoftext|>")
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", **SIZES[size],
        "vocab_size": vocab, "max_position_embeddings": MAX_MODEL_LEN,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "hidden_act": "silu",
        "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "bos_token_id": pad, "eos_token_id": eos, "pad_token_id": pad,
    }
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    (directory / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": pad, "eos_token_id": eos, "pad_token_id": pad}))
    added = {str(tok.token_to_id(t)): {"content": t, "special": t not in (
        "<tool_call>", "</tool_call>", "<think>", "</think>"), "lstrip": False, "rstrip": False,
        "normalized": False, "single_word": False} for t in SPECIAL_TOKENS}
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": MAX_MODEL_LEN,
        "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "unk_token": None, "added_tokens_decoder": added, "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
    }, indent=1))
    return directory


def write_weights(directory: Path, seed: int = 0) -> Path:
    """Seeded random weights as ``model.safetensors`` (needs torch and safetensors)."""
    import torch
    from safetensors.torch import save_file

    cfg = json.loads((directory / "config.json").read_text())
    gen = torch.Generator().manual_seed(seed)
    hidden, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    heads, kv, head_dim = (cfg["num_attention_heads"], cfg["num_key_value_heads"],
                           cfg["head_dim"])

    def normal(*shape: int, std: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * std).contiguous()

    tensors = {"model.embed_tokens.weight": normal(vocab, hidden, std=1.0),
               "model.norm.weight": torch.ones(hidden),
               # Logits with a standard deviation of about 3: clear winners, no near-ties.
               "lm_head.weight": normal(vocab, hidden, std=0.3)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors |= {
            p + "input_layernorm.weight": torch.ones(hidden),
            p + "post_attention_layernorm.weight": torch.ones(hidden),
            p + "self_attn.q_proj.weight": normal(heads * head_dim, hidden, std=0.05),
            p + "self_attn.k_proj.weight": normal(kv * head_dim, hidden, std=0.05),
            p + "self_attn.v_proj.weight": normal(kv * head_dim, hidden, std=0.05),
            p + "self_attn.o_proj.weight": normal(hidden, heads * head_dim, std=0.05),
            p + "mlp.gate_proj.weight": normal(inter, hidden, std=0.05),
            p + "mlp.up_proj.weight": normal(inter, hidden, std=0.05),
            p + "mlp.down_proj.weight": normal(hidden, inter, std=0.05),
        }
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


if __name__ == "__main__":
    import sys

    target = Path(sys.argv[1])
    if "--weights" in sys.argv[2:]:
        write_weights(target)
    else:
        build(target)
    print(target)
