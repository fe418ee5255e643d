"""`--taskset shapes`: procedural image questions (verifier vision) whose answer is only in the picture.

Each task is a 112x112 PNG (a multiple of 28, the Qwen2-VL patch x merge size) rendered with PIL when the task is
made, no data files: circles, squares and triangles in red, green, blue or yellow on white. Levels (`--difficulty`):
  1. one shape: "Is the shape red?" (red half the time)      answer yes | no
  2. one shape: "What colour is the shape?"                    answer red | green | blue | yellow
  3. one shape in one half: "left or right?"                   answer left | right
  4. 1-4 shapes apart from each other: "How many?"             answer 1 | 2 | 3 | 4
Answers are uniform and independent of the question's text, so a policy that ignores the image scores at most
`BLIND_CHANCE[level]` in expectation; held-out accuracy above it is the model seeing. Level 1 is the one a 135M
language model can start on: it already answers yes or no to a yes/no question about half the time, and the
answer depends on the image alone (not on comparing it with a colour named in the question).
"""

from __future__ import annotations

import base64
import io
import random

from PIL import Image, ImageDraw

from common.tasks.procedural import held_out_split
from common.tasks.stream import TaskStream

IMAGE_SIZE = 112
MARGIN = 4  # px kept clear at the border, so no shape is cut off
MIDLINE_GAP = 6  # px a level-2 shape keeps from the vertical midline, so its side is never ambiguous
PALETTE = {"red": (220, 30, 30), "green": (30, 160, 60), "blue": (30, 70, 220), "yellow": (240, 200, 0)}
KINDS = ("circle", "square", "triangle")
BLIND_CHANCE = {1: 1 / 2, 2: 1 / len(PALETTE), 3: 1 / 2, 4: 1 / 4}  # the best expected reward without looking
QUESTIONS = {
    1: "Is the shape in the picture red? Reply with one word: yes or no.",
    2: "What colour is the shape in the picture: red, green, blue or yellow?",
    3: "Is the shape in the left half or the right half of the picture?",
    4: "How many shapes are in the picture: 1, 2, 3 or 4?",
}
# A worked line, as in the arith taskset: the 135M default model follows a shown format far more often than a
# described one. Its answer is one of the options, so copying it scores the blind ceiling, no more.
EXAMPLES = {2: "The shape is green. Answer: green", 3: "The shape is on the left. Answer: left",
            4: "I count 2 shapes. Answer: 2"}
ANSWER_FORMAT = " Reply with one short line, then 'Answer: <answer>'. Example: "
# "true_false" and "short" need the answer itself (after normalising case and punctuation), so "red or blue" or
# "yes or no" score 0; "choice" would also accept option letters the prompt never offers ("Answer: A").
ANSWER_TYPE = {1: "true_false", 2: "short", 3: "short", 4: "count"}


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
    """One image question at `difficulty` (levels above 4 ask level 4's question)."""
    level = min(max(difficulty, 1), 4)
    kind, colour = rng.choice(KINDS), rng.choice(list(PALETTE))
    question = QUESTIONS[level] + (ANSWER_FORMAT + EXAMPLES[level] if level in EXAMPLES else "")
    if level <= 2:
        size = rng.randint(24, 56)
        x, y = (rng.randint(MARGIN, IMAGE_SIZE - MARGIN - size) for _ in range(2))
        shapes, answer = [(kind, colour, x, y, size)], colour
        if level == 1:  # red half the time, another colour otherwise
            answer = rng.choice(["yes", "no"])
            colour = "red" if answer == "yes" else rng.choice([c for c in PALETTE if c != "red"])
            shapes = [(kind, colour, x, y, size)]
    elif level == 3:
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
    return {"prompt": question, "image": render(shapes), "answer": answer, "type": ANSWER_TYPE[level],
            "reward": "vision", "difficulty": difficulty}


def shapes_split(seed: int, difficulty: int, eval_size: int,
                 curriculum: bool = False) -> tuple[TaskStream, list[dict]]:
    """The shapes taskset; held-out images never appear in training (each level has one question, so the image is
    what makes a task)."""
    return held_out_split("shapes", shapes_task, "image", seed, difficulty, eval_size, curriculum)
