"""`--taskset shapes`: procedural image questions (verifier vision) whose answer is only in the picture.

Each task is a 112x112 PNG (a multiple of 28, the Qwen2-VL patch x merge size) rendered with PIL when the task is
made, no data files: circles, squares and triangles in red, green, blue or yellow on white. Levels (`--difficulty`):
  1. one shape: "What colour is the shape?"              answer red | green | blue | yellow
  2. one shape in one half: "left or right?"             answer left | right
  3. 1-4 shapes apart from each other: "How many?"        answer 1 | 2 | 3 | 4
Answers are uniform, so a policy that ignores the image scores at most `BLIND_CHANCE[level]` in expectation (always
guessing one answer); held-out accuracy above it is the model seeing.
"""

from __future__ import annotations

import base64
import io
import random

from PIL import Image, ImageDraw

from common.tasks.stream import TaskStream

IMAGE_SIZE = 112
MARGIN = 4  # px kept clear at the border, so no shape is cut off
MIDLINE_GAP = 6  # px a level-2 shape keeps from the vertical midline, so its side is never ambiguous
PALETTE = {"red": (220, 30, 30), "green": (30, 160, 60), "blue": (30, 70, 220), "yellow": (240, 200, 0)}
KINDS = ("circle", "square", "triangle")
BLIND_CHANCE = {1: 1 / len(PALETTE), 2: 1 / 2, 3: 1 / 4}  # the best expected reward without looking
QUESTIONS = {
    1: "What colour is the shape in the image? Reply with one of: red, green, blue, yellow.",
    2: "Is the shape in the left half or the right half of the image? Reply with one of: left, right.",
    3: "How many shapes are in the image? Reply with one of: 1, 2, 3, 4.",
}
ANSWER_FORMAT = "End with a final line 'Answer: <your answer>'."
# "short" for colour and side: the answer line must equal the reference after normalising case and punctuation, so
# "red or blue" scores 0; "choice" would also accept option letters the prompt never offers ("Answer: A").
ANSWER_TYPE = {1: "short", 2: "short", 3: "count"}


def render(shapes: list[tuple[str, str, int, int, int]]) -> str:
    """(kind, colour, x, y, size) boxes drawn on white, as a PNG data URI (identical pixels give identical bytes)."""
    image = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), (255, 255, 255))
    draw = ImageDraw.Draw(image)
    for kind, colour, x, y, size in shapes:
        box, fill = (x, y, x + size - 1, y + size - 1), PALETTE[colour]
        if kind == "circle":
            draw.ellipse(box, fill=fill)
        elif kind == "square":
            draw.rectangle(box, fill=fill)
        else:
            draw.polygon([(x + size // 2, y), (x, y + size - 1), (x + size - 1, y + size - 1)], fill=fill)
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def shapes_task(rng: random.Random, difficulty: int) -> dict:
    """One image question at `difficulty` (levels above 3 ask level 3's question)."""
    level = min(max(difficulty, 1), 3)
    kind, colour = rng.choice(KINDS), rng.choice(list(PALETTE))
    if level == 1:
        size = rng.randint(24, 56)
        x, y = (rng.randint(MARGIN, IMAGE_SIZE - MARGIN - size) for _ in range(2))
        shapes, answer = [(kind, colour, x, y, size)], colour
    elif level == 2:
        size, side, half = rng.randint(20, 44), rng.choice(["left", "right"]), IMAGE_SIZE // 2
        x = (rng.randint(MARGIN, half - MIDLINE_GAP - size) if side == "left"
             else rng.randint(half + MIDLINE_GAP, IMAGE_SIZE - MARGIN - size))
        shapes, answer = [(kind, colour, x, rng.randint(MARGIN, IMAGE_SIZE - MARGIN - size), size)], side
    else:
        # One shape per cell of a 3x3 grid, inset 2 px in its cell: shapes never touch (>= 4 px apart).
        cell, n = IMAGE_SIZE // 3, rng.randint(1, 4)
        shapes = []
        for index in rng.sample(range(9), n):
            size = rng.randint(14, cell - 10)
            row, col = divmod(index, 3)
            x, y = (k * cell + rng.randint(2, cell - 2 - size) for k in (col, row))
            shapes.append((rng.choice(KINDS), rng.choice(list(PALETTE)), x, y, size))
        answer = str(n)
    return {"prompt": f"{QUESTIONS[level]}\n{ANSWER_FORMAT}", "image": render(shapes), "answer": answer,
            "type": ANSWER_TYPE[level], "reward": "vision", "difficulty": difficulty}


def shapes_split(seed: int, difficulty: int, eval_size: int,
                 curriculum: bool = False) -> tuple[TaskStream, list[dict]]:
    """(endless training stream, fixed held-out list at `difficulty`); held-out images never appear in training
    (each level has one question, so the image is what makes a task). With `curriculum` the stream draws levels
    1..difficulty (see TaskStream)."""
    rng = random.Random(f"shapes-eval-{seed}")
    eval_tasks = [{**shapes_task(rng, difficulty), "id": f"shapes-eval-{i}"} for i in range(eval_size)]
    held_out = {t["image"] for t in eval_tasks}

    def generate(rng: random.Random, index: int, level: int) -> dict:
        while True:
            task = shapes_task(rng, level)
            if task["image"] not in held_out:
                return {**task, "id": f"shapes-{index}"}

    levels = list(range(1, difficulty + 1)) if curriculum else [difficulty]
    return TaskStream(generator=generate, seed=seed, levels=levels, curriculum=curriculum), eval_tasks
