"""A tiny random-weight Llama and its tokenizer, generated locally: nothing is downloaded.

``python -m kvprefetch.agents.vllm.tiny_model OUT_DIR`` writes a Hugging Face model directory
(``config.json``, ``model.safetensors``, ``generation_config.json``, ``tokenizer.json``,
``tokenizer_config.json`` with a chat template) that vLLM serves and ``transformers``'
``AutoTokenizer`` loads offline. Weights come from a fixed seed, so two runs write the same
tensors. The tokenizer is byte-level BPE without merges (one token per UTF-8 byte, plus the
special tokens below): it needs no training and tokenizes any text the same way on every
machine.

The model is for exercising the serving path (scheduling, prefix caching, KV transfer
through LMCache), not for text: it emits random tokens. Its KV is
``2 x layers x kv_heads x head_dim x 2`` bytes per token in bfloat16 (1 KiB by default).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

#: Special tokens after the 256 byte tokens, in id order.
SPECIAL_TOKENS = ("<|begin_of_text|>", "<|end_of_text|>", "<|system|>", "<|user|>",
                  "<|assistant|>", "<|end|>")
BOS, EOS = SPECIAL_TOKENS[0], SPECIAL_TOKENS[1]

#: One turn per message, each closed by <|end|>; the generation prompt opens an assistant turn.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


@dataclass(frozen=True)
class TinyLlamaSpec:
    """The model's shape. head_dim 64: vLLM's CPU attention supports it."""

    layers: int = 2
    hidden_size: int = 256
    intermediate_size: int = 512
    attention_heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    #: 256 bytes + the special tokens, padded up to a multiple of 64.
    vocab_size: int = 320
    max_position_embeddings: int = 8192
    dtype: str = "bfloat16"
    seed: int = 0

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * 2


def _byte_vocab() -> dict[str, int]:
    """GPT-2's byte-to-unicode table as a vocabulary: byte b -> its printable stand-in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    table = dict(zip(printable, chars, strict=True))
    return {chr(table[b]): b for b in range(256)}


def build_tokenizer(out_dir: Path, spec: TinyLlamaSpec) -> None:
    """Write tokenizer.json and tokenizer_config.json (a PreTrainedTokenizerFast)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = _byte_vocab()
    for offset, token in enumerate(SPECIAL_TOKENS):
        vocab[token] = 256 + offset
    if len(vocab) > spec.vocab_size:
        raise ValueError(f"vocab_size {spec.vocab_size} < {len(vocab)} tokens")
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                       use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": EOS,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": spec.max_position_embeddings,
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out_dir / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": BOS, "eos_token": EOS, "pad_token": EOS}, indent=2) + "\n")


def build_model(out_dir: Path, spec: TinyLlamaSpec) -> None:
    """Write config.json, generation_config.json and model.safetensors (seeded weights)."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    bos_id = 256 + SPECIAL_TOKENS.index(BOS)
    eos_id = 256 + SPECIAL_TOKENS.index(EOS)
    config = LlamaConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.attention_heads,
        num_key_value_heads=spec.kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        tie_word_embeddings=False,
        dtype=spec.dtype,
    )
    torch.manual_seed(spec.seed)
    with torch.no_grad():
        model = LlamaForCausalLM(config).to(getattr(torch, spec.dtype))
    model.save_pretrained(out_dir, safe_serialization=True)
    GenerationConfig(bos_token_id=bos_id, eos_token_id=eos_id,
                     pad_token_id=eos_id).save_pretrained(out_dir)


def generate(out_dir: Path | str, spec: TinyLlamaSpec | None = None) -> Path:
    """Write the model and tokenizer into ``out_dir`` (created) and return it."""
    spec = spec or TinyLlamaSpec()
    path = Path(out_dir)
    path.mkdir(parents=True, exist_ok=True)
    build_tokenizer(path, spec)
    build_model(path, spec)
    return path


#: The repository id under which :func:`hub_cache` files the tokenizer.
HUB_REPO_ID = "kvprefetch/tiny-llama"
#: The tokenizer's files (what a client that counts tokens needs; no weights).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "config.json", "generation_config.json")


def hub_cache(model_dir: Path | str, cache_dir: Path | str,
              repo_id: str = HUB_REPO_ID) -> str:
    """File the model directory's tokenizer in a Hugging Face hub cache layout under
    ``cache_dir`` (``models--<org>--<name>/snapshots/<hash>/`` and ``refs/main``), so that
    a client that loads tokenizers by hub name, even offline (aiperf with
    ``HF_HUB_OFFLINE=1`` resolves names through ``snapshot_download(local_files_only=
    True)``, never a path), finds it with ``HF_HUB_CACHE=cache_dir``. Returns ``repo_id``.
    The snapshot's name is a hash of the files, so the same tokenizer gets the same one."""
    import hashlib
    import shutil

    src = Path(model_dir)
    files = [name for name in TOKENIZER_FILES if (src / name).is_file()]
    digest = hashlib.sha1()
    for name in files:
        digest.update(name.encode() + b"\0" + (src / name).read_bytes())
    revision = digest.hexdigest()
    repo = Path(cache_dir) / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True, exist_ok=True)
    for name in files:
        shutil.copyfile(src / name, snapshot / name)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(revision)
    return repo_id


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--seed", type=int, default=TinyLlamaSpec.seed)
    parser.add_argument("--layers", type=int, default=TinyLlamaSpec.layers)
    args = parser.parse_args(argv)
    spec = TinyLlamaSpec(seed=args.seed, layers=args.layers)
    path = generate(args.out_dir, spec)
    print(f"tiny Llama ({spec.layers} layers, {spec.kv_bytes_per_token} B KV per token) "
          f"in {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
