"""Tiny Qwen-Image pipelines with random weights, for the vLLM-Omni CPU test stand.

    python stand/tiny_models.py OUT_DIR

writes two diffusers-layout pipelines that the real vLLM-Omni 0.30.0 server loads and serves:

- ``OUT_DIR/tiny-qwen-image/`` (``QwenImagePipeline``, text to image), and
- ``OUT_DIR/tiny-qwen-image-edit-plus/`` (``QwenImageEditPlusPipeline``, multi-reference edit),

laid out as the real ``Qwen/Qwen-Image`` and ``Qwen/Qwen-Image-Edit-2509`` repositories (scheduler, text_encoder,
tokenizer, processor for Edit-Plus, transformer, vae), but with every model shrunk (about 2 MB a pipeline) and its
weights drawn at random from fixed seeds. Nothing is downloaded: the byte-level BPE tokenizer is
learned here from the pipelines' own prompt templates, and each model is built from its real class (transformers'
``Qwen2_5_VLForConditionalGeneration``, diffusers' ``QwenImageTransformer2DModel`` and ``AutoencoderKLQwenImage``)
with a tiny config.

This is a test stand's model: it exercises the server's real code paths (loading, tokenising, the vision tower,
the denoising loop, the VAE, the HTTP answers) at CPU speed. Its images are noise. It is not a way to serve anything.

The output is deterministic (fixed seeds, sorted JSON, no timestamps) for a given set of library versions, and
the script is idempotent: each pipeline is built in a temporary directory and renamed into place, and a pipeline
whose stamp (``.tiny_models.json``: the recipe's hash and every file's sha256) still matches is left alone.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import shutil
import sys
import tempfile
from collections import Counter
from itertools import pairwise
from pathlib import Path
from typing import Any

# torch, tokenizers, transformers and diffusers are imported where they are used: they take ~20 s to import here,
# and a run that finds both pipelines up to date needs none of them.
LIBRARIES = ("torch", "tokenizers", "transformers", "diffusers")
SEED = 20260105
STAMP = ".tiny_models.json"
DTYPE = "bfloat16"  # as the real checkpoints

# The special tokens of Qwen2.5-VL, in the real order (there from id 151643 on; here right after the BPE vocab).
SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]

# The fixed text the two pipelines put around a prompt (pipeline_qwen_image*.py), and the image placeholders of the
# edit pipeline. The BPE merges are learned on these, so each of their words is one token, as in the real
# tokenizer; the prefixes the pipelines drop (34 and 64 tokens) are then exactly the system prompts.
T2I_TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, spatial "
    "relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
)
EDIT_TEMPLATE = (
    "<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, objects, "
    "background), then explain how the user's text instruction should alter or modify the image. Generate a new "
    "image that meets the user's requirements while maintaining consistency with the original input where "
    "appropriate.<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
)
PICTURE_PLACEHOLDER = "Picture {}: <|vision_start|><|image_pad|><|vision_end|>"

# Qwen2.5-VL's chat template (the processor's and the tokenizer's).
CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture {{ image_count.value }}: "
    "{% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Text encoder: 2 layers, hidden 64, 4 query heads / 2 KV heads of 16; M-RoPE sections sum to head_dim / 2.
TEXT_CONFIG: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32768,
    "max_window_layers": 2,
    "rms_norm_eps": 1e-6,
    "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
    "rope_theta": 1000000.0,
}
# Vision tower: 2 blocks of width 32 (2 heads of 16), the real patching (14 px, 2x2 merge, 2 frames), the last
# block full attention as in the real one, projected to the text width.
VISION_CONFIG: dict[str, Any] = {
    "depth": 2,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_heads": 2,
    "out_hidden_size": TEXT_CONFIG["hidden_size"],
    "fullatt_block_indexes": [1],
    "patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "tokens_per_second": 2,
    "window_size": 112,
}
# Transformer: 1 dual-stream block, 2 heads of 16 (RoPE axes 4 + 6 + 6 = 16), latents 16 channels x 2x2 patches.
TRANSFORMER_CONFIG: dict[str, Any] = {
    "attention_head_dim": 16,
    "axes_dims_rope": [4, 6, 6],
    "guidance_embeds": False,
    "in_channels": 64,
    "joint_attention_dim": TEXT_CONFIG["hidden_size"],
    "num_attention_heads": 2,
    "num_layers": 1,
    "out_channels": 16,
    "patch_size": 2,
}
# VAE: the real layout (4 levels, 8x spatial compression, z_dim 16 with the real latent statistics), width 8.
VAE_CONFIG: dict[str, Any] = {
    "attn_scales": [],
    "base_dim": 8,
    "dim_mult": [1, 2, 4, 4],
    "dropout": 0.0,
    "num_res_blocks": 1,
    "temperal_downsample": [False, True, True],
    "z_dim": 16,
}
# The real Qwen-Image scheduler.
SCHEDULER_CONFIG: dict[str, Any] = {
    "base_image_seq_len": 256,
    "base_shift": 0.5,
    "invert_sigmas": False,
    "max_image_seq_len": 8192,
    "max_shift": 0.9,
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "shift_terminal": 0.02,
    "stochastic_sampling": False,
    "time_shift_type": "exponential",
    "use_beta_sigmas": False,
    "use_dynamic_shifting": True,
    "use_exponential_sigmas": False,
    "use_karras_sigmas": False,
}
# The real processor's image settings (Qwen2.5-VL: 3136 to 12845056 pixels).
IMAGE_PROCESSOR_SIZE = {"shortest_edge": 3136, "longest_edge": 12845056}

PIPELINES: dict[str, str] = {
    "tiny-qwen-image": "QwenImagePipeline",
    "tiny-qwen-image-edit-plus": "QwenImageEditPlusPipeline",
}


def pretokenize(text: str) -> list[str]:
    """Split text as Qwen2Tokenizer does before BPE (its regex, then bytes as printable characters)."""
    from tokenizers import Regex, pre_tokenizers
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    splitter = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    return [piece for piece, _ in splitter.pre_tokenize_str(text)]


def learn_bpe(texts: list[str]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Byte-level BPE learned on texts until each of their words is one token: (vocab, merges)."""
    from tokenizers import pre_tokenizers

    words: Counter[tuple[str, ...]] = Counter()
    for text in texts:
        for special in SPECIAL_TOKENS:
            text = text.replace(special, "\n")
        words.update(tuple(word) for word in pretokenize(text))
    merges: list[tuple[str, str]] = []
    while True:
        pairs: Counter[tuple[str, str]] = Counter()
        for word, count in words.items():
            for pair in pairwise(word):
                pairs[pair] += count
        if not pairs:
            break
        best = max(pairs.items(), key=lambda item: (item[1], item[0]))[0]
        merges.append(best)
        merged: Counter[tuple[str, ...]] = Counter()
        for word, count in words.items():
            out: list[str] = []
            i = 0
            while i < len(word):
                if word[i : i + 2] == best:
                    out.append(best[0] + best[1])
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            merged[tuple(out)] += count
        words = merged
    tokens = sorted(pre_tokenizers.ByteLevel.alphabet()) + [a + b for a, b in merges]
    return {token: i for i, token in enumerate(tokens)}, merges


def write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def normalize_json(root: Path) -> None:
    """Rewrite every JSON file the libraries saved with sorted keys (vocab.json keeps its id order)."""
    for path in sorted(root.rglob("*.json")):
        if path.name != "vocab.json":
            write_json(path, json.loads(path.read_text(encoding="utf-8")))


def write_tokenizer(directory: Path) -> dict[str, int]:
    """vocab.json, merges.txt and tokenizer_config.json of a Qwen2Tokenizer; returns the special tokens' ids."""
    texts = [T2I_TEMPLATE, EDIT_TEMPLATE] + [PICTURE_PLACEHOLDER.format(i) for i in range(1, 5)]
    vocab, merges = learn_bpe(texts)
    special_ids = {token: len(vocab) + i for i, token in enumerate(SPECIAL_TOKENS)}
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False) + "\n", encoding="utf-8")
    (directory / "merges.txt").write_text(
        "#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges), encoding="utf-8"
    )
    added = {
        str(i): {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for token, i in special_ids.items()
    }
    write_json(
        directory / "tokenizer_config.json",
        {
            "add_bos_token": False,
            "add_prefix_space": False,
            "added_tokens_decoder": added,
            "additional_special_tokens": SPECIAL_TOKENS[1:],
            "bos_token": None,
            "clean_up_tokenization_spaces": False,
            "eos_token": "<|im_end|>",
            "errors": "replace",
            "model_max_length": 131072,
            "pad_token": "<|endoftext|>",
            "split_special_tokens": False,
            "tokenizer_class": "Qwen2Tokenizer",
            "unk_token": None,
        },
    )
    (directory / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")
    return special_ids


def write_text_encoder(directory: Path, special_ids: dict[str, int]) -> None:
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    vocab_size = max(special_ids.values()) + 1
    config = Qwen2_5_VLConfig(
        text_config={
            **TEXT_CONFIG,
            "vocab_size": vocab_size,
            "bos_token_id": special_ids["<|endoftext|>"],
            "eos_token_id": special_ids["<|im_end|>"],
        },
        vision_config=VISION_CONFIG,
        image_token_id=special_ids["<|image_pad|>"],
        video_token_id=special_ids["<|video_pad|>"],
        vision_start_token_id=special_ids["<|vision_start|>"],
        vision_end_token_id=special_ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    torch.manual_seed(SEED)
    model = Qwen2_5_VLForConditionalGeneration(config)  # type: ignore[no-untyped-call]
    model.to(getattr(torch, DTYPE)).save_pretrained(directory)


def write_transformer(directory: Path) -> None:
    import torch
    from diffusers.models.transformers.transformer_qwenimage import QwenImageTransformer2DModel

    torch.manual_seed(SEED + 1)
    QwenImageTransformer2DModel(**TRANSFORMER_CONFIG).to(getattr(torch, DTYPE)).save_pretrained(directory)


def write_vae(directory: Path) -> None:
    import torch
    from diffusers.models.autoencoders.autoencoder_kl_qwenimage import AutoencoderKLQwenImage

    torch.manual_seed(SEED + 2)
    AutoencoderKLQwenImage(**VAE_CONFIG).to(getattr(torch, DTYPE)).save_pretrained(directory)


def write_processor(directory: Path, tokenizer_dir: Path) -> None:
    from transformers import Qwen2Tokenizer, Qwen2VLImageProcessor, Qwen2VLProcessor
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    processor = Qwen2VLProcessor(  # type: ignore[no-untyped-call]
        image_processor=Qwen2VLImageProcessor(size=IMAGE_PROCESSOR_SIZE),
        tokenizer=Qwen2Tokenizer.from_pretrained(tokenizer_dir),
        video_processor=Qwen2VLVideoProcessor(),
        chat_template=CHAT_TEMPLATE,
    )
    processor.save_pretrained(directory)
    # Loading the tokenizer from a local directory leaves these in its saved config: not part of the model.
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    write_json(config_path, {k: v for k, v in config.items() if k not in ("is_local", "local_files_only")})


def build(name: str, directory: Path) -> None:
    """Write the pipeline `name` into the (empty) directory."""
    import diffusers
    import transformers
    from diffusers.schedulers.scheduling_flow_match_euler_discrete import FlowMatchEulerDiscreteScheduler

    for library in (diffusers, transformers):
        library.utils.logging.set_verbosity_error()
        library.utils.logging.disable_progress_bar()
    components: dict[str, list[str]] = {
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "text_encoder": ["transformers", "Qwen2_5_VLForConditionalGeneration"],
        "tokenizer": ["transformers", "Qwen2Tokenizer"],
        "transformer": ["diffusers", "QwenImageTransformer2DModel"],
        "vae": ["diffusers", "AutoencoderKLQwenImage"],
    }
    FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG).save_config(directory / "scheduler")
    special_ids = write_tokenizer(directory / "tokenizer")
    write_text_encoder(directory / "text_encoder", special_ids)
    write_transformer(directory / "transformer")
    write_vae(directory / "vae")
    if name == "tiny-qwen-image-edit-plus":
        components["processor"] = ["transformers", "Qwen2VLProcessor"]
        write_processor(directory / "processor", directory / "tokenizer")
    write_json(
        directory / "model_index.json",
        {"_class_name": PIPELINES[name], "_diffusers_version": diffusers.__version__, **components},
    )
    normalize_json(directory)
    for path in directory.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)
    directory.chmod(0o755)


def recipe_hash(name: str) -> str:
    """What the output depends on: this file, the pipeline's name and the libraries that write it."""
    digest = hashlib.sha256(Path(__file__).read_bytes())
    for part in [name, *(f"{library}=={importlib.metadata.version(library)}" for library in LIBRARIES)]:
        digest.update(b"\0" + part.encode())
    return digest.hexdigest()


def file_hashes(directory: Path) -> dict[str, str]:
    return {
        path.relative_to(directory).as_posix(): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(directory.rglob("*"))
        if path.is_file() and path.name != STAMP
    }


def is_current(directory: Path, recipe: str) -> bool:
    stamp_path = directory / STAMP
    if not stamp_path.is_file():
        return False
    stamp = json.loads(stamp_path.read_text(encoding="utf-8"))
    return bool(stamp.get("recipe") == recipe and stamp.get("files") == file_hashes(directory))


def ensure(out_dir: Path, name: str) -> bool:
    """Build OUT_DIR/name unless its stamp is current; returns whether it was (re)built."""
    target = out_dir / name
    recipe = recipe_hash(name)
    if is_current(target, recipe):
        return False
    out_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=out_dir))
    try:
        build(name, staging)
        write_json(staging / STAMP, {"files": file_hashes(staging), "recipe": recipe})
        if target.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{name}.old.", dir=out_dir))
            target.rename(old / name)
            staging.rename(target)
            shutil.rmtree(old)
        else:
            staging.rename(target)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("out_dir", type=Path, help="where tiny-qwen-image/ and tiny-qwen-image-edit-plus/ go")
    args = parser.parse_args(argv)
    for name in PIPELINES:
        target = args.out_dir / name
        built = ensure(args.out_dir, name)
        size = sum(path.stat().st_size for path in target.rglob("*") if path.is_file())
        print(f"{target}: {'written' if built else 'up to date'}, {size / 1e6:.2f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
