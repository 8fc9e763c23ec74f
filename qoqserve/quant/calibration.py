"""Calibration text: what the quantizer measures activations on.

The default set ships with the package (qoqserve/data/calibration_en.txt). It
was written by the embedded SmolLM2-135M-Instruct itself from the prompts in
CALIBRATION_TOPICS (see `generate_calibration_text`), so the project may
redistribute it, and it never overlaps the evaluation texts (the license files
in /usr/share/common-licenses): a test checks that no 12-token run is shared.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

DEFAULT_CALIB_FILE = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data",
                                  "calibration_en.txt")

CALIBRATION_TOPICS = [
    "how volcanoes form", "the water cycle", "the history of the printing press",
    "how a bicycle works", "photosynthesis", "the Roman Empire", "how vaccines train the immune system",
    "the life of honey bees", "why leaves change colour in autumn", "how airplanes fly",
    "the invention of the telephone", "black holes", "how to bake sourdough bread",
    "the causes of the French Revolution", "plate tectonics", "how computers store numbers",
    "the migration of birds", "the Great Wall of China", "how rainbows appear",
    "the rules of chess", "how the heart pumps blood", "the history of jazz",
    "ocean tides", "how solar panels make electricity", "the ancient Olympic Games",
    "coral reefs", "how a refrigerator keeps food cold", "the Silk Road",
    "the discovery of penicillin", "how earthquakes are measured", "the planets of the solar system",
    "how to plant a vegetable garden", "the story of the Wright brothers", "deserts and how animals survive there",
    "the human skeleton", "how bridges carry weight", "the history of the bicycle",
    "why we sleep", "the northern lights", "how a steam engine works", "the life cycle of a frog",
    "the invention of paper money", "glaciers", "how sound travels", "the Renaissance",
    "how maps are made", "the Amazon rainforest", "how batteries store energy",
    "the history of tea", "how the internet sends messages", "the moon and its phases",
    "how to write a good story", "the Industrial Revolution", "how clouds form",
    "the history of mathematics", "elephants", "how a camera captures light",
    "the ancient Egyptians and the pyramids", "how muscles grow", "recycling and why it matters",
    "a sorting algorithm in Python", "a short Python function that counts words in a text",
    "a recipe for vegetable soup", "a day in the life of a lighthouse keeper",
]

PROMPT_STYLES = ["Write a detailed explanation of {}.", "Write a short essay about {}.",
                 "Explain {} to a curious student, step by step.", "Tell me a story that involves {}."]


@dataclass
class CalibrationSet:
    samples: list[list[int]]     # token ids, each of seq_len tokens
    sha256: str                  # of the source text, recorded in the checkpoint
    source: str


def load_calibration(tokenizer, path: str | None, num_samples: int, seq_len: int) -> CalibrationSet:
    """Cut the text into num_samples windows of seq_len tokens, evenly spread."""
    path = path or DEFAULT_CALIB_FILE
    with open(path, encoding="utf-8") as f:
        text = f.read()
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) < seq_len:
        raise ValueError(f"{path}: {len(ids)} tokens, fewer than one calibration sample of {seq_len}")
    available = len(ids) // seq_len
    n = min(num_samples, available)
    step = available / n
    samples = [ids[int(i * step) * seq_len:(int(i * step) + 1) * seq_len] for i in range(n)]
    return CalibrationSet(samples, hashlib.sha256(text.encode()).hexdigest(), os.path.abspath(path))


def generate_calibration_text(llm, max_tokens: int = 320, seed: int = 0) -> str:
    """The recipe behind the shipped file: one sampled answer per topic x style."""
    from qoqserve.sampling_params import SamplingParams

    convs = [[{"role": "user", "content": style.format(topic)}]
             for topic in CALIBRATION_TOPICS for style in PROMPT_STYLES[:2]]
    params = [SamplingParams(temperature=0.7, top_p=0.95, max_tokens=max_tokens, seed=seed + i,
                             repetition_penalty=1.1)
              for i in range(len(convs))]
    outs = llm.chat(convs, params, use_tqdm=True)
    return "\n\n".join(o.text.strip() for o in outs if o.text.strip())


if __name__ == "__main__":  # python -m qoqserve.quant.calibration > qoqserve/data/calibration_en.txt
    from qoqserve.llm import LLM

    print(generate_calibration_text(LLM(dtype="bfloat16", max_num_seqs=128)))
