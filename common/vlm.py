"""Vision-language policies (Qwen2-VL family): the model, its processor, image prompts and the trainer's forward.

- `--model tiny-vlm`: a 2-layer Qwen2-VL (vision tower, merger, language model) with random weights and a processor
  built in memory around the tiny byte-level tokenizer; nothing is downloaded.
- `--model default-vlm`: the embedded SmolLM2-135M-Instruct as the language model of a Qwen2-VL, with a random
  2-block vision tower and merger: a policy that reads and writes English but must learn to see. SmolLM2's layers
  are Qwen2's without the q/k/v biases, which start at zero, and 3-D rope equals SmolLM2's rope on text, so on
  text it is SmolLM2 exactly. A local Qwen2-VL / Qwen2.5-VL
  folder (or hub id) loads with `AutoModelForImageTextToText` and `AutoProcessor` (transformers' PIL image
  processor: no torchvision).
- Token-in/token-out holds for images: the processor expands each image into its placeholder tokens once, in the
  explorer; those ids are the prompt the engine samples from and the trainer scores, and the processor's pixel
  values travel with them (`ImageInputs`), so the trainer recomputes log-probs on exactly what the model saw.
- A group's samples share one `ImageInputs` object: the buffer pickles it once per batch and the trainer runs the
  vision tower once per group (`vlm_hidden_states`), never once per sample.
"""

from __future__ import annotations

import json
import os

import torch

from common.experience import ImageInputs

TINY_VLM = "tiny-vlm"
DEFAULT_VLM = "default-vlm"
BUILT_IN = (TINY_VLM, DEFAULT_VLM)  # built in memory, seeded: every process builds the same weights
# The built-in VLMs' processor: 4 to 16 image tokens per image (14 px patches, 2x2 merged).
BUILT_IN_IMAGE_PIXELS = (56 * 56, 112 * 112)
VISION_TOKENS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]
CHATML_IMAGE_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def is_vlm(name: str, path: str | None = None) -> bool:
    """Whether `--model` (resolved to `path`) is a vision-language model: tiny-vlm, or a config with a vision tower."""
    if name in BUILT_IN:
        return True
    if name == "tiny" or path is None:
        return False
    config = os.path.join(path, "config.json")
    if os.path.exists(config):
        with open(config) as f:
            return "vision_config" in json.load(f)
    from transformers import AutoConfig

    try:
        return hasattr(AutoConfig.from_pretrained(path), "vision_config")
    except OSError:  # not reachable here: loading the model says so in one line
        return False


def add_vision_tokens(tokenizer):
    """A built-in VLM's tokenizer (tiny's or SmolLM2's) with Qwen2-VL's image specials and a ChatML template that
    places them."""
    tokenizer.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    tokenizer.chat_template = CHATML_IMAGE_TEMPLATE
    return tokenizer


def qwen2_vl(tokenizer, text: dict, vision_width: int, seed: int, tie_word_embeddings: bool = True):
    """A random Qwen2-VL around `text` (its language model's size and rope theta): a 2-block vision tower of width
    `vision_width` on 14-px patches, 2x2 patches merged into one token of the language model's width."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    pairs = text["hidden_size"] // text["num_attention_heads"] // 2  # rotary pairs per head: time, height, width
    rope = {"rope_type": "default", "rope_theta": text.pop("rope_theta"),
            "mrope_section": [pairs // 4, 3 * pairs // 8, pairs - pairs // 4 - 3 * pairs // 8]}
    config = Qwen2VLConfig(
        text_config=dict(**text, vocab_size=len(tokenizer), rope_parameters=rope, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id),
        vision_config=dict(depth=2, embed_dim=vision_width, hidden_size=text["hidden_size"], num_heads=2, mlp_ratio=2,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=tie_word_embeddings,
    )
    torch.manual_seed(seed)
    return Qwen2VLForConditionalGeneration(config)


def build_tiny_vlm(tokenizer, seed: int = 0):
    """A random 2-layer Qwen2-VL, head size 32, vision width 32."""
    text = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, max_position_embeddings=1024, rope_theta=10000.0)
    return qwen2_vl(tokenizer, text, vision_width=32, seed=seed)


def build_default_vlm(text_model, tokenizer, seed: int = 0):
    """`text_model` (the embedded SmolLM2, a Llama) as the language model of a Qwen2-VL with a random vision tower
    of width 64. Its weights move over unchanged; Qwen2's q/k/v biases, which Llama lacks, are zero."""
    c = text_model.config
    text = dict(hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
                num_key_value_heads=c.num_key_value_heads, max_position_embeddings=c.max_position_embeddings,
                rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_parameters["rope_theta"])
    model = qwen2_vl(tokenizer, text, vision_width=64, seed=seed, tie_word_embeddings=c.tie_word_embeddings)
    text_model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    language = model.model.language_model
    missing = language.load_state_dict(text_model.model.state_dict(), strict=False).missing_keys
    with torch.no_grad():
        for name in missing:
            assert name.endswith("_proj.bias"), name  # anything else would be a layer left random
            language.get_parameter(name).zero_()
    model.tie_weights()
    # The merger's last layer starts near zero: image tokens then read as almost blank to the language model, which
    # keeps answering in English, instead of as random vectors far larger than its word embeddings.
    torch.nn.init.normal_(model.model.visual.merger.mlp[-1].weight, std=1e-4)
    torch.nn.init.zeros_(model.model.visual.merger.mlp[-1].bias)
    return model


def load_vlm(path: str, dtype: torch.dtype, flag: str = "--model"):
    from transformers import AutoModelForImageTextToText

    try:
        return AutoModelForImageTextToText.from_pretrained(path, dtype=dtype)
    except (OSError, ValueError) as e:
        raise SystemExit(f"error: {flag} {path}: cannot load as a vision-language model "
                         f"({str(e).splitlines()[0]})") from None


class Processor:
    """What a VLM policy needs of a processor: the tokenizer (chat template), the image processor (pixel values and
    patch grids), and the expansion of each image's placeholder into one token per merged patch group, which is
    what transformers' Qwen2-VL processor does (its class also wants a video processor, i.e. torchvision)."""

    def __init__(self, tokenizer, image_processor, merge_size: int):
        self.tokenizer, self.image_processor, self.merge_size = tokenizer, image_processor, merge_size
        self.image_token = "<|image_pad|>"

    def __call__(self, text: str, images: list) -> tuple[list[int], ImageInputs]:
        out = self.image_processor(images=images, return_tensors="pt")
        grid = out["image_grid_thw"]
        parts = text.split(self.image_token)
        if len(parts) != len(images) + 1:
            raise ValueError(f"the chat template placed {len(parts) - 1} image placeholders for {len(images)} images")
        counts = (grid.prod(-1) // self.merge_size ** 2).tolist()
        expanded = parts[0] + "".join(self.image_token * n + part for n, part in zip(counts, parts[1:]))
        ids = self.tokenizer(expanded, add_special_tokens=False)["input_ids"]
        return ids, ImageInputs(out["pixel_values"], grid, tokens=sum(counts))


def load_processor(name: str, path: str, tokenizer) -> Processor:
    """The model's image processor (transformers' PIL one for Qwen2-VL) around the run's tokenizer; one-line error
    when the folder has none."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    if name in BUILT_IN:
        low, high = BUILT_IN_IMAGE_PIXELS
        images = Qwen2VLImageProcessorPil(min_pixels=low, max_pixels=high,
                                          size={"shortest_edge": low, "longest_edge": high})
    elif os.path.isdir(path) and not os.path.exists(os.path.join(path, "preprocessor_config.json")):
        raise SystemExit(f"error: --model {name}: no image processor (preprocessor_config.json) in {path}")
    else:
        images = Qwen2VLImageProcessorPil.from_pretrained(path)
    if tokenizer.convert_tokens_to_ids("<|image_pad|>") in (None, tokenizer.unk_token_id):
        raise SystemExit(f"error: --model {name}: its tokenizer has no <|image_pad|> token (not a Qwen2-VL model)")
    return Processor(tokenizer, images, images.merge_size)


def image_prompt(processor: Processor, prompt: str, images: list) -> tuple[list[int], ImageInputs]:
    """Prompt ids of an image task (the chat template applied, every image expanded into its placeholder tokens)
    and the pixel values those placeholders stand for. `images`: PIL images (rewards.vision.load_images)."""
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": prompt}]
    text = processor.tokenizer.apply_chat_template([{"role": "user", "content": content}],
                                                   add_generation_prompt=True, tokenize=False)
    return processor(text, images)


def is_frozen(name: str, part: str) -> bool:
    """Whether `--freeze part` keeps parameter `name` as it is: 'vision' the vision tower and merger (`visual.*`),
    'language' everything else. Frozen parameters get no gradient and are never synced (the explorers have them)."""
    return part != "none" and ("visual." in name) == (part == "vision")


def freeze(model, part: str) -> None:
    """--freeze: no gradient for the frozen part (the optimizer skips parameters without one)."""
    for name, parameter in model.named_parameters():
        if is_frozen(name, part):
            parameter.requires_grad_(False)


def stack_images(images: list) -> dict:
    """The generate/forward keyword arguments for rows with these images (None: a text row), in row order."""
    present = [im for im in images if im is not None]
    if not present:
        return {}
    return {"pixel_values": torch.cat([im.pixel_values for im in present]),
            "image_grid_thw": torch.cat([im.grid_thw for im in present])}


def vlm_hidden_states(body, input_ids, attention_mask, images: list):
    """Last hidden states [B, T, H] of a Qwen2-VL body for rows with images (`images[i]`: row i's ImageInputs or
    None). The vision tower runs once per distinct ImageInputs (a group's rows share one), its features are copied
    into every row that shows them, and the body computes the 3-D rope positions from the ids and grids."""
    from transformers.modeling_outputs import BaseModelOutputWithPooling

    device = input_ids.device
    distinct = list({id(im): im for im in images if im is not None}.values())
    if not distinct:
        return body(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
    stacked = stack_images(distinct)
    features = body.get_image_features(stacked["pixel_values"].to(device), stacked["image_grid_thw"].to(device),
                                       return_dict=True).pooler_output  # one [tokens, H] per image
    per_input, at = {}, 0
    for im in distinct:
        per_input[id(im)] = features[at: at + len(im.grid_thw)]
        at += len(im.grid_thw)
    rows = [f for im in images if im is not None for f in per_input[id(im)]]
    grid = torch.cat([im.grid_thw for im in images if im is not None]).to(device)
    return body(input_ids=input_ids, attention_mask=attention_mask, image_grid_thw=grid,
                mm_token_type_ids=(input_ids == body.config.image_token_id).int(),
                mm_encoder_outputs={"image": BaseModelOutputWithPooling(pooler_output=tuple(rows))},
                use_cache=False).last_hidden_state
