"""Vision verifier: image questions (counting, multiple choice, short answer) checked with the K-12 rules.

Task format (one JSON line, like every task):
    {"id": "img-7", "reward": "vision", "image": "<path | base64 | data:image/png;base64,...>",
     "prompt": "How many apples are on the table?", "answer": "3", "type": "count"}
- `image`: a file path (relative paths are resolved against `image_root` when the task has one), a base64 string,
  or a data URI. It must decode (PIL, verified once per image and cached): a broken image is a data error and
  raises ValueError naming the task.
- `type`: "count" (a whole number; words like "three" count too), "choice" (with `choices`), "short"/"number"/
  "true_false"; inferred as in K-12 when absent. `judge_model` works as in K-12.
`load_images(task)` gives the PIL images for the policy side (a VLM policy's prompt, common/vlm.py); `image` may
also be a list of sources.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import os
import re

from rewards import k12
from rewards.base import Reward

IMAGE_FILE = re.compile(r"\.(?:png|jpe?g|gif|bmp|webp|tiff?)$", re.IGNORECASE)
COUNT_WORD = re.compile(r"-?\d+(?:\.\d+)?|\b(?:" + "|".join(k12.NUMBER_WORDS) + r")\b", re.IGNORECASE)


def _image_bytes(task: dict) -> bytes:
    source = task.get("image")
    if not isinstance(source, str) or not source:
        raise ValueError(f"task {task.get('id')}: a vision task needs `image` (a path, base64 or a data URI)")
    if source.startswith("data:"):
        source = source.split(",", 1)[-1]
    else:
        path = os.path.join(task.get("image_root", ""), source)
        if os.path.exists(path):
            with open(path, "rb") as f:
                return f.read()
        if IMAGE_FILE.search(source):  # meant as a path (base64 never ends in ".png")
            raise ValueError(f"task {task.get('id')}: image file {path} not found")
    try:
        return base64.b64decode(source, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"task {task.get('id')}: image is neither a file nor valid base64 ({e})") from None


_DECODED: dict[str, tuple[int, int, str]] = {}  # content hash -> (width, height, format); every sample of a task
#                                                  shares the image, so each is decoded once per process


def _decode(task: dict, data: bytes):
    """The image, every pixel decoded: a truncated file fails here (naming the task), not later in the VLM."""
    from PIL import Image

    try:
        img = Image.open(io.BytesIO(data))
        img.load()
    except (OSError, SyntaxError, ValueError) as e:  # PIL's errors for unreadable or truncated images
        raise ValueError(f"task {task.get('id')}: image does not decode: {e}") from None
    return img


def image_info(task: dict) -> tuple[int, int, str]:
    """(width, height, format) of the task's image (the first, when it has several), which must fully decode."""
    if isinstance(task.get("image"), list) and task["image"]:
        return [image_info({**task, "image": source}) for source in task["image"]][0]
    data = _image_bytes(task)
    digest = hashlib.sha1(data).hexdigest()
    if digest not in _DECODED:
        img = _decode(task, data)
        info = img.width, img.height, img.format or "unknown"
        if len(_DECODED) > 4096:
            _DECODED.clear()
        _DECODED[digest] = info
    return _DECODED[digest]


def load_image(task: dict):
    """The task's image as an RGB PIL image (read and decoded once)."""
    return _decode(task, _image_bytes(task)).convert("RGB")


def load_images(task: dict) -> list:
    """The task's images as RGB PIL images: `image` is one source or a list of them."""
    sources = task["image"] if isinstance(task["image"], list) else [task["image"]]
    return [load_image({**task, "image": source}) for source in sources]


def count_in(text: str) -> int | None:
    """The one whole number a text states ("There are 3 apples" -> 3, "three" -> 3, "3 (three)" -> 3); None when it
    states none, or several different ones: "2 or 3" is a hedge, and taking its last number would reward it."""
    values = {float(k12.NUMBER_WORDS.get(w.lower(), w)) for w in COUNT_WORD.findall(text)}
    if len(values) != 1:
        return None
    value = values.pop()
    return int(value) if value.is_integer() else None


def score(response: str, task: dict):
    width, height, fmt = image_info(task)
    if "answer" not in task:
        raise ValueError(f"task {task.get('id')}: a vision task needs `answer`")
    if task.get("type") == "count":
        pred, format_ok = k12.response_answer(response)
        got = count_in(pred) if pred is not None else None
        if got is None:
            return Reward(0.0, {"reason": "no count", "format_ok": False, "image": f"{width}x{height} {fmt}"})
        want = count_in(str(task["answer"]))
        ok = got == want
        return Reward(float(ok), {"reason": f"counted {got}", "pred": pred, "format_ok": format_ok,
                                  "type": "count", "image": f"{width}x{height} {fmt}"})
    reward = k12.score(response, task)
    reward.info["image"] = f"{width}x{height} {fmt}"
    return reward
