#!/usr/bin/env python
"""The recipe behind qoqserve/data/calibration_en.txt: the embedded model writes
one sampled answer per topic x style, so the text is ours to redistribute.

    python scripts/make_calibration_text.py > qoqserve/data/calibration_en.txt

Kept out of the package: it drives the whole engine (`LLM`), which the
quantizer's modules must not import.
"""
from qoqserve.llm import LLM
from qoqserve.sampling_params import SamplingParams

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



def generate_calibration_text(llm, max_tokens: int = 320, seed: int = 0) -> str:
    convs = [[{"role": "user", "content": style.format(topic)}]
             for topic in CALIBRATION_TOPICS for style in PROMPT_STYLES[:2]]
    params = [SamplingParams(temperature=0.7, top_p=0.95, max_tokens=max_tokens, seed=seed + i,
                             repetition_penalty=1.1)
              for i in range(len(convs))]
    outs = llm.chat(convs, params, use_tqdm=True)
    return "\n\n".join(o.text.strip() for o in outs if o.text.strip())


if __name__ == "__main__":
    print(generate_calibration_text(LLM(dtype="bfloat16", max_num_seqs=128)))
