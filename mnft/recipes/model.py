"""Model and tokenizer from a local directory; the default "tiny" one is built locally and cached.

The tiny model is a Llama-style ``LlamaForCausalLM`` with a byte-level BPE tokenizer trained with
``tokenizers`` on the bundled dataset. Both are written with ``save_pretrained`` and always loaded back through
``AutoModelForCausalLM/AutoTokenizer.from_pretrained`` -- the path a real local checkpoint takes. Nothing is
downloaded. Nodes do not share a filesystem, so each node builds its own copy, deterministically, into
``<cache>/<hash of the build spec>/`` (local rank 0 builds into a temp dir and renames it, so a half-built
directory is never used); ``check_same_weights`` then proves every rank holds identical base weights.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import tokenizers
import torch
import torch.distributed as dist
import transformers

from mnft.recipes import data
from mnft.recipes.config import RecipeError
from mnft.recipes.dist import Dist

TINY_SPEC = {
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 344,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
    "seed": 1234,
    "format": 1,  # bump when the build changes
}
transformers.utils.logging.disable_progress_bar()  # no per-rank progress bars in the launcher's log

SPECIAL = {"pad_token": "<|pad|>", "bos_token": "<|begin|>", "eos_token": "<|end|>"}


def cache_root(configured: str | None) -> Path:
    if configured:
        return Path(configured).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "mnft" / "models"


def tiny_key() -> str:
    corpus = hashlib.sha256(data.BUNDLED.read_bytes()).hexdigest()
    spec = {**TINY_SPEC, "corpus": corpus, "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__, "torch": torch.__version__.split("+")[0]}
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def build_tiny(out: Path) -> None:
    """Train the tokenizer and initialise the model, deterministically, into ``out``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TINY_SPEC["vocab_size"], special_tokens=list(SPECIAL.values()),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    texts = [data.PROMPT.format(**ex) + ex["response"] for ex in data.read_jsonl(data.BUNDLED)]
    tok.train_from_iterator(texts, trainer=trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, **SPECIAL)
    fast.save_pretrained(out)

    spec = {k: v for k, v in TINY_SPEC.items() if k not in ("seed", "format")}
    config = transformers.LlamaConfig(**spec, pad_token_id=fast.pad_token_id, bos_token_id=fast.bos_token_id,
                                      eos_token_id=fast.eos_token_id)
    with torch.random.fork_rng():
        torch.manual_seed(TINY_SPEC["seed"])
        model = transformers.LlamaForCausalLM(config)
    # Not model.save_pretrained: with a process group initialised, transformers writes only on global rank 0,
    # and every node builds its own copy (nodes share no filesystem).
    import safetensors.torch

    model.config.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    safetensors.torch.save_model(model, str(out / "model.safetensors"), metadata={"format": "pt"})


def resolve(model: str, cache_dir: str | None, d: Dist) -> Path:
    """The local directory of the model, building the tiny one on each node if needed."""
    if model != "tiny":
        path = Path(model).expanduser()
        if not (path / "config.json").is_file():
            raise RecipeError(f"model directory {path} has no config.json (models are loaded from local "
                              "directories only; copy the checkpoint to every node)")
        return path
    path = cache_root(cache_dir) / tiny_key()
    if d.local_rank == 0 and not path.is_dir():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
        build_tiny(tmp)
        try:
            os.rename(tmp, path)  # atomic; if another process won the race, keep its copy
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
            if not path.is_dir():
                raise
        print(f"built tiny model into {path}", flush=True)
    dist.barrier()
    return path


def dtype_for(setting: str, d: Dist, *, frozen_base: bool) -> torch.dtype:
    if setting == "float32":
        return torch.float32
    if setting == "bfloat16":
        return torch.bfloat16
    # auto: a frozen (LoRA) base on GPU is stored in bf16; trained weights stay fp32 masters
    return torch.bfloat16 if d.device.type == "cuda" and frozen_base else torch.float32


def load(path: Path, dtype: torch.dtype) -> tuple[transformers.PreTrainedModel, transformers.PreTrainedTokenizerBase]:
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    if tokenizer.pad_token_id is None:  # Llama-3 style checkpoints ship without a pad token
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


@torch.no_grad()
def checksum(model: torch.nn.Module) -> float:
    """A cheap order-sensitive fingerprint of the weights (one pass, no hashing of bytes)."""
    total = 0.0
    for i, (_, p) in enumerate(sorted(model.state_dict().items())):
        x = p.detach().double()
        total += (i + 1) * (x.sum().item() + 0.5 * x.abs().sum().item())
    return total


def check_same_weights(model: torch.nn.Module, d: Dist) -> None:
    """Fail on every rank if any two ranks loaded different base weights."""
    c = checksum(model)
    t = torch.tensor([c, -c], dtype=torch.float64, device=d.device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    lo, hi = t[0].item(), -t[1].item()
    if lo != hi:
        raise RecipeError(f"base weights differ across ranks (checksum {lo!r} vs {hi!r}; this rank {c!r}): "
                          "make every node hold the same checkpoint, or delete the tiny-model cache and retry")
