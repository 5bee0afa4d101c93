"""Models for the real SGLang servers, built at run time from random weights: nothing is downloaded.

`llama()` returns the directory of a tiny Llama (2 layers, hidden 128, 4 heads, 2 KV heads, head_dim
32, float32) saved with transformers' `save_pretrained` from seeded random weights, with a byte-level
BPE tokenizer trained by `tokenizers` on the Python standard library's own sources. The model is
built once per recipe into the cache directory (`KVBROKER_SERVING_CACHE`, default
`~/.cache/kvbroker/serving`) under a name that hashes the recipe, so the suite, the demo and the
benchmark share one build; building into a temporary directory renamed into place keeps concurrent
builders apart.

float32 because the checks compare greedy tokens of the PD pair with a non-PD server: batches of other
sizes round differently, and bfloat16's rounding would turn random weights' near-ties into flips.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sysconfig
import tempfile
from pathlib import Path

LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "initializer_range": 0.2,  # wider than the default 0.02: logits far apart, greedy choices clear
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}
VOCAB_SIZE = 2048
SEED = 20
SPECIAL_TOKENS = ["<s>", "</s>", "<pad>"]
CORPUS_PACKAGES = ("email", "json", "asyncio")  # standard library sources the tokenizer learns from
RECIPE_VERSION = 1  # bump when the build changes in a way the recipe's fields do not show


def cache_root() -> Path:
    return Path(os.environ.get("KVBROKER_SERVING_CACHE", Path.home() / ".cache" / "kvbroker" / "serving"))


def llama() -> Path:
    """The tiny Llama's directory (config, weights, tokenizer), built on first use."""
    recipe = {"config": LLAMA, "vocab": VOCAB_SIZE, "seed": SEED, "corpus": CORPUS_PACKAGES, "v": RECIPE_VERSION}
    digest = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:12]
    return _built(f"llama-{digest}", _build_llama)


def _built(name: str, build) -> Path:
    target = cache_root() / name
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
    try:
        build(scratch)
        try:
            scratch.rename(target)
        except OSError:  # another builder got there first; its build is the same recipe
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target


def corpus_files() -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return sorted(str(p) for package in CORPUS_PACKAGES for p in (stdlib / package).rglob("*.py"))


def build_tokenizer(directory: Path):
    """A byte-level BPE tokenizer trained on local text, saved as transformers saves a fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train(corpus_files(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.save_pretrained(directory)
    return fast


def _build_llama(directory: Path) -> None:
    import torch

    from kvbroker_tools.serving.cpu_torchvision import declare_torchvision_ops

    declare_torchvision_ops()  # transformers' model modules import torchvision
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = build_tokenizer(directory)
    fields = {k: v for k, v in LLAMA.items() if k not in ("architectures", "torch_dtype")}
    config = LlamaConfig(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **fields)
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(directory)
    # save_pretrained records the dtype under its newer key; SGLang 0.5.23 reads torch_dtype.
    config_path = directory / "config.json"
    saved = json.loads(config_path.read_text())
    saved["torch_dtype"] = "float32"
    config_path.write_text(json.dumps(saved, indent=2))
