"""Write a LLaVA-style dataset: one JSON file of conversations and a folder of images, the format most SFT data
comes in (LLaVA-Instruct, LLaMA-Factory, ms-swift). Generated offline from the demo's samples (text, one to four
images, long multi-turn samples), for the README's quick start:

    python examples/llava_json.py examples/demo/llava          # llava.json + images/

Each record is ``{"id", "image": "<name>" | [names], "conversations": [{"from": "human"|"gpt"|"system",
"value": ...}]}`` with ``<image>`` tags in the text (some records leave them out: packtool then puts the images
before the first user text, as LLaVA's loaders do).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import demo

_ROLE = {"system": "system", "user": "human", "assistant": "gpt", "human": "human", "gpt": "gpt"}


def llava_record(index: int, members: dict[str, bytes], images: Path) -> dict:
    """The LLaVA record of one demo sample; its images are written into ``images``."""
    doc = json.loads(members["json"])
    turns = doc if isinstance(doc, list) else doc.get("conversations", doc.get("messages"))
    conversations = [{"from": _ROLE[t.get("from", t.get("role"))], "value": t.get("value", t.get("content"))}
                     for t in turns]
    names = []
    for part in _image_parts(members):
        name = f"{index:05d}-{len(names)}.{part.rsplit('.', 1)[-1]}"
        (images / name).write_bytes(members[part])
        names.append(name)
    record: dict = {"id": f"demo-{index:05d}", "conversations": conversations}
    if names:
        record["image"] = names[0] if len(names) == 1 else names
    return record


def _image_parts(members: dict[str, bytes]) -> list[str]:
    from packtool.packer.sources.conversation import image_parts

    return image_parts(members)


def build(out: Path, *, samples: int = 300, seed: int = 7) -> Path:
    """Write ``out/llava.json`` and ``out/images/``; returns the JSON file."""
    images = out / "images"
    images.mkdir(parents=True, exist_ok=True)
    kinds = demo.sample_kinds(samples, long_fraction=0.04, image_fraction=0.5, rng=random.Random(seed))
    records = [llava_record(i, demo.make_sample(i, kind, seed, 1.0)[0], images) for i, kind in enumerate(kinds)]
    path = out / "llava.json"
    path.write_text(json.dumps(records, indent=1) + "\n")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--samples", type=int, default=300)
    args = parser.parse_args()
    path = build(args.out, samples=args.samples)
    print(f"wrote {path} and {args.out / 'images'}")


if __name__ == "__main__":
    main()
