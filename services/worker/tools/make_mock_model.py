"""Build the files of the built-in ``kvmesh-mock`` model (run once; the output is committed).

A small byte-level BPE trained offline on text that ships with Python (stdlib docstrings), a
ChatML-style chat template, and an HF-style config.json. Byte-level BPE means every string
round-trips, so the frontend's incremental detokenizer is exercised on real multi-byte text.
Usage: python services/worker/tools/make_mock_model.py services/worker/src/kvmesh_worker/models/kvmesh-mock
"""

from __future__ import annotations

import importlib
import json
import pkgutil
import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

VOCAB_SIZE = 2048
SPECIAL = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MODULES = ["json", "asyncio", "collections", "argparse", "logging", "pathlib", "email", "http", "unittest", "typing"]


def corpus() -> list[str]:
    texts = []
    for name in MODULES:
        module = importlib.import_module(name)
        texts.append(module.__doc__ or "")
        for info in pkgutil.iter_modules(getattr(module, "__path__", [])):
            if info.name.startswith("_"):
                continue
            try:
                sub = importlib.import_module(f"{name}.{info.name}")
            except Exception:
                continue
            texts.append(sub.__doc__ or "")
    texts.append("héllo wörld — naïve café, 日本語のテキスト, emoji 🙂 ✓ ∑")
    return [t for t in texts if t]


def main(out_dir: str) -> int:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus(), trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "model_max_length": 131072,
                "chat_template": CHAT_TEMPLATE,
            },
            indent=2,
        )
        + "\n"
    )
    (out / "config.json").write_text(
        json.dumps(
            {
                "model_type": "kvmesh-mock",
                "architectures": ["KvmeshMockForCausalLM"],
                "vocab_size": tok.get_vocab_size(),
                "max_position_embeddings": 131072,
                "bos_token_id": tok.token_to_id("<s>"),
                "eos_token_id": tok.token_to_id("</s>"),
                "num_hidden_layers": 32,
                "num_key_value_heads": 8,
                "head_dim": 128,
                "torch_dtype": "bfloat16",
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {out} (vocab {tok.get_vocab_size()})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
